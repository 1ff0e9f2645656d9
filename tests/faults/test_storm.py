"""Connection storm: 10k connects in a burst, then 10k abrupt disconnects. Every will
fires once, and no session, connection or task is left behind."""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
import urllib.request

from gateway import mqtt
from tests.conftest import Server
from tests.mqtt.raw import RawClient

CLIENTS = int(os.environ.get("LIGHTGATE_STORM_CLIENTS", "10000"))


def runtime(srv: Server) -> dict:
    with urllib.request.urlopen(f"http://{srv.addrs['http']}/api/v1/runtime", timeout=5) as r:
        return json.loads(r.read())


def test_connect_storm_then_abrupt_disconnects(tmp_path) -> None:
    srv = Server(tmp_path / "d").start()
    try:
        watcher = RawClient(srv.port, timeout=30)
        watcher.connect("watcher")
        watcher.subscribe("storm/#", 0)
        baseline = runtime(srv)
        wills: set[bytes] = set()

        def collect() -> None:
            deadline = time.monotonic() + 300  # the connect phase alone may be slow
            while len(wills) < CLIENTS and time.monotonic() < deadline:
                try:
                    p = watcher.recv()
                except TimeoutError:  # quiet while the storm connects: keep waiting
                    continue
                if isinstance(p, mqtt.Publish):
                    wills.add(p.payload)

        collector = threading.Thread(target=collect, daemon=True)
        collector.start()
        socks = []
        t0 = time.monotonic()
        for i in range(CLIENTS):
            host = f"127.0.0.{2 + i % 200}"  # spread source addresses: no port exhaustion
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10,
                                         source_address=(host, 0))
            s.sendall(mqtt.encode(mqtt.Connect(client_id=f"storm-{i}", keepalive=0,
                                               will=mqtt.Will(f"storm/{i}", b"%d" % i)), 4))
            socks.append(s)
        for s in socks:
            assert s.recv(4) == b"\x20\x02\x00\x00"
        connect_rate = CLIENTS / (time.monotonic() - t0)
        during = runtime(srv)
        assert during["connections"] == CLIENTS + 1
        for s in socks:  # abrupt: RST, no DISCONNECT
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
        collector.join(120)
        assert len(wills) == CLIENTS  # every will fired, exactly once each
        deadline = time.monotonic() + 20
        after = runtime(srv)
        while after["connections"] > 1 and time.monotonic() < deadline:
            time.sleep(0.2)
            after = runtime(srv)
        print(f"{CLIENTS} connects at {connect_rate:.0f}/s; tasks {baseline['tasks']} -> "
              f"{during['tasks']} -> {after['tasks']}; fds {baseline['open_fds']} -> "
              f"{during['open_fds']} -> {after['open_fds']}")
        assert after["connections"] == 1 and after["sessions"] == 1  # just the watcher
        assert after["tasks"] <= baseline["tasks"] + 5
        assert after["open_fds"] <= baseline["open_fds"] + 5
        watcher.close()
    finally:
        assert srv.stop() == 0, srv.logs()[-2000:]
