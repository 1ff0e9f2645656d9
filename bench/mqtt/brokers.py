"""The brokers under test, each started on a free 127.0.0.1 port with equivalent settings
for one scenario and stopped after it (SIGTERM), so that no scenario inherits another's
state. A broker that fails to start raises with its log's tail."""

from __future__ import annotations

import collections
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import ROOT, progress

MOSQUITTO = Path("/usr/sbin/mosquitto")


BROKERS = ["mosquitto", "lightgate-async", "lightgate-sync", "lightgate-separated", "amqtt"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Broker:
    name: str
    port: int = 0
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)
    tmp: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="bench-")))

    @property
    def pid(self) -> int:
        return self.procs[-1].pid  # the process that holds the MQTT connections

    def died(self) -> str | None:
        for p in self.procs:
            if p.poll() is not None:
                return f"broker process exited with {p.returncode}: {self.log_tail()}"
        return None

    def log_tail(self, n: int = 600) -> str:
        tails = [f.read_text(errors="replace")[-n:] for f in sorted(self.tmp.glob("*.log"))]
        return " | ".join(t.strip() for t in tails if t.strip())

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
        shutil.rmtree(self.tmp, ignore_errors=True)


def _spawn(b: Broker, cmd: list[str], tag: str, ready_line: bool) -> subprocess.Popen[Any]:
    log = open(b.tmp / f"{tag}.log", "w")  # noqa: SIM115 - the child owns it
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE if ready_line else log,
                         stderr=log, text=True)
    log.close()
    b.procs.append(p)
    return p


def _wait_ready(b: Broker, proc: subprocess.Popen[Any], timeout: float = 60) -> dict[str, str]:
    """Read the `ready k=v ...` line, bounded in time (a broker may hang on start-up)."""
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        raise RuntimeError(f"{b.name}: no ready line within {timeout:.0f} s: {b.log_tail()}")
    line = proc.stdout.readline()
    sel.close()
    if not line.startswith("ready"):
        raise RuntimeError(f"{b.name} did not start: {line!r} {b.log_tail()}")
    # Keep reading stdout so a chatty broker never blocks on a full pipe.
    threading.Thread(target=collections.deque, args=(proc.stdout, 0), daemon=True).start()
    return dict(p.split("=", 1) for p in line.split()[1:])


def _wait_port(b: Broker, port: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (err := b.died()) is not None:
            raise RuntimeError(err)
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{b.name}: nothing listens on {port}: {b.log_tail()}")


def _lightgate_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "lightgate", "--log-level", "WARNING", *args]


def start_broker(name: str) -> Broker:
    b = Broker(name, free_port())
    try:
        _start(b)
    except BaseException:
        b.stop()
        raise
    return b


def _start(b: Broker) -> None:
    name = b.name
    if name == "mosquitto":
        ensure_mosquitto()
        conf = b.tmp / "mosquitto.conf"
        conf.write_text(f"listener {b.port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
                        "max_inflight_messages 32\nmax_queued_messages 100000\n"
                        "log_dest stderr\nlog_type error\n")
        _spawn(b, [str(MOSQUITTO), "-c", str(conf)], "mosquitto", False)
        _wait_port(b, b.port)
    elif name == "trio-floor":
        # What trio itself costs a message, stored (bench/floors.py: a task per
        # connection, each PUBLISH stored and indexed, then forwarded): QoS 0 only.
        _spawn(b, [sys.executable, str(ROOT / "bench" / "floors.py"), "serve", "taskstore",
                   str(b.port)], "trio-floor", False)
        _wait_port(b, b.port)
    elif name == "amqtt":
        p = _spawn(b, [sys.executable, str(ROOT / "bench" / "amqtt_broker.py"), str(b.port)],
                   "amqtt", True)
        _wait_ready(b, p)
        _wait_port(b, b.port)
    elif name in ("lightgate-async", "lightgate-sync"):
        # Same bounds as the Mosquitto config: 32 in flight, 100,000 queued per session.
        p = _spawn(b, _lightgate_cmd(
            "serve", "--data-dir", str(b.tmp / "d"), "--ws", "off",
            "--mqtt", f"127.0.0.1:{b.port}",
            "--native", "127.0.0.1:0", "--http", "127.0.0.1:0", "--max-inflight", "32",
            "--max-offline-messages", "100000", "--flush", name.split("-")[1]),
            "lightgate", True)
        _wait_ready(b, p)
    elif name == "lightgate-separated":
        if not shutil.which("redis-server"):
            raise RuntimeError("redis-server missing (apt-get install redis-server)")
        redis_port = free_port()
        _spawn(b, ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1",
                   "--save", "", "--appendonly", "no"], "redis", False)
        _wait_port(b, redis_port)
        url = f"redis://127.0.0.1:{redis_port}"
        store = _spawn(b, _lightgate_cmd("store", "--data-dir", str(b.tmp / "d"), "--native",
                                         "127.0.0.1:0", "--http", "127.0.0.1:0", "--notify",
                                         url), "store", True)
        native = _wait_ready(b, store)["native"]
        gw = _spawn(b, _lightgate_cmd("gateway", "--store", native, "--notify", url, "--mqtt",
                                      f"127.0.0.1:{b.port}", "--http", "127.0.0.1:0",
                                      "--max-inflight", "32"), "gateway", True)
        _wait_ready(b, gw)
    else:
        raise ValueError(f"unknown broker {name}")


def ensure_mosquitto() -> None:
    """CI machines start empty: install Debian's broker on first use."""
    if MOSQUITTO.exists():
        return
    progress("installing Debian's mosquitto (apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    res = subprocess.run("apt-get update -qq && apt-get install -y -qq mosquitto", shell=True,
                         env=env, capture_output=True, text=True, timeout=600)
    if res.returncode != 0 or not MOSQUITTO.exists():
        raise RuntimeError(f"could not install mosquitto: {res.stderr[-500:]}")
    # Debian's package starts a system broker on 1883; ours get their own ports and config.
