"""Shared fixtures: a real `lightgate serve` subprocess on free ports."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Ports a test names before a process binds them (a Raft peer list, a restart on the same
# ports) come from below the kernel's ephemeral range, so an outgoing connection of any
# process cannot take one in between, as happened to a Raft port in CI. Each pytest-xdist
# worker draws from its own slice of that range: two workers that each found a port free
# could otherwise both hand it out before either server bound it, as happened in CI.
_EPHEMERAL_LOW = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
_handed_out: set[int] = set()


def _worker_slice() -> range:
    low = max(1024, _EPHEMERAL_LOW - 12000)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    width = (_EPHEMERAL_LOW - low) // count
    return range(low + index * width, low + (index + 1) * width)


def reserved_port() -> int:
    """A loopback port free now, outside the ephemeral range, in this worker's slice, and
    not handed out before (once the slice is spent, ports of finished tests are reused)."""
    ports = _worker_slice()
    rng = random.Random()
    for attempt in range(2000):
        if attempt == 1000:
            _handed_out.clear()
        port = rng.choice(ports)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError("no free loopback port below the ephemeral range")


class Server:
    """A `lightgate` server command in a subprocess (serve by default); restartable on the
    same data directory and ports."""

    def __init__(self, data_dir: Path | None, *extra: str, command: str = "serve",
                 host: str = "127.0.0.1", http_host: str = "127.0.0.1",
                 prefix: list[str] | None = None) -> None:
        self.data_dir = data_dir
        self.extra = list(extra)
        self.command = command
        self.host = host  # the native and MQTT ports' address
        self.http_host = http_host
        self.prefix = prefix or []  # e.g. `ip netns exec NAME`: run it in a namespace
        self.proc: subprocess.Popen | None = None
        self.addrs: dict[str, str] = {}
        self.log: list[str] = []
        # Named up front, so a restart finds its ports free (see reserved_port).
        self.mqtt_port = reserved_port()
        self.native_port = reserved_port()

    def _args(self) -> list[str]:
        args = [*self.prefix, sys.executable, "-m", "lightgate", "--log-level", "DEBUG",
                self.command]
        if self.command in ("serve", "store"):
            args += ["--data-dir", str(self.data_dir), "--native",
                     f"{self.host}:{self.native_port}"]
        if self.command in ("serve", "gateway"):
            args += ["--mqtt", f"{self.host}:{self.mqtt_port}", "--ws", f"{self.host}:0",
                     "--sys-interval", "1"]
        return [*args, "--http", f"{self.http_host}:0", *self.extra]

    def start(self) -> Server:
        self.proc = subprocess.Popen(
            self._args(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        # Read its log from the start: what it says while it waits (for a store, say)
        # is visible before it is ready, and a chatty start never fills the pipe.
        before = len(self.log)
        drain = threading.Thread(target=self._drain, args=(self.proc,), daemon=True)
        drain.start()
        line = self.proc.stdout.readline()
        if not line.startswith("ready "):
            self.proc.wait(10)
            drain.join(5)
            raise RuntimeError(f"server did not start: {line!r} {''.join(self.log[before:])}")
        self.addrs = dict(part.split("=", 1) for part in line.split()[1:])
        # Keep the ports on restart, as clients of a real broker would expect.
        if "mqtt" in self.addrs:
            self.mqtt_port = int(self.addrs["mqtt"].rsplit(":", 1)[1])
        if "native" in self.addrs:
            self.native_port = int(self.addrs["native"].rsplit(":", 1)[1])
        return self

    def _drain(self, proc: subprocess.Popen) -> None:
        for line in proc.stderr:
            self.log.append(line)

    @property
    def port(self) -> int:
        return self.mqtt_port

    @property
    def native(self) -> str:
        return self.addrs["native"]

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        code = self.proc.wait(30)
        self.proc = None
        return code

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def logs(self) -> str:
        return "".join(self.log)

    def wait_log(self, text: str, count: int = 1, timeout: float = 10.0) -> bool:
        """Whether `text` shows up `count` times in the log within `timeout` (the log is
        read by a thread, so a line may arrive a moment after the event)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.logs().count(text) >= count:
                return True
            time.sleep(0.05)
        return False


class RedisServer:
    """A real redis-server on a free loopback port."""

    def __init__(self, *also: str) -> None:
        self.port = reserved_port()  # kept across stop/start (see reserved_port)
        self.proc: subprocess.Popen | None = None
        self.binds = ["127.0.0.1", *also]  # more addresses (a test network's bridge)

    @property
    def url(self) -> str:
        return f"redis://{self.binds[-1]}:{self.port}"

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", *self.binds, "--save", "",
             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (make test installs it from Debian)")
    srv = RedisServer().start()
    yield srv
    srv.stop()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    srv = Server(tmp_path / "data").start()
    yield srv
    if srv.proc is not None:
        assert srv.stop() == 0, srv.logs()[-3000:]


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs, to fill up: skipped where it cannot be mounted."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {res.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("shared") / "data").start()
    yield srv
    if srv.proc is not None:
        assert srv.stop() == 0, srv.logs()[-3000:]
