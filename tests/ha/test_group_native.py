"""A store group's master on the native plane (store.replication.native_master): while
master, a node's native engine writes its log and its native server carries the
connections it authenticates, answering PUBLISH natively under the group's rules: an
append is answered once every node of the in-sync set holds it, writes are refused
while the node may not take them (no lease), and held answers fail on a step-down.
LIGHTGATE_NATIVE=0 runs the same tests on Python's writer and server."""

from __future__ import annotations

import os
import signal
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from serving import plane
from store import protocol as p
from tests.conftest import RedisServer
from tests.ha.cluster import Group, cluster, read_topic, wait_for
from tests.native.test_protocol import Raw
from tests.security.helpers import native
from tests.separated.test_store_native_server import publish_frame

PLANES = [
    pytest.param("native", marks=pytest.mark.skipif(
        plane.NATIVE is None or not hasattr(plane.NATIVE, "StoreServer"),
        reason="the native data plane is not built")),
    "python",
]


@pytest.fixture(params=PLANES)
def plane_name(request, monkeypatch) -> str:
    monkeypatch.setenv("LIGHTGATE_NATIVE", "1" if request.param == "native" else "0")
    monkeypatch.setenv("LIGHTGATE_GROUP_NATIVE", "1")  # (opt-in: store.replication.native_master)
    return request.param


