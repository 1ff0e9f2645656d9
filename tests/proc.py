"""What a server process holds, read from /proc: its resident memory, its open file
descriptors and the CPU time of its main thread; and a pause that waits for it to hold."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for process {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def main_thread_cpu_s(pid: int) -> float:
    """CPU seconds (user and system) of the process's main thread: trio's, in a server."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pause(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP `pid` and wait until every one of its threads has stopped. kill() returns
    once the signal is queued; the group stop begins only when one of the process's
    threads takes the signal, and until then its other threads run on (a native copy
    thread may copy and report more meanwhile, on a loaded machine for milliseconds)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                stat = Path(f"/proc/{pid}/task/{task}/stat").read_text()
            except FileNotFoundError:  # (a thread that ended meanwhile)
                continue
            states.append(stat.rsplit(")", 1)[1].split()[0])
        if all(s in ("T", "t") for s in states):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} not stopped after {timeout} s: {states}")
        time.sleep(0.001)
