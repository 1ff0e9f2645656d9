"""The native protocol's frames, and the server's answers to bad input over a socket."""

from __future__ import annotations

import socket

import pytest

from store import protocol as p
from store.record import Message
from tests.conftest import Server
from tests.ha.cluster import cluster, wait_for


def test_frame_round_trip_split_anywhere() -> None:
    msgs = [Message("a/b", b"\x00raw body", 1, True, "c1", {"correlation_data": b"\x01"},
                    key="k"), Message("a/c", b"", 0)]
    metas, body = p.pack_messages(msgs)
    raw = p.encode_frame(p.Frame(p.REQUEST, p.SEND, 7, {"topic": "a", "messages": metas},
                                 body)) * 3
    dec = p.FrameDecoder()
    frames = [f for i in range(len(raw)) for f in dec.feed(raw[i : i + 1])]
    assert len(frames) == 3
    f = frames[0]
    assert (f.kind, f.code, f.request_id, f.header["topic"]) == (p.REQUEST, p.SEND, 7, "a")
    back = p.unpack_messages(f.header["messages"], f.body)
    assert [(m.topic, m.body, m.qos, m.retain, m.key) for m in back] == [
        ("a/b", b"\x00raw body", 1, True, "k"), ("a/c", b"", 0, False, "")]
    assert back[0].properties["correlation_data"] == b"\x01"
    assert body == b"\x00raw body"  # bodies travel raw, not base64


@pytest.mark.parametrize("raw, why", [
    (p.HEAD.pack(10, 9, 0, 1, 1, 0) + b"x" * 6, "version"),
    (p.HEAD.pack(p.MAX_FRAME, 1, 0, 1, 1, 0), "exceeds"),
    (p.HEAD.pack(16, 1, 0, 1, 1, 4) + b"[1] ", "object"),
    (p.HEAD.pack(16, 1, 0, 1, 1, 100) + b"{}  ", "malformed"),
])
def test_bad_frames_raise_protocol_error(raw: bytes, why: str) -> None:
    with pytest.raises(p.ProtocolError, match=why):
        p.FrameDecoder().feed(raw)


def test_mismatched_message_sizes_are_refused() -> None:
    with pytest.raises(p.ProtocolError):
        p.unpack_messages([{"topic": "a", "size": 10}], b"short")


class Raw:
    def __init__(self, addr: str) -> None:
        host, port = addr.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=5)
        self.dec = p.FrameDecoder()
        self.pending: list[p.Frame] = []

    def call(self, code: int, header: dict, body: bytes = b"", rid: int = 1) -> p.Frame:
        self.sock.sendall(p.encode_frame(p.Frame(p.REQUEST, code, rid, header, body)))
        return self.recv()

    def recv(self) -> p.Frame:
        while not self.pending:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("closed")
            self.pending.extend(self.dec.feed(data))
        return self.pending.pop(0)


def test_server_answers_errors_with_clear_error_frames(shared_server) -> None:
    c = Raw(shared_server.native)
    hello = c.call(p.HELLO, {})
    assert hello.kind == p.RESPONSE and hello.header["version"] == p.VERSION
    unknown = c.call(999, {})
    assert unknown.kind == p.ERROR and "unknown request code" in unknown.header["error"]
    bad = c.call(p.PULL, {"offset": 0})  # no queue
    assert bad.kind == p.ERROR and bad.header["status"] == 400
    missing = c.call(p.GET_MESSAGE, {"msg_id": "00000000FFFFFFFF"})
    assert missing.kind == p.ERROR and missing.header["status"] == 404
    bad_topic = c.call(p.SEND, {"topic": "a/b", "messages": [{"topic": "", "size": 1}]}, b"x")
    assert bad_topic.kind == p.ERROR and bad_topic.header["status"] == 400
    # Still serving on the same connection after all that.
    assert c.call(p.HELLO, {}).kind == p.RESPONSE
    # A frame that breaks the protocol gets an error frame, then the connection closes.
    c.sock.sendall(p.HEAD.pack(p.MAX_FRAME + 10, 1, 0, 1, 1, 0))
    err = c.recv()
    assert err.kind == p.ERROR and "exceeds" in err.header["error"]
    with pytest.raises(ConnectionError):
        c.recv()


