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


class SparkSetupError(RuntimeError):
    """Spark cannot start here; the message says what to install or set."""


def check_requirements() -> None:
    """pyspark, pyarrow and Java, with an actionable message for each."""
    try:
        import pyspark  # noqa: F401
    except ImportError:
        raise SparkSetupError(
            "pyspark is not installed: pip install 'lightgate[spark]' "
            "(or pip install 'pyspark[sql]>=4.2')") from None
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise SparkSetupError(
            "pyarrow is not installed; Python data sources need it (without it Spark only "
            "says 'Python worker failed to connect back'): pip install pyarrow") from None
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
    spark.dataSource.register(LightgateDataSource)
    return spark
