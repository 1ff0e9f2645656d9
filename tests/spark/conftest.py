"""Spark tests: one small local[2] session shared by the directory (a JVM start costs tens
of seconds on a small machine), a `lightgate serve` per test, and bounded waits on
queries and checkpoints that fail with what the query was doing.

Without pyspark, pyarrow, pandas or Java the tests skip; `make test` sets
LIGHTGATE_REQUIRE_SPARK=1 so that CI fails instead of skipping them silently.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT

NEEDS = [m for m in ("pyspark", "pyarrow", "pandas") if importlib.util.find_spec(m) is None]
SKIP_REASON = (f"{', '.join(NEEDS)} not installed: pip install 'lightgate[spark]'"
               if NEEDS else "")
REQUIRED = os.environ.get("LIGHTGATE_REQUIRE_SPARK", "") not in ("", "0")


def java_missing() -> str | None:
    from spark_streaming.session import SparkSetupError, find_java

    try:
        find_java()
    except SparkSetupError as exc:
        return str(exc)
    return None


def missing() -> str | None:
    """Why Spark cannot run here, or None."""
    return SKIP_REASON or java_missing()


def require_spark() -> None:
    """At the top of a test module that imports pyspark: skip the module when Spark cannot
    run here, or fail it when LIGHTGATE_REQUIRE_SPARK is set (CI)."""
    reason = missing()
    if reason is None:
        return
    if REQUIRED:
        pytest.fail(f"LIGHTGATE_REQUIRE_SPARK is set but Spark cannot run: {reason}",
                    pytrace=False)
    pytest.skip(reason, allow_module_level=True)


@pytest.fixture(scope="package")
def spark() -> Iterator[Any]:
    """Package scope: the JVM goes away when tests/spark is done, not at the end of the
    whole suite."""
    require_spark()
    from spark_streaming.session import get_spark

    session = get_spark("local[2]", "lightgate-tests",
                        {"spark.python.worker.faulthandler.enabled": "true",
                         # A loaded 2-core machine may start a Python worker slowly.
                         "spark.python.authenticate.socketTimeout": "60s"})
    yield session
    for q in session.streams.active:
        q.stop()
    session.stop()


# -- the store side ------------------------------------------------------------------------
def store_ends(addr: str, topic: str) -> dict[str, int]:
    """Next offset of every partition queue of `topic` ({} when it has none yet)."""
    from spark_streaming.native import StoreClient

    with StoreClient(addr) as c:
        return {q["queue"]: int(q["max_offset"]) for q in c.describe(topic)}


def read_topic(addr: str, topic: str) -> list[tuple[str, dict]]:
    """Every message of `topic` as (mqtt_topic, JSON body), queue by queue in order."""
    from spark_streaming.native import StoreClient

    out = []
    with StoreClient(addr) as c:
        for q in sorted(c.describe(topic), key=lambda q: q["queue"]):
            for _, m in c.read_range(q["queue"], int(q["min_offset"]), int(q["max_offset"])):
                out.append((m.topic, json.loads(m.body)))
    return out


def _nonzero(offsets: dict[str, int]) -> dict[str, int]:
    return {q: n for q, n in offsets.items() if n}


# -- the Spark side ------------------------------------------------------------------------
def _as_offsets(raw: Any) -> dict[str, int]:
    if isinstance(raw, str):
        raw = json.loads(raw)
    return {str(q): int(n) for q, n in (raw or {}).items()}


def progress_summary(query: Any, last: int = 8) -> str:
    lines = [f"query {query.name}: active={query.isActive} status={query.status}"]
    for p in query.recentProgress[-last:]:
        src = p["sources"][0] if p["sources"] else {}
        lines.append(f"  batch {p['batchId']}: rows={p['numInputRows']} "
                     f"ms={p['durationMs'].get('triggerExecution')} "
                     f"end={src.get('endOffset')}")
    if not query.isActive and query.exception() is not None:
        lines.append(f"  exception: {query.exception()}")
    return "\n".join(lines)


def processed_offsets(query: Any) -> dict[str, int]:
    """The source end offsets of the query's last finished batch ({} before the first)."""
    p = query.lastProgress
    if not p or not p["sources"]:
        return {}
    return _as_offsets(p["sources"][0]["endOffset"])


def wait_caught_up(query: Any, addr: str, topic: str, timeout: float = 120.0) -> None:
    """Until the query's last finished batch reached the store's end of `topic` (a
    bounded processAllAvailable); fails with the query's recent progress."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not query.isActive:
            raise AssertionError(f"the query stopped early\n{progress_summary(query)}")
        want = _nonzero(store_ends(addr, topic))
        if _nonzero(processed_offsets(query)) == want:
            return
        time.sleep(0.2)
    raise AssertionError(f"not caught up with {topic} {store_ends(addr, topic)} within "
                         f"{timeout:.0f} s\n{progress_summary(query)}")


def wait_until(cond: Callable[[], Any], timeout: float, what: str,
               detail: Callable[[], str] = lambda: "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout:.0f} s\n{detail()}")


def committed_offsets(checkpoint: Path) -> dict[str, int] | None:
    """Source offsets of the last committed batch in a query's checkpoint directory (the
    `offsets/N` file whose `commits/N` exists), or None before the first commit. Lets a
    test see how far a query in another process (the CLI) has got."""
    commits = [int(p.name) for p in (checkpoint / "commits").glob("[0-9]*")]
    if not commits:
        return None
    lines = (checkpoint / "offsets" / str(max(commits))).read_text().splitlines()
    # "v1", the batch metadata, then one line per source.
    return _as_offsets(lines[2])


class Job:
    """`lightgate analytics run …` in a subprocess, its stderr collected."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "lightgate", *args], cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    def log(self, tail: int = 3000) -> str:
        return "".join(self.lines)[-tail:]

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(text in line for line in self.lines):
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"the job exited ({self.proc.returncode}) before "
                                     f"{text!r}:\n{self.log()}")
            time.sleep(0.2)
        raise AssertionError(f"no {text!r} from the job within {timeout:.0f} s:\n{self.log()}")

    def wait_committed(self, checkpoint: Path, addr: str, topic: str,
                       timeout: float) -> None:
        """Until the query checkpointed at `checkpoint` committed a batch that reaches the
        store's current end of `topic`: everything published before was processed and
        whatever it produced is stored."""
        want = _nonzero(store_ends(addr, topic))

        def done() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"the job exited ({self.proc.returncode}):\n{self.log()}")
            got = committed_offsets(checkpoint)
            return got is not None and _nonzero(got) == want

        wait_until(done, timeout, f"{checkpoint.name} committing {topic} up to {want}",
                   lambda: f"committed: {committed_offsets(checkpoint)}\n{self.log()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)
