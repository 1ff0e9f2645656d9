"""What get_spark sets up for micro-batches: checkpoint writes without child processes,
Python workers that do not walk their imported modules after every task."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from tests.conftest import ROOT
from tests.spark.conftest import require_spark

require_spark()

FREEZE_COUNT = ("import gc, spark_streaming.worker_heap as w; w.freeze_imports(); "
                "print(gc.get_freeze_count())")


def _freeze_count(env: dict[str, str]) -> int:
    out = subprocess.run([sys.executable, "-c", FREEZE_COUNT], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True, timeout=60)
    return int(out.stdout.strip())


def test_freeze_imports_only_in_a_reused_worker() -> None:
    env = {k: v for k, v in os.environ.items() if k != "SPARK_REUSE_WORKER"}
    assert _freeze_count(env) == 0  # a driver, a user's program: left alone
    assert _freeze_count({**env, "SPARK_REUSE_WORKER": "1"}) > 1000


LATER = ("import gc, spark_streaming.worker_heap as w; w.freeze_imports(); "
         "n = gc.get_freeze_count(); few = [[] for _ in range(100)]; w.freeze_imports(); "
         "assert gc.get_freeze_count() == n, 'a task\\'s few survivors stay collectable'; "
         "many = [[] for _ in range(20_000)]; w.freeze_imports(); "
         "assert gc.get_freeze_count() >= n + 20_000, 'a first task\\'s imports'")


def test_freeze_imports_again_when_many_survive() -> None:
    subprocess.run([sys.executable, "-c", LATER], cwd=ROOT, check=True, timeout=60,
                   env={**os.environ, "SPARK_REUSE_WORKER": "1"})


def test_spark_workers_freeze_their_imports(spark: Any) -> None:
    """A task's Python worker that loaded the data source has its modules frozen: the
    daemon's gc.collect() after each task then skips them."""
    def freeze_count(_: Any) -> Any:
        import gc

        import spark_streaming.source  # noqa: F401  (as unpickling a reader does)

        yield gc.get_freeze_count()

    counts = spark.sparkContext.parallelize(range(2), 2).mapPartitions(freeze_count).collect()
    assert min(counts) > 10_000


def test_local_checkpoints_are_written_through_the_file_system(spark: Any) -> None:
    """Hadoop's FileContext local file system runs `readlink` in a child process for each
    rename (three per checkpoint file here: ~20-50 ms of every micro-batch); its
    FileSystem renames in-process."""
    conf = spark.conf.get("spark.sql.streaming.checkpointFileManagerClass")
    assert conf.endswith(".FileSystemBasedCheckpointFileManager")
