"""One row of the results: start a broker, run one scenario on it while measuring the
broker's CPU (per process and per thread) and optionally profiling it with py-spy, then
stop it. A failure becomes the row's `error`, so the run goes on."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .brokers import Broker, start_broker
from .procfs import cpu_seconds, thread_report, thread_times
from .scenarios import SCENARIOS
from .wire import set_keepalive

FIELDS = ("msgs_per_s", "p50_ms", "p99_ms", "kb_per_conn", "connects_per_s")


def run_one(scenario: str, name: str, size: dict[str, Any],
            profile_dir: Path | None) -> dict[str, Any]:
    fn, figure, higher = SCENARIOS[scenario]
    row: dict[str, Any] = {"scenario": scenario, "broker": name, **dict.fromkeys(FIELDS),
                           "ratio_vs_mosquitto": None, "higher_is_better": higher,
                           "main_figure": figure}
    t0 = time.monotonic()
    broker = None
    prof = None
    try:
        row["load_1m_before"] = os.getloadavg()[0]  # other work on the machine skews results
        broker = start_broker(name)
        if profile_dir and name.startswith("lightgate"):
            prof = profile_start(broker, profile_dir, f"{scenario}-{name}")
        set_keepalive(broker.keepalive)
        pids = [p.pid for p in broker.procs]
        cpu0, threads0, t1 = cpu_seconds(pids), thread_times(pids), time.monotonic()
        row.update(fn(broker, size))
        if broker.notes:
            row["notes"] = "; ".join(filter(None, [row.get("notes"), broker.notes]))
        cpu = cpu_seconds(pids) - cpu0
        if row.get("received"):
            row["cpu_us_per_msg"] = round(cpu * 1e6 / row["received"], 2)
            row["threads"] = thread_report(threads0, thread_times(pids), row["received"],
                                           time.monotonic() - t1)
        if err := broker.died():
            row["error"] = err
    except Exception as exc:  # record it; the other brokers and scenarios still run
        row["error"] = f"{type(exc).__name__}: {exc}"[:1000]
    finally:
        set_keepalive(0)
        if prof:
            row["profile_top"] = profile_stop(*prof)[:10]
        if broker:
            broker.stop()
    row["duration_s"] = round(time.monotonic() - t0, 1)
    return row


def profile_start(b: Broker, out_dir: Path, tag: str) -> tuple[subprocess.Popen[Any], Path]:
    raw = out_dir / f"{tag}.collapsed"
    spy = Path(sys.executable).with_name("py-spy")
    p = subprocess.Popen([str(spy) if spy.exists() else "py-spy", "record", "--pid",
                          str(b.pid), "--format", "raw", "--rate", "250", "-o", str(raw)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return p, raw


def profile_stop(p: subprocess.Popen[Any], raw: Path, top: int = 15) -> list[str]:
    """Stop py-spy and list the functions with the most self time (leaf frames)."""
    p.send_signal(signal.SIGINT)
    try:
        p.wait(30)
    except subprocess.TimeoutExpired:
        p.kill()
    if not raw.exists():
        return ["py-spy wrote nothing (ptrace not permitted?)"]
    self_time: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        leaf = stack.rsplit(";", 1)[-1]
        func, _, loc = leaf.partition(" (")
        self_time[f"{func} ({loc.rsplit(':', 1)[0]})"] += int(n)
        total += int(n)
    lines = [f"{100 * n / total:5.1f}% {f}" for f, n in self_time.most_common(top)]
    raw.with_suffix(".top.txt").write_text("\n".join(lines) + "\n")
    return lines