def uid(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


@pytest.fixture
def group(plane_name: str, tmp_path: Path, redis_server: RedisServer) -> Iterator[Group]:
    # Replicas stay in the in-sync set for a long pause (--max-lag-s): an append waits.
    g = Group(tmp_path, 3, "--replication", "sync", "--min-insync", "2",
              "--max-lag-s", "30", "--controller-lease-s", "2",
              "--failover-after-s", "30", "--notify", redis_server.url).start()
    try:
        yield g
    finally:
        g.stop()


def carried(g: Group, i: int) -> int:
    return int(native(g.nodes[i], "STATS", creds=None)["native_carried"])


def in_sync(g: Group) -> int:
    m = g.master(20)
    wait_for(lambda: len(g.insync(m)) == 3, 15, "all three in sync")
    wait_for(lambda: cluster(g.nodes[m]).get("lease_s_left", 0) > 0, 15, "the lease")
    return m


def takes_writes(c: Raw, topic: str) -> None:
    """Publish once, retried while the new master waits for its lease (a loaded machine
    may delay the controller's commits)."""
    def ok() -> bool:
        f = c.call(p.PUBLISH, {"messages": [{"topic": topic, "size": 1}]}, b"0")
        assert f.kind == p.RESPONSE or f.header["status"] == 503, f.header
        return f.kind == p.RESPONSE
    wait_for(ok, 15, "the master takes writes", step=0.2)


def silent_for(c: Raw, seconds: float) -> bool:
    """Whether nothing comes on `c` for `seconds`."""
    c.sock.settimeout(seconds)
    try:
        return not c.sock.recv(1, socket.MSG_PEEK)
    except TimeoutError:
        return True
    finally:
        c.sock.settimeout(10)


def test_the_master_carries_connections_and_answers_publish_once_replicated(
        plane_name: str, group: Group, redis_server: RedisServer) -> None:
    """... and tells their readers once the in-sync set holds them: a PULL waiting at
    the queue's head is answered, and Redis carries the queue's name to gateways. (The
    dispatch hands over the queues that grew with their ends, a dict, where sets of
    names were merged: on the native plane the telling raised in a trio callback, and
    neither came.)"""
    import redis

    g = group
    m = in_sync(g)
    node = g.nodes[m]
    t = uid("gn")
    c, reader = Raw(node.native), Raw(node.native)
    for conn in (c, reader):
        assert conn.call(p.HELLO, {}).kind == p.RESPONSE
    takes_writes(c, f"{uid('gw')}/w")
    bus = redis.Redis.from_url(redis_server.url).pubsub()
    try:
        bus.subscribe("lightgate:notify")
        reader.sock.sendall(p.encode_frame(p.Frame(p.REQUEST, p.PULL, 9, {
            "queue": f"{t}/a", "offset": 0, "wait_ms": 20_000})))
        assert silent_for(reader, 0.3)  # held waiting at the head
        started = time.monotonic()
        c.sock.sendall(b"".join(publish_frame([f"{t}/a", f"{t}/b"], rid) for rid in (1, 2, 3)))
        answers = [c.recv() for _ in range(3)]
        assert [a.kind for a in answers] == [p.RESPONSE] * 3, [a.header for a in answers]
        assert [a.request_id for a in answers] == [1, 2, 3]
        reader.sock.settimeout(15)
        try:
            told: p.Frame | None = reader.recv()
        except (TimeoutError, ConnectionError):
            told = None
        assert told is not None, f"the waiting PULL was not answered: {node.logs()[-3000:]}"
        assert (told.kind, told.request_id) == (p.RESPONSE, 9), told.header
        assert p.unpack_messages(told.header["messages"], told.body)[0].body == \
            f"{t}/a".encode()
        assert time.monotonic() - started < 10, "told only when the wait ran out"
        heard = ""
        deadline = time.monotonic() + 10
        while f"{t}/a" not in heard and time.monotonic() < deadline:
            msg = bus.get_message(timeout=0.5)
            if msg is not None and msg["type"] == "message":
                heard += msg["data"].decode(errors="replace")
        assert f"{t}/a" in heard, "gateways were not told through Redis"
    finally:
        bus.close()
    assert (carried(g, m) > 0) == (plane_name == "native")
    # Acknowledged: every node of the in-sync set holds them, and readers see them.
    assert sorted(read_topic(node.native, t)) == sorted([f"{t}/a".encode(),
                                                         f"{t}/b".encode()] * 3)


def test_an_append_waits_for_a_paused_replica_of_the_in_sync_set(
        plane_name: str, group: Group) -> None:
    g = group
    m = in_sync(g)
    replica = g.nodes[(m + 1) % 3]
    c = Raw(g.nodes[m].native)
    assert c.call(p.HELLO, {}).kind == p.RESPONSE
    t = uid("gp")
    takes_writes(c, f"{t}/x")
    assert replica.proc is not None
    os.kill(replica.proc.pid, signal.SIGSTOP)
    try:
        c.sock.sendall(publish_frame([f"{t}/x"], 2))
        assert silent_for(c, 1.5), "answered while a node of the in-sync set lacks it"
    finally:
        os.kill(replica.proc.pid, signal.SIGCONT)
    answer = c.recv()
    assert (answer.kind, answer.request_id) == (p.RESPONSE, 2), answer.header
    assert (carried(g, m) > 0) == (plane_name == "native")


def test_a_master_without_its_lease_fails_what_it_holds_and_refuses(
        plane_name: str, group: Group) -> None:
    g = group
    m = in_sync(g)
    others = [g.nodes[i] for i in range(3) if i != m]
    c = Raw(g.nodes[m].native)
    assert c.call(p.HELLO, {}).kind == p.RESPONSE
    t = uid("gl")
    for n in others:  # a majority out of reach: no report of the master's is committed
        assert n.proc is not None
        os.kill(n.proc.pid, signal.SIGSTOP)
    try:
        c.sock.sendall(publish_frame([f"{t}/x"], 1))
        c.sock.settimeout(15)
        # Failed when the lease runs out, never answered as stored: the native server
        # says so before it closes the connection (Python's closes it).
        try:
            held = c.recv()
        except ConnectionError:
            assert plane_name == "python"
        else:
            assert (held.kind, held.header["status"]) == (p.ERROR, 503), held.header
        deadline = time.monotonic() + 10
        while True:
            d = Raw(g.nodes[m].native)
            assert d.call(p.HELLO, {}).kind == p.RESPONSE
            refused = d.call(p.PUBLISH, {"messages": [{"topic": f"{t}/x", "size": 1}]}, b"!")
            assert refused.kind == p.ERROR, refused.header
            if "lease" in refused.header["error"] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert refused.header["status"] == 503
        assert "lease" in refused.header["error"], refused.header
    finally:
        for n in others:
            os.kill(n.proc.pid, signal.SIGCONT)
