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
from contextlib import contextmanager
from pathlib import Path

import pytest

from serving import plane
from store import protocol as p
from store.record import Message
from tests.conftest import RedisServer
from tests.ha.cluster import Group, cluster, log_bytes, native_call, read_topic, wait_for
from tests.native.test_protocol import Raw
from tests.proc import pause
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
    monkeypatch.setenv("LIGHTGATE_GROUP_NATIVE", "1")  # (the default; said for clarity)
    return request.param


def uid(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


@contextmanager
def started(tmp_path: Path, *extra: str) -> Iterator[Group]:
    """Three nodes, sync, min-insync 2, with `extra`, stopped after."""
    g = Group(tmp_path, 3, "--replication", "sync", "--min-insync", "2", *extra).start()
    try:
        yield g
    finally:
        g.stop()


@pytest.fixture
def group(plane_name: str, tmp_path: Path, redis_server: RedisServer) -> Iterator[Group]:
    # Replicas stay in the in-sync set for a long pause (--max-lag-s): an append waits.
    with started(tmp_path, "--max-lag-s", "30", "--controller-lease-s", "2",
                 "--failover-after-s", "30", "--notify", redis_server.url) as g:
        yield g


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
    # Every node's ready line says its plane: a group's nodes run natively by default.
    assert {n.addrs["plane"] for n in g.nodes} == {plane_name}
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
    replica = g.nodes[g.replicas_leader_last(m)[0]]
    c = Raw(g.nodes[m].native)
    assert c.call(p.HELLO, {}).kind == p.RESPONSE
    t = uid("gp")
    takes_writes(c, f"{t}/x")
    assert replica.proc is not None
    pause(replica.proc.pid)  # (every thread stopped: its copy thread too)
    try:
        c.sock.sendall(publish_frame([f"{t}/x"], 2))
        if not silent_for(c, 1.5):
            early = c.recv()
            raise AssertionError(f"answered while a node of the in-sync set lacks it: "
                                 f"{early.kind} {early.request_id} {early.header} "
                                 f"{cluster(g.nodes[m])} MASTERLOG {g.nodes[m].logs()[-4000:]}")
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


# -- the replicas' copy (store.replication.native_copy) ---------------------------------

def burst(c: Raw, t: str, n: int, first_rid: int = 100) -> list[str]:
    """`n` PUBLISH frames pipelined on `c`, each answered as stored: their topics."""
    topics = [f"{t}/{i % 7}" for i in range(n)]
    c.sock.sendall(b"".join(publish_frame([topic], first_rid + i)
                            for i, topic in enumerate(topics)))
    answers = [c.recv() for _ in range(n)]
    assert all(a.kind == p.RESPONSE for a in answers), [a.header for a in answers
                                                        if a.kind != p.RESPONSE][:3]
    return topics


def master_conn(g: Group, prefix: str) -> tuple[int, Raw, str]:
    """The master (all three in sync), a connection to it that takes writes, a topic."""
    m = in_sync(g)
    c = Raw(g.nodes[m].native)
    assert c.call(p.HELLO, {}).kind == p.RESPONSE
    t = uid(prefix)
    takes_writes(c, f"{t}/w")
    return m, c, t


def copied(g: Group, i: int) -> dict[str, int]:
    return cluster(g.nodes[i])["copied"]


def same_logs(g: Group) -> bool:
    return len({log_bytes(d) for d in g.dirs}) == 1


@pytest.fixture
def small_segments(plane_name: str, tmp_path: Path) -> Iterator[Group]:
    """The group with segments of 64 KiB: a burst rolls them, the replicas with it."""
    with started(tmp_path, "--max-lag-s", "30", "--controller-lease-s", "2",
                 "--failover-after-s", "30", "--segment-size", str(64 << 10)) as g:
        yield g


def test_replicas_copy_natively_and_their_logs_are_the_masters_byte_for_byte(
        plane_name: str, small_segments: Group) -> None:
    g = small_segments
    m, c, t = master_conn(g, "gc")
    before = {i: copied(g, i) for i in range(3) if i != m}
    for k in range(4):  # 4 x 300 records of ~100 bytes: segments rolled on the way
        burst(c, t, 300, first_rid=100 + 1000 * k)
    wait_for(lambda: same_logs(g), 20, "three byte-identical CommitLogs")
    segs = {tuple(sorted(f.name for f in (d / "commitlog").iterdir() if f.name.isdigit()))
            for d in g.dirs}
    assert len(segs) == 1 and len(next(iter(segs))) > 1, segs  # rolled, the same files
    for i, was in before.items():
        now = copied(g, i)
        native_answers = now["native_answers"] - was["native_answers"]
        python_answers = now["python_answers"] - was["python_answers"]
        if plane_name == "native":
            assert native_answers > 0 and python_answers <= 2, (i, was, now)
        else:
            assert native_answers == 0 and python_answers > 0, (i, was, now)
    # Readers of a replica see every acknowledged message (the read limit that says
    # the last ones were comes with the next bytes: the replicas' fetches are lazy).
    burst(c, f"{t}z", 1, first_rid=9000)
    replica = g.nodes[(m + 1) % 3]
    on_master = read_topic(g.nodes[m].native, t)
    assert len(on_master) >= 4 * 300, len(on_master)
    wait_for(lambda: read_topic(replica.native, t) == on_master, 15, "the replica's readers")


def send_and_answers(c: Raw, topics: list[str], first_rid: int) -> list[p.Frame]:
    c.sock.sendall(b"".join(publish_frame([topic], first_rid + i)
                            for i, topic in enumerate(topics)))
    return [c.recv() for _ in topics]


def acked_topics(answers: list[p.Frame], topics: list[str], first_rid: int) -> set[bytes]:
    return {topics[a.request_id - first_rid].encode() for a in answers
            if a.kind == p.RESPONSE}


def test_a_replica_killed_mid_burst_comes_back_and_loses_nothing(
        plane_name: str, group: Group) -> None:
    g = group
    m, c, t = master_conn(g, "gk")
    r = g.replicas_leader_last(m)[0]
    c.sock.settimeout(30)
    acked: set[bytes] = set()
    for k in range(12):
        topics = [f"{t}/{k}-{i}" for i in range(25)]
        rid = 1000 * (k + 1)
        if k == 4:  # the replica killed with this burst's appends in flight
            c.sock.sendall(b"".join(publish_frame([x], rid + i) for i, x in enumerate(topics)))
            g.nodes[r].kill()
            g.nodes[r].start()
            answers = [c.recv() for _ in topics]
        else:
            answers = send_and_answers(c, topics, rid)
        acked |= acked_topics(answers, topics, rid)
    assert len(acked) >= 200, len(acked)
    wait_for(lambda: same_logs(g), 30, "three byte-identical CommitLogs")
    if plane_name == "native":  # back, it copies natively again
        wait_for(lambda: copied(g, r)["native_answers"] > 0, 10, "a native copy")
    send_and_answers(c, [f"{t}z/last"], 99_000)  # (the read limit comes with bytes)
    for node in (g.nodes[m], g.nodes[r]):
        wait_for(lambda n=node: acked <= set(read_topic(n.native, t)), 15,
                 "every acknowledged message readable")


@pytest.fixture
def quick_failover(plane_name: str, tmp_path: Path) -> Iterator[Group]:
    with started(tmp_path, "--controller-lease-s", "2", "--failover-after-s", "3") as g:
        yield g


def test_a_replica_copying_natively_becomes_master_when_the_master_is_killed(
        plane_name: str, quick_failover: Group) -> None:
    g = quick_failover
    m, c, t = master_conn(g, "gf")
    topics = [f"{t}/a{i}" for i in range(200)]
    acked = acked_topics(send_and_answers(c, topics, 100), topics, 100)
    assert len(acked) == 200
    if plane_name == "native":
        for i in range(3):
            if i != m:
                wait_for(lambda i=i: copied(g, i)["native_answers"] > 0, 10, "native copies")
    g.nodes[m].kill()  # SIGKILL: a replica copying natively is elected
    new = wait_for(lambda: next((i + 1 for i in range(3) if i != m
                                 and cluster(g.nodes[i])["role"] == "master"), None),
                   20, "a new master") - 1
    # It stopped copying before it took writes: its engine now writes as master.
    d = Raw(g.nodes[new].native)
    assert d.call(p.HELLO, {}).kind == p.RESPONSE
    takes_writes(d, f"{t}/w2")
    more = [f"{t}/b{i}" for i in range(100)]
    acked |= acked_topics(send_and_answers(d, more, 100), more, 100)
    assert len(acked) == 300
    assert (carried(g, new) > 0) == (plane_name == "native")
    g.nodes[m].start()  # the old master comes back as a replica of the new one
    wait_for(lambda: same_logs(g), 30, "three byte-identical CommitLogs")
    send_and_answers(d, [f"{t}z/last"], 9000)  # (the read limit comes with bytes)
    for node in g.nodes:
        wait_for(lambda n=node: acked <= set(read_topic(n.native, t)), 15,
                 "every acknowledged message readable")


def fetches_between(before: dict, after: dict) -> tuple[int, int]:
    """The replicas' fetches a master answered between two of its /api/v1/cluster
    views: (natively, by Python)."""
    return (after["native_fetches"] - before["native_fetches"],
            after["fetches"] - before["fetches"])


def replicas_of(g: Group, m: int) -> list[int]:
    return [i for i in range(len(g.nodes)) if i != m]


def test_replicas_fetches_are_answered_natively(plane_name: str, group: Group) -> None:
    """On the native plane the replicas' steady REPL_FETCH is answered by the native
    server (long polls included) and releases the held appends there: a burst of
    appends, one in flight as a device's QoS 1, costs Python's fetch handler nothing
    per append. Every acknowledged message is read on each replica."""
    g = group
    m, c, t = master_conn(g, "gf")
    node = g.nodes[m]
    before = cluster(node)
    n = 150
    for rid in range(10, 10 + n):
        c.sock.sendall(publish_frame([f"{t}/m"], rid))
        answer = c.recv()
        assert (answer.kind, answer.request_id) == (p.RESPONSE, rid), answer.header
    after = cluster(node)
    native_fetches, python_fetches = fetches_between(before, after)
    if plane_name == "native":
        # One answer per append per replica (lazy: not a second for the read limit).
        assert n <= native_fetches <= 2 * n + 20, (native_fetches, python_fetches)
        assert python_fetches < n // 5, (native_fetches, python_fetches)
    else:
        assert native_fetches == 0 and python_fetches >= n
    # Python heard of the replicas' positions: both in sync, close to the end.
    st = after
    assert sorted(r["node"] for r in st["replicas"] if r["insync"]) == sorted(
        s for s in st["insync"] if s != st["node"])
    for i in replicas_of(g, m):
        wait_for(lambda i=i: len(read_topic(g.nodes[i].native, t)) == n, 15,
                 f"the acknowledged messages on replica {i}")


def test_a_replicas_readers_see_acknowledged_messages_only(
        plane_name: str, group: Group) -> None:
    """A replica whose fetch the native server answers holds a message the group has not
    acknowledged (the other replica is stopped): neither its readers nor the master's see
    it until it is acknowledged, and the append is answered only then."""
    g = group
    m = in_sync(g)
    b, a = (g.nodes[i] for i in g.replicas_leader_last(m))  # b: stopped, not the leader
    master = g.nodes[m]
    c = Raw(master.native)
    assert c.call(p.HELLO, {}).kind == p.RESPONSE
    t = uid("ga")
    takes_writes(c, f"{t}/x")
    wait_for(lambda: len(read_topic(a.native, t)) == 1, 10, "the first on a")
    assert b.proc is not None
    pause(b.proc.pid)  # (every thread stopped: its copy thread too)
    try:
        c.sock.sendall(publish_frame([f"{t}/x"], 2))
        wait_for(lambda: cluster(a)["log_end"] == cluster(master)["log_end"]
                 > cluster(master)["replicated_offset"], 10, "a to hold the unacked tail")
        assert silent_for(c, 0.3), "answered before the in-sync set held it"
        assert cluster(a)["read_limit"] < cluster(a)["log_end"]
        assert len(read_topic(a.native, t)) == 1
        assert len(read_topic(master.native, t)) == 1
    finally:
        os.kill(b.proc.pid, signal.SIGCONT)
    answer = c.recv()
    assert (answer.kind, answer.request_id) == (p.RESPONSE, 2), answer.header
    wait_for(lambda: len(read_topic(a.native, t)) == 2, 10, "the acked one on a")


@pytest.fixture
def quick_group(plane_name: str, tmp_path: Path) -> Iterator[Group]:
    # A replica that stops fetching leaves the in-sync set after a second.
    g = Group(tmp_path, 3, "--replication", "sync", "--min-insync", "2",
              "--max-lag-s", "1", "--controller-lease-s", "2",
              "--failover-after-s", "30").start()
    try:
        yield g
    finally:
        g.stop()


def test_a_replica_killed_mid_burst_loses_no_acknowledged_message(
        plane_name: str, quick_group: Group) -> None:
    """Sync mode, min-insync 2: a replica killed with SIGKILL amid a burst of appends
    (acknowledged natively by the replicas' fetches on the native plane). Every append
    answered as stored is held by the surviving replica (the one a failover elects), and
    the master goes on taking appends once the dead one left the in-sync set."""
    g = quick_group
    m = in_sync(g)
    master = g.nodes[m]
    v, s = g.replicas_leader_last(m)
    victim, survivor = g.nodes[v], g.nodes[s]
    c = Raw(master.native)
    assert c.call(p.HELLO, {}).kind == p.RESPONSE
    t = uid("gk")
    takes_writes(c, f"{t}/w")
    acked: list[bytes] = []
    failed = 0
    window = 4  # appends in flight
    n = 240
    sent = 0
    deadline = time.monotonic() + 60
    c.sock.settimeout(15)
    while (sent < n or len(acked) + failed < sent) and time.monotonic() < deadline:
        while sent < n and sent - len(acked) - failed < window:
            c.sock.sendall(_numbered(f"{t}/m", sent, 100 + sent))
            sent += 1
        answer = c.recv()
        if answer.kind == p.RESPONSE:
            acked.append(b"%d" % (answer.request_id - 100))
        else:
            assert answer.header["status"] == 503, answer.header
            failed += 1
        if len(acked) == n // 3 and victim.proc is not None:
            victim.kill()  # (SIGKILL)
    assert len(acked) + failed == sent == n, (len(acked), failed, sent)
    assert len(acked) > n // 2, (len(acked), failed)  # it went on without the dead one
    want = set(acked)
    for node in (master, survivor):
        wait_for(lambda node=node: want <= set(read_topic(node.native, t)), 20,
                 "every acknowledged message")


def _numbered(topic: str, i: int, rid: int) -> bytes:
    """A PUBLISH frame of one message whose body is its number."""
    metas, body = p.pack_messages([Message(topic, b"%d" % i, 1, client_id="dev", born_ts=7)])
    return p.encode_frame(p.Frame(p.REQUEST, p.PUBLISH, rid, {"messages": metas}, body))


def test_metadata_changes_reach_the_replicas_through_native_fetches(
        plane_name: str, group: Group) -> None:
    """Sync mode: a metadata change is answered once the in-sync set applied it. On the
    native plane the replicas' fetches a change or two behind are answered natively with
    the ops they lack (as Python encodes them: bytes values too), not by Python."""
    g = group
    m, c, t = master_conn(g, "gm")
    node = g.nodes[m]
    before = cluster(node)
    n = 60
    for i in range(n):
        value = {"n": i, "blob": bytes([0, 255, i])}
        f = c.call(p.META_PUT, {"cf": "sessions", "key": f"{t}/{i}", "value": value},
                   rid=10 + i)
        assert (f.kind, f.request_id) == (p.RESPONSE, 10 + i), f.header
    after = cluster(node)
    native_fetches, python_fetches = fetches_between(before, after)
    if plane_name == "native":
        assert native_fetches >= n and python_fetches < n // 4, (native_fetches,
                                                                  python_fetches)
    for i in replicas_of(g, m):
        got = native_call(g.nodes[i].native, p.META_GET,
                          {"cf": "sessions", "key": f"{t}/{n - 1}"})
        assert got["value"] == {"n": n - 1, "blob": bytes([0, 255, n - 1])}, got


def test_only_a_store_node_copies_the_log(plane_name: str, group: Group) -> None:
    """REPL_FETCH needs the group secret: a connection the master carries that did not
    prove it (a gateway's, an app's) is refused, natively carried or not, and gets no
    byte of the log."""
    g = group
    m = in_sync(g)
    c = Raw(g.nodes[m].native)
    assert c.call(p.HELLO, {}).kind == p.RESPONSE
    takes_writes(c, f"{uid('gs')}/x")
    st = cluster(g.nodes[m])
    f = c.call(p.REPL_FETCH, {"node": "intruder", "addr": "", "offset": 0,
                              "epoch": st["epoch"], "wait_ms": 0, "max_bytes": 1 << 20})
    assert (f.kind, f.header.get("status")) == (p.ERROR, 403), f.header
    assert not f.body
    assert (carried(g, m) > 0) == (plane_name == "native")
