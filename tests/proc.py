"""What a server process holds, read from /proc: its resident memory, its open file
descriptors and the CPU time of its main thread."""

from __future__ import annotations

import os
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
