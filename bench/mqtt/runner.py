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

from .brokers import Broker, Options, Window, start_broker
from .loadgen import loadgen_cpu
from .procfs import Usage, thread_report, usage
from .scenarios import NEEDS, SCENARIOS
from .tls import Certs, client_context
from .wire import set_keepalive, set_tls

FIELDS = ("msgs_per_s", "p50_ms", "p99_ms", "kb_per_conn", "connects_per_s")


def run_one(scenario: str, name: str, size: dict[str, Any], profile_dir: Path | None,
            certs: Certs | None = None, tls: bool = False) -> dict[str, Any]:
    """One row; on the broker's TLS listener with `certs` when `tls` or when the scenario
    needs mutual TLS (its clients then present the run's client certificate)."""
    fn, figure, higher = SCENARIOS[scenario]
    needs = NEEDS[scenario](size) if scenario in NEEDS else {}
    opts = Options(certs=certs if tls or needs.get("mutual") else None, **needs)
    row: dict[str, Any] = {"scenario": scenario, "broker": name, **dict.fromkeys(FIELDS),
                           "ratio_vs_mosquitto": None, "higher_is_better": higher,
                           "main_figure": figure, "tls": opts.certs is not None,
                           "mutual_tls": opts.mutual}
    t0 = time.monotonic()
    broker = None
    meter = None
    try:
        if (tls or opts.mutual) and certs is None:
            raise ValueError("TLS without the run's certificates")
        row["load_1m_before"] = os.getloadavg()[0]  # other work on the machine skews results
        broker = start_broker(name, opts)
        profile = (profile_dir, f"{scenario}-{name}") if profile_dir and \
            name.startswith("lightgate") else None
        set_keepalive(broker.keepalive)
        set_tls(client_context(opts.certs, opts.mutual) if opts.certs else None)
        meter = broker.window = Meter(broker, profile)
        meter.begin()
        loadgen_before = loadgen_cpu()
        row.update(fn(broker, size))
        loadgen_used = loadgen_cpu() - loadgen_before
        meter.end()
        if broker.notes:
            row["notes"] = "; ".join(filter(None, [row.get("notes"), broker.notes]))
        before, after = meter.before, meter.after
        assert before and after
        # Per message received, or received in the window when a scenario narrowed it.
        if msgs := row.get("window_msgs", row.get("received")):
            row["cpu_us_per_msg"] = round((after.cpu - before.cpu) * 1e6 / msgs, 2)
            row["threads"] = thread_report(before.threads, after.threads, msgs,
                                           after.at - before.at)
            # What the load generator's workers spent meanwhile (TLS costs them too).
            row["loadgen_cpu_us_per_msg"] = round(loadgen_used * 1e6 / msgs, 2)
        if broker.python and (total := after.python[1] - before.python[1]) > 0:
            row["python_cpu_share"] = round((after.python[0] - before.python[0]) / total, 3)
        if err := broker.died():
            row["error"] = err
    except Exception as exc:  # record it; the other brokers and scenarios still run
        row["error"] = f"{type(exc).__name__}: {exc}"[:1000]
    finally:
        set_keepalive(0)
        set_tls(None)
        if meter:
            meter.end()
            if meter.top is not None:
                row["profile_top"] = meter.top[:10]
        if broker:
            broker.stop()
    row["duration_s"] = round(time.monotonic() - t0, 1)
    return row


class Meter(Window):
    """The broker's CPU (in all and per thread) and, with a profile directory, py-spy,
    from begin() to end(); a scenario that calls begin() again (its timed window opens
    after a long set-up) starts both afresh."""

    def __init__(self, b: Broker, profile: tuple[Path, str] | None) -> None:
        self.broker, self.profile = b, profile
        self.pids = [p.pid for p in b.procs]
        self.python = b.python
        self.before: Usage | None = None
        self.after: Usage | None = None
        self.prof: tuple[subprocess.Popen[Any], Path] | None = None
        self.top: list[str] | None = None

    def begin(self) -> None:
        if self.prof:  # what it sampled so far was set-up: drop it
            profile_stop(*self.prof)  # (a SIGKILLed py-spy might leave the broker stopped)
            self.prof[1].unlink(missing_ok=True)
            self.prof[1].with_suffix(".top.txt").unlink(missing_ok=True)
        if self.profile:
            self.prof = profile_start(self.broker, *self.profile)
        self.before, self.after = usage(self.pids, self.python), None

    def end(self) -> None:
        if self.after is None:
            self.after = usage(self.pids, self.python)
            if self.prof:
                self.top = profile_stop(*self.prof)
                self.prof = None


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
