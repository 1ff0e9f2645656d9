"""kill -9 a process appending with flush=sync: every acknowledged append survives."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from lightqueue.index import ConsumeQueueIndex
from store.commitlog import CommitLog

ROOT = Path(__file__).resolve().parents[2]


def run_and_kill(data: Path, run: int, seconds: float) -> list[str]:
    """Start the appender, let it run, kill -9 it; return the acks it reported."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.store.crash_appender", str(data), str(run)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "started"
    acks: list[str] = []
    reader = threading.Thread(target=lambda: acks.extend(proc.stdout), daemon=True)
    reader.start()
    time.sleep(seconds)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    reader.join(10)
    # A line cut by the kill was never a complete report of an ack.
    return [a.strip() for a in acks if a.endswith("\n")]


def test_kill_9_loses_no_acknowledged_append(tmp_path: Path) -> None:
    rng = random.Random(7)
    acked: dict[str, int] = {}
    for run in range(3):
        for line in run_and_kill(tmp_path, run, rng.uniform(0.8, 2.0)):
            body, offset = line.split()
            acked[body] = int(offset)
        log = CommitLog(
            tmp_path / "commitlog",
            ConsumeQueueIndex(tmp_path / "index"),
            segment_size=256 * 1024,
            flush="sync",
        )
        report = log.open()
        try:
            assert not report.clean_shutdown
            found = {}
            for entry in log.index.read("crash/+", 0, 10_000_000):
                msg = log.read(entry.phys_offset, entry.size)
                found[msg.body.decode()] = entry.offset
            missing = [b for b in acked if b not in found]
            print(f"run {run}: {len(acked)} acked, {len(found)} found, {len(missing)} missing")
            assert not missing
            # Same offset as acknowledged, and the queue is gap-free.
            assert all(found[b] == off for b, off in acked.items())
            assert sorted(found.values()) == list(range(len(found)))
        finally:
            log.close()
            log.index.close()
    assert len(acked) > 100