def test_long_poll_returns_when_data_arrives(shared_server) -> None:
    import threading
    import time

    c = Raw(shared_server.native)
    other = Raw(shared_server.native)
    queue = "lp#0"
    c.call(p.TOPIC_CREATE, {"topic": "lp", "partitions": 1})

    def later() -> None:
        time.sleep(0.5)
        metas, body = p.pack_messages([Message("", b"wake")])
        other.call(p.SEND, {"topic": "lp", "messages": metas}, body)

    threading.Thread(target=later).start()
    t0 = time.monotonic()
    res = c.call(p.PULL, {"queue": queue, "offset": 0, "max": 10, "wait_ms": 5000})
    waited = time.monotonic() - t0
    assert res.kind == p.RESPONSE and len(res.header["messages"]) == 1
    assert 0.3 < waited < 3.0
    t0 = time.monotonic()
    empty = c.call(p.PULL, {"queue": queue, "offset": 1, "max": 10, "wait_ms": 300})
    assert empty.header["messages"] == [] and time.monotonic() - t0 >= 0.25


def test_wildcard_add_takes_one_filter_or_many(shared_server) -> None:
    """A gateway touches every wildcard filter its sessions read in one frame."""
    c = Raw(shared_server.native)
    assert c.call(p.WILDCARD_ADD, {"filter": "wa/one/+"}).kind == p.RESPONSE
    ok = c.call(p.WILDCARD_ADD, {"filters": ["wa/+/x", "wa/#"]})
    assert ok.kind == p.RESPONSE
    stats = c.call(p.STATS, {}).header
    assert stats["wildcards"] >= 3
    for bad in ({"filters": "wa/+"}, {"filters": ["wa/a#"]}):
        err = c.call(p.WILDCARD_ADD, bad)
        assert err.kind == p.ERROR and err.header["status"] == 400, err.header
    assert c.call(p.HELLO, {}).kind == p.RESPONSE


@pytest.mark.parametrize("shape", ["flush-sync", "sync-replica"])
def test_pipelined_appends_are_answered_in_the_order_sent(tmp_path, shape: str) -> None:
    """Appends sent back to back on one connection are stored in that order, and
    answered in it: a gateway's cache extends its window with each answer's messages
    only where they continue it, so an answer overtaking an earlier one cost every
    subscriber of those queues a read back from the store. Many acknowledged at once (a
    group commit's fsync, the in-sync set's copy) went out in the order of the event
    loop's tasks, reversed half the time."""
    nodes = []
    if shape == "flush-sync":
        nodes.append(Server(tmp_path / "s", "--flush", "sync", command="store").start())
    else:
        nodes.append(Server(tmp_path / "m", "--replication", "sync", "--min-insync", "2",
                            command="store").start())
        nodes.append(Server(tmp_path / "r", "--replica-of", nodes[0].native,
                            command="store").start())
    try:
        if shape == "sync-replica":
            wait_for(lambda: len(cluster(nodes[0])["insync"]) == 2, 10, "the replica in sync")
        c = Raw(nodes[0].native)
        assert c.call(p.HELLO, {}).kind == p.RESPONSE
        rid = 1
        for _ in range(6):
            frames, sent = [], []
            for _ in range(40):
                rid += 1
                metas, body = p.pack_messages([Message(topic="order/t", body=b"x")])
                frames.append(p.encode_frame(p.Frame(p.REQUEST, p.PUBLISH, rid,
                                                     {"messages": metas}, body)))
                sent.append(rid)
            c.sock.sendall(b"".join(frames))  # one read at the store: pending together
            got = [c.recv() for _ in sent]
            assert all(f.kind == p.RESPONSE for f in got), got[0].header
            assert [f.request_id for f in got] == sent
    finally:
        for node in reversed(nodes):
            node.kill()
