"""`lightgate store` answering its hot requests natively (store.carried,
native/src/server.rs): on the native plane a store in no group hands each connection
that may make every request (authentication off, a node or Super user) to the native
server once its HELLO is answered; PUBLISH frames are appended there through the engine
and everything else comes back to Python. Both planes (LIGHTGATE_NATIVE=0 keeps every
connection in Python): the same answers, the same records, idempotent producers kept
once across kill -9, and the same refusals for who may not."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from serving import plane
from store import protocol as p
from store.record import Message, decode
from tests.conftest import Server
from tests.ha.cluster import read_topic
from tests.native.test_protocol import Raw
from tests.security.helpers import ADMIN, add_user, native

PLANES = [
    pytest.param("native", marks=pytest.mark.skipif(
        plane.NATIVE is None or not hasattr(plane.NATIVE, "StoreServer"),
        reason="the native data plane is not built")),
    "python",
]


def uid(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


@pytest.fixture(params=PLANES)
def plane_name(request, monkeypatch) -> str:
    monkeypatch.setenv("LIGHTGATE_NATIVE", "1" if request.param == "native" else "0")
    return request.param


@pytest.fixture
def store(plane_name: str, tmp_path: Path) -> Iterator[Server]:
    srv = Server(tmp_path / "store", command="store").start()
    try:
        yield srv
    finally:
        srv.stop()


def carried(srv: Server, creds: tuple[str, str] | None = None) -> int:
    return int(native(srv, "STATS", creds=creds)["native_carried"])


def publish_frame(topics: list[str], rid: int, **stamp: Any) -> bytes:
    metas, body = p.pack_messages([Message(t, t.encode(), 1, client_id="dev", born_ts=7)
                                   for t in topics])
    return p.encode_frame(p.Frame(p.REQUEST, p.PUBLISH, rid, {"messages": metas, **stamp},
                                  body))


def hello(c: Raw, **creds: str) -> p.Frame:
    answer = c.call(p.HELLO, dict(creds))
    assert answer.kind == p.RESPONSE, answer.header
    return answer


def test_publish_is_answered_in_order_with_the_results_python_gives(
        plane_name: str, store: Server) -> None:
    """Pipelined PUBLISH frames (and a PULL between them, which Python answers) on one
    connection: each answered with its `results`, appends in frame order, the messages
    readable at the offsets they were given."""
    t = uid("np")
    c = Raw(store.native)
    hello(c)
    c.sock.sendall(b"".join(publish_frame([f"{t}/a", f"{t}/b"], rid) for rid in (1, 2))
                   + p.encode_frame(p.Frame(p.REQUEST, p.QUEUE_ENDS, 3,
                                            {"queues": [f"{t}/a#0"]}))
                   + publish_frame([f"{t}/a"], 4))
    answers = {f.request_id: f for f in (c.recv() for _ in range(4))}
    assert all(f.kind == p.RESPONSE for f in answers.values()), answers
    results = [answers[rid].header["results"] for rid in (1, 2, 4)]
    phys = [r["phys"] for res in results for r in res]
    assert phys == sorted(phys) and len(set(phys)) == 5
    for r in results[0]:
        assert r["msg_id"] == f"{r['phys']:016X}" and r["rsize"] > 0 and r["store_ts"] > 0
        assert r["queues"]
    # The exact topic's queue (routing puts it first): its offsets in frame order.
    offsets = [o for res in results for r in res for q, o in r["queues"] if q == f"{t}/a"]
    assert offsets == [0, 1, 2]
    assert sorted(read_topic(store.native, t)) == sorted(
        [f"{t}/a".encode()] * 3 + [f"{t}/b".encode()] * 2)
    assert (carried(store) > 0) == (plane_name == "native")


def test_the_sdk_publishes_and_reads_through_the_native_server(
        plane_name: str, store: Server) -> None:
    t = uid("sdk")
    out = native(store, "PUBLISH", {"messages": [{"topic": f"{t}/x", "size": 2, "qos": 1}]},
                 creds=None, body=b"hi")
    (r,) = out["results"]
    assert r["msg_id"] == f"{r['phys']:016X}"
    assert read_topic(store.native, t) == [b"hi"]
    # A PUBLISH the native side does not decide (properties) goes to Python: same answer.
    props = native(store, "PUBLISH", {"messages": [{"topic": f"{t}/x", "size": 1,
                                                    "props": {"content_type": "x"}}]},
                   creds=None, body=b"!")
    assert props["results"][0]["phys"] > r["phys"]
    # ... and so does one Python refuses: the same refusal on both planes.
    with pytest.raises(p.RemoteError, match="wildcards") as bad:
        native(store, "PUBLISH", {"messages": [{"topic": f"{t}/+", "size": 1}]}, creds=None,
               body=b"x")
    assert bad.value.status == 400
    with pytest.raises(p.RemoteError, match="topic_alias") as bad:
        native(store, "PUBLISH", {"messages": [{"topic": f"{t}/x", "size": 1,
                                                "props": {"topic_alias": 3}}]},
               creds=None, body=b"x")
    assert read_topic(store.native, t) == [b"hi", b"!"]
    assert (carried(store) > 0) == (plane_name == "native")


def test_a_protocol_error_is_answered_and_closes_the_connection(store: Server) -> None:
    c = Raw(store.native)
    hello(c)
    c.sock.sendall(p.HEAD.pack(p.MAX_FRAME + 10, 1, 0, p.PUBLISH, 1, 0))
    err = c.recv()
    assert err.kind == p.ERROR and "exceeds" in err.header["error"]
    with pytest.raises(ConnectionError):
        c.recv()
    c = Raw(store.native)
    hello(c)
    c.sock.sendall(p.HEAD.pack(12 + 5, 1, 0, p.PUBLISH, 2, 5) + b"[1,2]")
    err = c.recv()
    assert err.kind == p.ERROR and err.header["status"] == 400
    with pytest.raises(ConnectionError):
        c.recv()
    assert native(store, "STATS", creds=None)["native_connections"] >= 1  # still serving


def test_an_idempotent_resend_is_stored_once_across_kill_9(
        plane_name: str, store: Server) -> None:
    """A gateway's stamped PUBLISH sent again is answered with where it was stored and
    appends nothing; a gap or an older epoch is refused (409); after a kill -9 the
    sequence is rebuilt from the log, and a resend is still kept once."""
    t = uid("id")
    c = Raw(store.native)
    hello(c)
    pid = c.call(p.PRODUCER_INIT, {}, rid=9).header["producer"]
    c.sock.sendall(publish_frame([f"{t}/1", f"{t}/2"], 1, producer=pid, epoch=0, seq=0))
    first = c.recv().header["results"]
    c.sock.sendall(publish_frame([f"{t}/1", f"{t}/2"], 2, producer=pid, epoch=0, seq=0))
    assert c.recv().header["results"] == first  # a duplicate: its places, nothing appended
    c.sock.sendall(publish_frame([f"{t}/2", f"{t}/3"], 3, producer=pid, epoch=0, seq=1))
    overlap = c.recv().header["results"]  # half of it stored already
    assert overlap[0] == first[1] and overlap[1]["phys"] > first[1]["phys"]
    for rid, stamp in ((4, {"seq": 9, "epoch": 0}), (5, {"seq": 3, "epoch": 1})):
        c.sock.sendall(publish_frame([f"{t}/x"], rid, producer=pid, **stamp))
        refused = c.recv()  # a gap; a new epoch that does not start at 0
        assert refused.kind == p.ERROR and refused.header["status"] == 409, refused.header
        assert refused.request_id == rid
    c.sock.sendall(publish_frame([f"{t}/x"], 6, producer=pid, epoch=1, seq=0))
    x = c.recv().header["results"]
    c.sock.sendall(publish_frame([f"{t}/y"], 7, producer=pid, epoch=0, seq=3))
    assert c.recv().header["status"] == 409  # a replaced writer's older epoch
    c.sock.sendall(publish_frame([f"{t}/y"], 8, producer="p-never-issued", seq=0))
    unknown = c.recv()
    assert unknown.kind == p.ERROR and unknown.header["status"] in (403, 410)
    c.sock.close()
    store.kill()
    store.start()
    c = Raw(store.native)
    hello(c)
    c.sock.sendall(publish_frame([f"{t}/x", f"{t}/4"], 1, producer=pid, epoch=1, seq=0))
    again = c.recv().header["results"]
    assert again[0] == x[0] and again[1]["phys"] > x[0]["phys"]
    stored = [f"{t}/{i}".encode() for i in ("1", "2", "3", "4", "x")]
    assert sorted(read_topic(store.native, t)) == stored
    # After a clean stop too (the table's snapshot, with what the native side held).
    c.sock.sendall(publish_frame([f"{t}/5"], 2, producer=pid, epoch=1, seq=2))
    five = c.recv().header["results"]
    c.sock.close()
    store.stop()
    store.start()
    c = Raw(store.native)
    hello(c)
    c.sock.sendall(publish_frame([f"{t}/5"], 1, producer=pid, epoch=1, seq=2))
    assert c.recv().header["results"] == five
    assert sorted(read_topic(store.native, t)) == sorted([*stored, f"{t}/5".encode()])


def _records(data_dir: Path) -> list[tuple]:
    """Every record of the log, as fields (the store time aside: it is the clock's)."""
    out = []
    for seg in sorted((data_dir / "commitlog").glob("*")):
        if not seg.name.isdigit():
            continue
        buf = seg.read_bytes()
        pos = 0
        while pos + 4 <= len(buf) and buf[pos:pos + 4] != b"\0\0\0\0":
            m = decode(buf, pos, pos)
            out.append((m.phys_offset, m.size, m.topic, bytes(m.body), m.qos, m.client_id,
                        m.born_ts, m.mark, m.producer, m.queues))
            pos += m.size
    return out


def test_the_native_server_writes_the_records_python_writes(
        tmp_path: Path, monkeypatch) -> None:
    """The same PUBLISH frames, plain and stamped (with a resend), to a store on each
    plane: the same records at the same offsets, stamps included."""
    logs = []
    for which in ("1", "0"):
        monkeypatch.setenv("LIGHTGATE_NATIVE", which)
        if which == "1" and (plane.NATIVE is None or not hasattr(plane.NATIVE,
                                                                 "StoreServer")):
            pytest.skip("the native data plane is not built")
        srv = Server(tmp_path / f"store{which}", command="store").start()
        try:
            c = Raw(srv.native)
            hello(c)
            pid = c.call(p.PRODUCER_INIT, {"name": "gw"}, rid=1).header["producer"]
            frames = [publish_frame(["a/b", "c"], 2),
                      publish_frame(["a/b", "a/c", "d/e"], 3, producer=pid, epoch=0, seq=0),
                      publish_frame(["a/c", "d/e", "x"], 4, producer=pid, epoch=0, seq=1),
                      publish_frame(["z"], 5, producer=pid, epoch=2, seq=0)]
            c.sock.sendall(b"".join(frames))
            assert [c.recv().kind for _ in frames] == [p.RESPONSE] * len(frames)
            c.sock.close()
        finally:
            srv.stop()
        logs.append((pid, _records(tmp_path / f"store{which}")))
    (pid_n, native_log), (pid_p, python_log) = logs
    assert len(native_log) == 7  # (the resend's first two stored once)
    swap = {pid_p: pid_n}
    python_log = [(*r[:8], None if r[8] is None else [swap.get(r[8][0], r[8][0]), *r[8][1:]],
                   r[9]) for r in python_log]
    assert [r[2:] for r in native_log] == [r[2:] for r in python_log]
    if len(pid_n) == len(pid_p):
        assert [r[:2] for r in native_log] == [r[:2] for r in python_log]


def test_who_may_not_is_refused_as_before(plane_name: str, tmp_path: Path) -> None:
    """With --auth: an unauthenticated PUBLISH is refused (401), a user without the
    right is refused (403) and stays in Python; a node user's connection is carried and
    its PUBLISH stored; a node user disabled meanwhile is cut off."""
    srv = Server(tmp_path / "data", "--auth", "--init-user", f"{ADMIN[0]}:{ADMIN[1]}",
                 command="store").start()
    try:
        add_user(srv, "plain", "pw-plain-1")
        add_user(srv, "gw", "pw-gw-1", node=True)
        t = uid("acl")
        c = Raw(srv.native)
        c.sock.sendall(publish_frame([f"{t}/1"], 1))
        assert c.recv().header["status"] == 401
        c = Raw(srv.native)
        hello(c, username="plain", password="pw-plain-1")
        c.sock.sendall(publish_frame([f"{t}/1"], 1))
        assert c.recv().header["status"] == 403
        before = carried(srv, ADMIN)
        c = Raw(srv.native)
        hello(c, username="gw", password="pw-gw-1")
        c.sock.sendall(publish_frame([f"{t}/2"], 2))
        assert c.recv().kind == p.RESPONSE
        assert read_topic_as(srv, t) == [f"{t}/2".encode()]
        if plane_name == "native":
            assert carried(srv, ADMIN) > before
        native(srv, "USER_UPDATE", {"name": "gw", "enabled": False})
        # Python refuses its next request; the native side closes it at once (within
        # a second of a change made elsewhere: the HTTP API, a reload).
        cut = False
        deadline = time.monotonic() + 10
        rid = 3
        while not cut and time.monotonic() < deadline:
            rid += 1
            try:
                c.sock.sendall(publish_frame([f"{t}/3"], rid))
                f = c.recv()
            except ConnectionError:  # (a timeout is not a cut: it fails the test)
                cut = True
                break
            if f.kind == p.ERROR:
                assert f.header["status"] == 403, f.header
                cut = True
            time.sleep(0.05)
        assert cut
        assert rid == 4  # its first request after the change
    finally:
        srv.stop()


def read_topic_as(srv: Server, topic: str) -> list[bytes]:
    from tests.native.test_idempotent_producer import read_topic_as as read
    return read(srv, topic, ADMIN)


def test_flush_sync_publishes_survive_kill_9(plane_name: str, tmp_path: Path) -> None:
    """--flush sync: an answered PUBLISH was synced before its answer (the engine syncs
    each append under its lock), so a kill -9 right after loses none of them."""
    srv = Server(tmp_path / "data", "--flush", "sync", command="store").start()
    try:
        t = uid("sync")
        c = Raw(srv.native)
        hello(c)
        c.sock.sendall(b"".join(publish_frame([f"{t}/{i}"], i + 1) for i in range(50)))
        assert [c.recv().kind for _ in range(50)] == [p.RESPONSE] * 50
        srv.kill()
        srv.start()
        assert sorted(read_topic(srv.native, t)) == sorted(f"{t}/{i}".encode()
                                                           for i in range(50))
    finally:
        srv.stop()


def test_a_partial_frame_counts_in_the_nodes_read_budget(plane_name: str,
                                                         tmp_path: Path) -> None:
    """The bytes of a frame received in part count in --native-max-partial-bytes
    whichever side reads the connection, and go when it ends."""
    srv = Server(tmp_path / "data", "--native-max-partial-bytes", "1000000",
                 command="store").start()
    try:
        c = Raw(srv.native)
        hello(c)
        c.sock.sendall(p.HEAD.pack(12 + 200_000, 1, 0, p.PUBLISH, 1, 2) + b"{}" + b"x" * 50_000)

        def held() -> int:
            return int(native(srv, "STATS", creds=None)["native_read_budget"]["held"])

        deadline = time.monotonic() + 5
        while held() < 50_000:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        c.sock.close()
        while held() != 0:
            assert time.monotonic() < deadline + 5
            time.sleep(0.05)
    finally:
        srv.stop()


def test_a_producer_publishing_natively_is_not_forgotten_as_idle(
        plane_name: str, tmp_path: Path) -> None:
    """--producer-idle-s forgets ids whose producers sent nothing for that long: one
    whose publishes the native side checks is not idle (its sequence is there, not in
    Python's table), so another connection may still stamp with it."""
    srv = Server(tmp_path / "data", "--producer-idle-s", "2", command="store").start()
    try:
        t = uid("idle")
        c = Raw(srv.native)
        hello(c)
        pid = c.call(p.PRODUCER_INIT, {}, rid=100).header["producer"]
        for seq in range(9):  # 4.5 s: two idle times, four rounds of the clean-up
            c.sock.sendall(publish_frame([f"{t}/{seq}"], seq + 1, producer=pid, seq=seq))
            assert c.recv().kind == p.RESPONSE
            time.sleep(0.5)
        other = Raw(srv.native)
        hello(other)
        other.sock.sendall(publish_frame([f"{t}/8"], 1, producer=pid, seq=8))
        answer = other.recv()  # a resend: stored already, not a forgotten id's (410)
        assert answer.kind == p.RESPONSE, answer.header
        assert len(read_topic(srv.native, t)) == 9
    finally:
        srv.stop()


def test_a_pull_right_after_a_publish_is_answered_reads_it(plane_name: str,
                                                          store: Server) -> None:
    """A message whose PUBLISH was answered is there for a PULL that comes after the
    answer, from any connection. The native server answers a PUBLISH once the engine
    appended it, before Python's dispatch puts it in the index and in the ring of recent
    messages a reader at the queue's head is served from: that ring said "nothing at
    this offset yet" meanwhile (a persistent session that moved to another gateway took
    the message it had in flight there for gone, and it was lost)."""
    t = uid("seen")
    pub, reader = Raw(store.native), Raw(store.native)
    hello(pub)
    hello(reader)
    # A reader at the head: its miss starts the queue's ring with the next message.
    assert reader.call(p.PULL, {"queue": f"{t}/x", "offset": 0}).header["messages"] == []
    for i in range(30):
        pub.sock.sendall(publish_frame([f"{t}/x"], i + 1))
        answer = pub.recv()
        assert answer.kind == p.RESPONSE, answer.header
        (offset,) = [o for q, o in answer.header["results"][0]["queues"] if q == f"{t}/x"]
        assert offset == i
        got = reader.call(p.PULL, {"queue": f"{t}/x", "offset": offset, "max": 1},
                          rid=i + 1)
        assert [m.offset_in(f"{t}/x") for m in p.unpack_messages(
            got.header["messages"], got.body)] == [offset], f"message {i} not read"
