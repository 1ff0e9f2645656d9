"""One place that makes a SparkSession that works on a fresh machine.

Each setting below is here because its absence fails in a confusing way: without pyarrow
the Python data source dies with "Python worker failed to connect back"; without
PYSPARK_PYTHON the workers may start another interpreter that lacks this package; on a
host whose name does not resolve, the driver cannot bind.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

DEFAULT_MASTER = "local[2]"
# Where Spark keeps it (it moved to a subpackage in Spark 4.x).
CHECKPOINT_FILE_MANAGERS = [
    f"org.apache.spark.sql.execution.streaming.{pkg}FileSystemBasedCheckpointFileManager"
    for pkg in ("checkpointing.", "")]


# What installs pyspark, pyarrow and pandas (and paho-mqtt for `lightgate simulate`).
INSTALL_EXTRA = "pip install 'lightgate[spark]' (in a checkout: pip install -e '.[spark]')"


class SparkSetupError(RuntimeError):
    """Spark cannot start here; the message says what to install or set."""


def check_requirements() -> None:
    """pyspark, pyarrow and Java, with an actionable message for each."""
    try:
        import pyspark  # noqa: F401
    except ImportError:
        raise SparkSetupError(
            f"needs pyspark, which is not installed: {INSTALL_EXTRA}") from None
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise SparkSetupError(
            "needs pyarrow, which is not installed (Python data sources need it; without it "
            f"Spark only says 'Python worker failed to connect back'): {INSTALL_EXTRA}"
        ) from None
    find_java()


def find_java() -> str:
    """JAVA_HOME if it holds a java binary, else `java` on PATH (Spark 4 needs Java 17+)."""
    home = os.environ.get("JAVA_HOME")
    if home:
        java = Path(home) / "bin" / "java"
        if java.exists():
            return str(java)
        raise SparkSetupError(f"JAVA_HOME={home} has no bin/java; fix or unset JAVA_HOME")
    java = shutil.which("java")
    if java is None:
        raise SparkSetupError(
            "Java not found: Spark needs Java 17 or later (Debian: apt-get install "
            "openjdk-17-jre-headless), on PATH or in JAVA_HOME")
    return java


def get_spark(master: str = DEFAULT_MASTER, app_name: str = "lightgate",
              conf: dict[str, Any] | None = None) -> Any:
    """A SparkSession with the `lightgate` data source registered."""
    check_requirements()
    # Driver and workers run this interpreter, which has lightgate and pyarrow installed.
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    from spark_streaming.source import LightgateDataSource

    local = master.startswith("local")
    builder = (
        SparkSession.builder.master(master).appName(app_name)
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2" if local else "8")
        .config("spark.python.worker.reuse", "true")
    )
    if local:
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        # Loopback only: works without a resolvable host name and exposes nothing.
        builder = (builder.config("spark.driver.bindAddress", "127.0.0.1")
                   .config("spark.driver.host", "127.0.0.1"))
        # Every micro-batch writes its offsets and commit files to the checkpoint; the
        # default local file system writes a .crc file beside each (another create and
        # rename): without it a small batch takes ~50 ms less. Local files only.
        builder = (builder.config("spark.hadoop.fs.file.impl",
                                  "org.apache.hadoop.fs.RawLocalFileSystem")
                   .config("spark.hadoop.fs.AbstractFileSystem.file.impl",
                           "org.apache.hadoop.fs.local.RawLocalFs"))
    for key, value in (conf or {}).items():
        builder = builder.config(key, str(value))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    if local and "spark.sql.streaming.checkpointFileManagerClass" not in (conf or {}):
        _local_checkpoint_files(spark)
    spark.dataSource.register(LightgateDataSource)
    return spark


def _local_checkpoint_files(spark: Any) -> None:
    """Checkpoint files written through Hadoop's FileSystem API rather than FileContext,
    whose local file system runs `readlink` in a child process at each create and rename
    (three per file, two files per micro-batch: 20-50 ms of each batch on a small
    machine, more under load). A FileSystem rename is a rename(2): as atomic on a local
    disk. Local mode only, as the file system settings above."""
    for name in CHECKPOINT_FILE_MANAGERS:
        try:
            spark._jvm.java.lang.Class.forName(name)
        except Exception:  # noqa: BLE001 - py4j's error for a class this Spark lacks
            continue
        spark.conf.set("spark.sql.streaming.checkpointFileManagerClass", name)
        return
