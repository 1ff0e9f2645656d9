"""What an idle connection costs the server that carries it on the native plane: its
resident memory grows by at most a bound per idle, promoted MQTT connection (raw
sockets against a real `lightgate serve` with LIGHTGATE_NATIVE=1). The bench's
`idle_conns` scenario measures the same at 19,000 connections (1.9 kB a connection,
4.7-6.3 kB before promoted connections let go of what only Python's I/O uses); at
6,000 the process's fixed costs weigh a little more."""

from __future__ import annotations

import resource
import selectors
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway import mqtt
from serving import plane
from tests.conftest import Server
from tests.plane.conftest import native_server
from tests.plane.test_handover import native_counters

pytestmark = pytest.mark.skipif(plane.NATIVE is None or not hasattr(plane.NATIVE, "Engine"),
                                reason="the native data plane is not built")

WARM = 200  # connected first, so the baseline has every code path's first costs
IDLE = 6000
KB_PER_CONN = 2.2


@pytest.fixture
def srv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * (WARM + IDLE) + 500  # the server inherits it: both ends of each connection
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"RLIMIT_NOFILE {hard} is below {need}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    s = native_server(tmp_path / "data", monkeypatch)
    yield s
    if s.proc is not None:
        assert s.stop() == 0, s.logs()[-3000:]
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))


def connect_idle(port: int, n: int, first: int, timeout: float = 60) -> list[socket.socket]:
    """n clean-session clients, each CONNECTed and answered, none sending more."""
    sel = selectors.DefaultSelector()
    done: list[socket.socket] = []
    started = pending = 0
    deadline = time.monotonic() + timeout
    while len(done) < n:
        assert time.monotonic() < deadline, f"{len(done)}/{n} connected"
        while started < n and pending < 256:
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            sel.register(s, selectors.EVENT_WRITE, first + started)
            started += 1
            pending += 1
        for key, ev in sel.select(0.2):
            s = key.fileobj  # type: ignore[assignment]
            if ev & selectors.EVENT_WRITE:
                s.send(mqtt.encode(mqtt.Connect(client_id=f"idle-{key.data}"), 4))
                sel.modify(s, selectors.EVENT_READ, key.data)
                continue
            assert s.recv(4) == b"\x20\x02\x00\x00"  # CONNACK, accepted
            sel.unregister(s)
            pending -= 1
            done.append(s)
    sel.close()
    return done


def wait_carried(srv: Server, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while native_counters(srv).get("lightgate_native_connections") != n:
        assert time.monotonic() < deadline, native_counters(srv)
        time.sleep(0.1)


def test_an_idle_promoted_connection_costs_little_memory(srv: Server) -> None:
    assert srv.proc is not None
    socks = connect_idle(srv.port, WARM, 0)
    try:
        wait_carried(srv, WARM)
        time.sleep(1.0)
        before = rss_kb(srv.proc.pid)
        socks += connect_idle(srv.port, IDLE, WARM)
        wait_carried(srv, WARM + IDLE)
        time.sleep(1.0)
        per_conn = (rss_kb(srv.proc.pid) - before) / IDLE
        assert per_conn <= KB_PER_CONN, f"{per_conn:.2f} kB of RSS per idle connection"
    finally:
        for s in socks:
            s.close()
