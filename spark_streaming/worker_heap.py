"""Spark's reused Python workers walk every object they hold after each task: keep the
imported modules out of that walk.

With `spark.python.worker.reuse` (on here, and Spark's default), pyspark's daemon runs a
full `gc.collect()` in a worker after every task and every driver-side call (planning a
read, making and committing a stream writer). A worker that has imported pyspark,
pyarrow and this package holds ~50,000 objects that live as long as it does, and an
executor's worker ~30,000 more from its first task's imports; a full collection examines
them all: 30-35 ms on an idle 2-core machine, 50-190 ms loaded, for each of the four
workers a micro-batch uses. That CPU is taken from the batch that runs next, and a
worker still collecting makes the next task given to it wait.

`gc.freeze()` moves the objects alive at that moment to a generation the collector never
examines (they are still freed by reference counting); objects made later are collected
as before.
"""

from __future__ import annotations

import gc
import os

# Survivors of the daemon's last collection worth freezing: imported modules. A task
# leaves a few hundred (its connection kept for the next, the daemon's own).
FREEZE_FROM = 5_000


def freeze_imports() -> None:
    """In a Spark Python worker that is reused (where the daemon collects after every
    task), when many objects are alive that the collector examines: freeze them. Called
    when this package is imported (a planner's worker imports nothing after) and as an
    executor's task starts (right after the daemon's collection: what is alive then
    lives on, the modules the worker's first task imported)."""
    if os.environ.get("SPARK_REUSE_WORKER") and len(gc.get_objects()) >= FREEZE_FROM:
        gc.freeze()
