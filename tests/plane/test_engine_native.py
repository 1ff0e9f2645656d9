"""The native engine driven from Python: sockets handed over after their CONNACK, a
publish appended once, acknowledged, delivered, and left for the index; the Python
CommitLog then recovers the log the engine wrote and reads every message through the
light queues it was routed to. A SUBSCRIBE comes back to Python with the socket."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from gateway import mqtt
from lightqueue.index import ConsumeQueueIndex
from lightqueue.routing import Router
from serving import plane
from store.commitlog import CommitLog

if plane.NATIVE is None:
    if os.environ.get("LIGHTGATE_NATIVE") == "1":
        pytest.fail("LIGHTGATE_NATIVE=1 but the native extension is not installed")
    pytest.skip("the native extension is not installed", allow_module_level=True)

SETTINGS = dict(version=4, keepalive=0, max_packet=1 << 20, max_qos=2, topic_alias_maximum=0,
                receive_maximum=64, client_receive_maximum=10, max_inflight=32,
                client_max_packet=1 << 20)


def pair(listener: socket.socket) -> tuple[socket.socket, int]:
    client = socket.create_connection(listener.getsockname())
    client.settimeout(5)
    server, _ = listener.accept()
    server.setblocking(False)
    return client, server.detach()


def recv_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        assert chunk, "closed"
        out += chunk
    return out


def test_engine_appends_acks_delivers_and_python_reads_it(tmp_path: Path) -> None:
    data, index_dir = tmp_path / "log", tmp_path / "index"
    log = CommitLog(data, ConsumeQueueIndex(index_dir), segment_size=1 << 20)
    log.open()
    base, end = log.segments()[-1][0], log.max_offset
    log.close()
    log.index.close()

    index = ConsumeQueueIndex(index_dir)
    engine = plane.NATIVE.Engine(data, 1 << 20, base, end, 4, True, 2, index.max_offset)
    engine.register_wildcard("dev/+/t")
    listener = socket.create_server(("127.0.0.1", 0))
    publisher, fd = pair(listener)
    engine.adopt(1, fd, **SETTINGS)
    subscriber, fd = pair(listener)
    engine.adopt(2, fd, **SETTINGS)
    engine.subscribe(2, "dev/+/t", 1)

    sent = [mqtt.encode_publish(f"dev/{i % 3}/t", b"v%d" % i, 1, False, False, i + 1, 4)
            for i in range(30)]
    publisher.sendall(b"".join(sent))
    acks = recv_exact(publisher, 4 * 30)
    assert [acks[i + 3] for i in range(0, len(acks), 4)] == list(range(1, 31))
    dec = mqtt.Decoder(server=False, version=4)
    got: list = []
    while len(got) < 30:  # ten in flight at most (the window): each acked as it comes
        new = dec.feed(subscriber.recv(65536))
        subscriber.sendall(b"".join(mqtt.encode(mqtt.Puback(p.packet_id), 4) for p in new))
        got += new
    assert [p.payload for p in got] == [b"v%d" % i for i in range(30)]
    assert {p.qos for p in got} == {1}

    # A SUBSCRIBE is Python's: the socket comes back with the packet unread.
    sub = mqtt.encode(mqtt.Subscribe(5, [("x/#", mqtt.SubscriptionOptions())]), 4)
    subscriber.sendall(sub)
    deadline = time.monotonic() + 5
    back: list = []
    while not back and time.monotonic() < deadline:
        back = engine.take_demoted()
        time.sleep(0.01)
    [d] = back
    assert (d["conn"], d["why"], d["unsent"]) == (2, "packet", b"")
    assert d["unread"].startswith(sub)
    # Everything it was sent was acknowledged; its queue's position is past the last.
    assert d["outgoing"] == [] and d["next_packet_id"] == 31
    assert d["positions"] == {"dev/+/t": 30}
    os.close(d["fd"])
    counters = engine.counters()
    assert (counters["messages_in"], counters["messages_out"]) == (30, 30)
    assert (counters["adopted"], counters["demoted"]) == (2, 1)

    dispatched = engine.take_dispatched()
    assert len(dispatched) == 30
    routes = Router(4)
    routes.register_wildcard("dev/+/t")
    for i, (_, _, _, queues) in enumerate(dispatched):
        assert [q for q, _ in queues] == routes.route(f"dev/{i % 3}/t")
    engine.stop()
    index.close()

    # The Python CommitLog recovers the engine's log and indexes it from the records.
    again = CommitLog(data, ConsumeQueueIndex(index_dir), segment_size=1 << 20)
    report = again.open()
    try:
        assert report.truncated_at is None and report.redispatched == 30
        entries = again.index.read("dev/+/t", 0, 100)
        assert [again.read(e.phys_offset, e.size).body for e in entries] == \
            [b"v%d" % i for i in range(30)]
        assert [e.offset for e in again.index.read("dev/1/t", 0, 100)] == list(range(10))
    finally:
        again.close()
