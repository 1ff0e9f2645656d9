"""Spark's reused Python workers walk every object they hold after each task: keep the
imported modules out of that walk.

With `spark.python.worker.reuse` (on here, and Spark's default), pyspark's daemon runs a
full `gc.collect()` in a worker after every task and every driver-side call (planning a
read, making and committing a stream writer). A worker that has imported pyspark,
pyarrow and this package holds ~80,000 objects that live as long as it does; a full
collection examines them all: 30-35 ms on an idle 2-core machine, 100-190 ms loaded, for
each of the four workers a micro-batch uses. That CPU is taken from the batch that runs
next, and a worker still collecting makes the next task given to it wait.

`gc.freeze()` moves the objects alive at that moment to a generation the collector never
examines (they are still freed by reference counting); objects made later are collected
as before.
"""

from __future__ import annotations

import gc
import os

_frozen = False


def freeze_imports() -> None:
    """Once per process, in a Spark Python worker that is reused (where the daemon
    collects after every task): freeze what is alive now, the imported modules."""
    global _frozen
    if _frozen or not os.environ.get("SPARK_REUSE_WORKER"):
        return
    _frozen = True
    gc.freeze()
