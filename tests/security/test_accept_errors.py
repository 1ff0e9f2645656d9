"""Every listener of a server outlives running out of file descriptors (an accept error
never stops a listener, never spins the CPU, and is logged once in a while, not per
accept), and client connections are refused before the process reaches its fd limit, so
what the node opens for itself (segments, RocksDB files, Raft links) still opens."""

from __future__ import annotations

import os
import resource
import socket
import ssl
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import trio
from websockets.sync.client import connect as ws_open

from gateway import mqtt
from store.client import NativeClient
from tests.conftest import Server
from tests.faults.hostile import metric as _metric
from tests.faults.hostile import metrics as _metrics
from tests.latency import Prober, assert_unhurt
from tests.mqtt.paho_client import Client
from tests.proc import main_thread_cpu_s, open_fds, rss_kb
from tests.security.test_tls import CONNACK_OK, make_pki, port_of, raw_tls_connect, tls_args


def _mqtt_ok(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(mqtt.encode(mqtt.Connect(client_id="after"), 4))
            return s.recv(4) == CONNACK_OK
    except OSError:
        return False


def _http_ok(addr: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{addr}/healthz", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def _ws_ok(url: str, ctx: ssl.SSLContext | None = None) -> bool:
    try:
        with ws_open(url, subprotocols=["mqtt"], proxy=None, open_timeout=5,
                     compression=None, ssl=ctx) as ws:
            ws.send(mqtt.encode(mqtt.Connect(client_id="after-ws"), 4))
            return ws.recv(timeout=5) == CONNACK_OK
    except Exception:  # noqa: BLE001 - any failure to serve is a no here
        return False


def _within(ok: Callable[[], bool], tries: int = 3) -> bool:
    """`ok()` is true at one of a few tries, a second apart."""
    for i in range(tries):
        if i:
            time.sleep(1.0)
        try:
            if ok():
                return True
        except Exception:  # noqa: BLE001 - a failed try is a no
            pass
    return False


def _native_ok(addr: str) -> bool:
    async def hello() -> bool:
        async with NativeClient.open(addr, connect_timeout=5.0):
            return True
    try:
        return trio.run(hello)
    except Exception:  # noqa: BLE001
        return False


def test_every_listener_survives_running_out_of_fds(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    srv = Server(tmp_path / "data", *tls_args(pki)).start()
    try:
        pid = srv.proc.pid
        ports = {name: port_of(srv, name) for name in ("mqtt", "mqtt_tls", "ws", "wss")}
        ports["native"] = int(srv.native.rsplit(":", 1)[1])
        ports["http"] = int(srv.addrs["http"].rsplit(":", 1)[1])
        soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        log_before = len(srv.logs().splitlines())
        pending = []
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (3, hard))  # every new fd: EMFILE
        try:
            cpu0 = main_thread_cpu_s(pid)  # trio's: every listener but the Raft port's
            for port in ports.values():  # completed by the kernel, refused by accept
                for _ in range(2):
                    pending.append(socket.create_connection(("127.0.0.1", port), timeout=2))
            time.sleep(3.0)
            cpu = main_thread_cpu_s(pid) - cpu0
        finally:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
        for s in pending:
            s.close()
        time.sleep(0.5)
        logged = [line for line in srv.logs().splitlines()[log_before:]
                  if "accept" in line.lower()]
        print(f"out of fds for 3 s: {cpu:.2f} s of CPU, {len(logged)} log lines on accept")
        assert cpu < 0.5, f"{cpu:.2f} s of CPU in 3 s: a listener spins on accept errors"
        assert len(logged) <= 2 * len(ports), logged[:20]
        # Every listener serves again (a try may meet a loaded machine: three within 15 s).
        assert _within(lambda: _mqtt_ok(ports["mqtt"]))
        assert _within(lambda: raw_tls_connect(ports["mqtt_tls"], pki.client_context(),
                                               "after-tls") == CONNACK_OK)
        assert _within(lambda: _ws_ok(f"ws://127.0.0.1:{ports['ws']}/mqtt"))
        assert _within(lambda: _ws_ok(f"wss://localhost:{ports['wss']}/mqtt",
                                      pki.client_context()))
        assert _within(lambda: _native_ok(srv.native))
        assert _within(lambda: _http_ok(srv.addrs["http"]))
    finally:
        if srv.proc is not None:
            srv.kill()


def test_clients_are_refused_before_the_node_runs_out_of_fds(tmp_path: Path) -> None:
    """A node with a 256-fd limit, flooded with silent client connections on every port:
    what it opens for itself (a CommitLog segment per 64 KiB here) still opens, and a
    client connected before the flood keeps publishing, as fast as before."""
    limit = 256
    srv = Server(tmp_path / "data", "--segment-size", "65536",
                 prefix=["prlimit", f"--nofile={limit}:{limit}", "--"]).start()
    try:
        pid = srv.proc.pid
        assert resource.prlimit(pid, resource.RLIMIT_NOFILE) == (limit, limit)
        pub = Client(srv.port, "before-the-flood")

        def publish() -> None:
            pub.publish("probe/t", b"x", qos=1)

        with Prober(publish) as before:
            time.sleep(2.0)
        rss0, fds0, peak = rss_kb(pid), open_fds(pid), 0
        segments_before = len(os.listdir(tmp_path / "data" / "commitlog"))
        targets = [("127.0.0.1", srv.port), ("127.0.0.1", int(srv.native.rsplit(":")[1])),
                   ("127.0.0.1", int(srv.addrs["http"].rsplit(":")[1])),
                   ("127.0.0.1", int(srv.addrs["ws"].rsplit(":")[1]))]
        flood: list[socket.socket] = []
        try:
            with Prober(publish) as during:
                for i in range(600):
                    try:
                        flood.append(socket.create_connection(targets[i % 4], timeout=0.5))
                    except OSError:
                        pass
                    if i % 50 == 0:
                        peak = max(peak, open_fds(pid))
                time.sleep(1.0)
                peak, rss = max(peak, open_fds(pid)), rss_kb(pid)
            print(f"flood: {len(flood)} sockets, fds {fds0} -> {peak} of {limit}, "
                  f"RSS {rss0 // 1024} -> {rss // 1024} MiB; publishing before: {before}; "
                  f"during: {during}")
            assert peak < limit - 16, "the node ran out of file descriptors"
            assert_unhurt(before, during)
            for i in range(64):  # ~1 MiB: 16 segments or so, each a file opened
                pub.publish("flood/t", bytes([i]) * 16384, qos=1)
            assert all(code == 0 for code in pub.pub_codes.values()), pub.pub_codes
            assert len(os.listdir(tmp_path / "data" / "commitlog")) > segments_before + 8
            assert not any(word in srv.logs() for word in ("Too many open files", "EMFILE"))
        finally:
            for s in flood:
                s.close()
        pub.disconnect()
        time.sleep(1.0)
        assert _mqtt_ok(srv.port) and _http_ok(srv.addrs["http"]) and _native_ok(srv.native)
        text = _metrics(srv)
        assert _metric(text, "lightgate_budget_limit", "client_fds") == limit // 2
        assert _metric(text, "lightgate_budget_refusals_total", "client_fds") > 100
        assert 0 < _metric(text, "lightgate_budget_used", "client_fds") < limit // 2
    finally:
        if srv.proc is not None:
            srv.kill()
