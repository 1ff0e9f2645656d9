"""Regressions for defects found in the native protocol and the record format, against a real
`lightgate serve` (raw frames over a socket), and the record format itself."""

from __future__ import annotations

import socket
import struct
import time
import tracemalloc
from pathlib import Path

import pytest

from gateway import mqtt
from store import protocol as p
from store import record
from store.commitlog import CommitLog
from store.record import CorruptRecord, Message
from tests.conftest import Server
from tests.mqtt.raw import RawClient
from tests.native.test_protocol import Raw
from tests.security.helpers import ADMIN, auth_server


def _frame(code: int, header_json: bytes, body: bytes = b"", rid: int = 1) -> bytes:
    """A request frame whose header is these exact JSON bytes (what a hostile peer sends)."""
    rest = p.HEAD.size - 4 + len(header_json) + len(body)
    return p.HEAD.pack(rest, p.VERSION, p.REQUEST, code, rid, len(header_json)) \
        + header_json + body


def _answer(sock: socket.socket) -> list[p.Frame]:
    """Frames until the server closes the connection (or 5 s pass)."""
    dec = p.FrameDecoder()
    frames: list[p.Frame] = []
    sock.settimeout(5)
    try:
        while data := sock.recv(65536):
            frames.extend(dec.feed(data))
    except (TimeoutError, ConnectionResetError):
        pass
    return frames


def _mqtt_works(server: Server, **creds: object) -> None:
    c = RawClient(server.port)
    c.connect("still-alive", **creds)
    c.send(mqtt.Pingreq())
    assert isinstance(c.recv(), mqtt.Pingresp)
    c.close()


# -- 1: a $b64 that is not base64 ------------------------------------------------------


def test_unauthenticated_hello_with_a_bad_b64_value_does_not_kill_the_server(
        tmp_path: Path) -> None:
    srv = auth_server(tmp_path)
    try:
        for shape in (b'{"x":{"$b64":5}}', b'{"x":{"$b64":"not base64!"}}',
                      b'{"x":[{"$b64":null}]}'):
            with socket.create_connection(("127.0.0.1", int(srv.native.rsplit(":", 1)[1]))) as s:
                s.sendall(_frame(p.HELLO, shape))
                frames = _answer(s)
            assert frames and frames[0].kind == p.ERROR, frames
            assert frames[0].header["status"] == 400
        assert srv.proc is not None and srv.proc.poll() is None
        _mqtt_works(srv, username=ADMIN[0], password=ADMIN[1].encode())
    finally:
        assert srv.stop() == 0, srv.logs()[-3000:]


def test_send_with_an_escaped_b64_key_is_refused_and_restarts_work(tmp_path: Path) -> None:
    srv = Server(tmp_path / "data").start()
    bad = (b'{"topic":"cmd","messages":[{"topic":"cmd","size":1,'
           b'"props":{"k":{"\\u0024b64":5}}}]}')
    with socket.create_connection(("127.0.0.1", int(srv.native.rsplit(":", 1)[1]))) as s:
        s.sendall(_frame(p.SEND, bad, b"x"))
        frames = _answer(s)
    assert frames and frames[0].kind == p.ERROR and frames[0].header["status"] == 400, frames
    c = Raw(srv.native)
    # A well-formed wrapper round-trips as bytes, and is stored.
    ok = c.call(p.SEND, {"topic": "cmd", "messages": [
        {"topic": "cmd", "size": 1, "props": {"k": b"\x01\x02"}}]}, b"y")
    assert ok.kind == p.RESPONSE, ok
    assert srv.stop() == 0
    srv.start()  # recovery reads every record back
    got = Raw(srv.native).call(p.PULL, {"queue": "cmd#0", "offset": 0, "max": 10})
    assert [m["props"]["k"] for m in got.header["messages"]] == [b"\x01\x02"]
    assert srv.stop() == 0


def test_a_record_with_undecodable_properties_is_corrupt_not_an_exception() -> None:
    m = Message("a/b", b"x", store_ts=1, queues=[("a/b", 0)])
    raw = bytearray(record.encode(m))
    for props in (b'{"x":{"$b64":5}}', b"[1,2]", b'{"x":{"$b64":"@@"}}'):
        # Build a record around these properties with a valid CRC: what an older version,
        # or a disk that kept the CRC, could have left.
        fixed = record.FIXED.pack(1, 0, 0, 0, 0, 3, 0, len(props), 1, 0)
        rest = fixed + b"a/b" + props + b"x"
        raw = record.FRAME.pack(record.MAGIC, record.FRAME.size + len(rest),
                                __import__("zlib").crc32(rest)) + rest
        with pytest.raises(CorruptRecord):
            record.decode(raw)


def test_properties_that_would_not_decode_are_never_encoded() -> None:
    m = Message("a/b", b"x", properties={"k": {"$b64": 5}}, store_ts=1, queues=[("a/b", 0)])
    with pytest.raises(ValueError):
        record.encode(m)


# -- 4: native SEND validated as strictly as MQTT ----------------------------------------


@pytest.mark.parametrize("meta", [
    {"qos": 3}, {"qos": -1}, {"qos": "1"}, {"props": [1, 2]},
    {"props": {"session_expiry_interval": 1}}, {"props": {"topic_alias": 3}},
    {"props": {"message_expiry_interval": -5}}, {"props": {"payload_format_indicator": 7}},
    {"props": {"user_property": [["k"]]}}, {"props": {"response_topic": "a/#"}},
])
def test_native_send_to_mqtt_refuses_what_no_publish_could_carry(shared_server: Server,
                                                                 meta: dict) -> None:
    c = Raw(shared_server.native)
    before = c.call(p.QUEUE_RANGE, {"queue": "dev/1/cmd"}).header
    res = c.call(p.SEND, {"topic": "dev", "messages": [
        {"topic": "dev/1/cmd", "size": 2, **meta}]}, b"on")
    assert res.kind == p.ERROR and res.header["status"] == 400, res
    after = c.call(p.QUEUE_RANGE, {"queue": "dev/1/cmd"}).header
    assert after == before  # nothing stored


def test_native_send_with_valid_mqtt_fields_reaches_a_device(shared_server: Server) -> None:
    sub = RawClient(shared_server.port, version=5)
    sub.connect("dev-2")
    sub.subscribe("dev/2/cmd", 2)
    c = Raw(shared_server.native)
    props = {"message_expiry_interval": 60, "user_property": [["k", "v"]],
             "correlation_data": b"\x00\x01", "reason": "test", "attempt": 2}
    res = c.call(p.SEND, {"topic": "dev", "messages": [
        {"topic": "dev/2/cmd", "size": 2, "qos": 1, "props": props},
        {"topic": "dev", "size": 3, "props": {"app_field": 1}}]}, b"onapp")
    assert res.kind == p.RESPONSE, res
    got = sub.recv()
    assert isinstance(got, mqtt.Publish) and got.payload == b"on" and got.qos == 1
    assert got.properties["correlation_data"] == b"\x00\x01"
    # The app's own properties reach an MQTT 5 device as user properties.
    assert got.properties["user_property"] == [("k", "v"), ("reason", "test"),
                                               ("attempt", "2")]
    sub.close()


# -- 8: long-poll waiters do not outlive their PULL -------------------------------------


def test_long_polls_on_many_queue_names_leave_nothing_behind(tmp_path: Path) -> None:
    srv = Server(tmp_path / "data").start()
    try:
        pid = srv.proc.pid
        c = Raw(srv.native)

        def rss_kb() -> int:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
            return 0

        def poll_many(prefix: str, n: int) -> None:
            # Pipelined, 64 at a time (the server's per-connection request limit).
            for start in range(0, n, 64):
                batch = range(start, min(n, start + 64))
                c.sock.sendall(b"".join(p.encode_frame(p.Frame(
                    p.REQUEST, p.PULL, i + 1, {"queue": f"{prefix}-{i}", "wait_ms": 1}))
                    for i in batch))
                for _ in batch:
                    assert c.recv().kind == p.RESPONSE

        poll_many("warm", 5000)
        base = rss_kb()
        poll_many("lp", 30_000)
        grown = rss_kb() - base
        # Before the fix: +25 MiB for 30k names (an Event and a dict entry each, kept).
        assert grown < 8 * 1024, f"RSS grew {grown} kB over 30k long-polls"
        stats = c.call(p.STATS, {}).header
        assert stats.get("pull_waiters", 0) == 0, stats
    finally:
        assert srv.stop() == 0


# -- unauthenticated peers cannot hold memory or connections ----------------------------


def test_unauthenticated_frames_are_small_and_hello_is_due_in_time(tmp_path: Path) -> None:
    srv = auth_server(tmp_path)
    port = int(srv.native.rsplit(":", 1)[1])
    try:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(p.HEAD.pack(1024 * 1024, p.VERSION, p.REQUEST, p.HELLO, 1, 0))
            frames = _answer(s)
        assert frames and "exceeds" in frames[0].header["error"], frames
        with socket.create_connection(("127.0.0.1", port)) as s:
            t0 = time.monotonic()
            frames = _answer_slowly(s)
            assert 9 < time.monotonic() - t0 < 20
        assert frames and "not authenticated" in frames[0].header["error"], frames
        # An authenticated client may still send big frames.
        c = Raw(srv.native)
        ok = c.call(p.HELLO, {"username": ADMIN[0], "password": ADMIN[1]})
        assert ok.kind == p.RESPONSE
        res = c.call(p.SEND, {"topic": "big", "messages": [{"topic": "big", "size": 1 << 20}]},
                     b"x" * (1 << 20))
        assert res.kind == p.RESPONSE, res
    finally:
        assert srv.stop() == 0, srv.logs()[-3000:]


def _answer_slowly(s: socket.socket) -> list[p.Frame]:
    """A peer that trickles a HELLO one byte a second and never finishes it."""
    dec = p.FrameDecoder()
    s.settimeout(1)
    partial = _frame(p.HELLO, b'{"username":"admin","password":"' + b"x" * 100 + b'"}')
    frames: list[p.Frame] = []
    for i in range(30):
        try:
            s.sendall(partial[i : i + 1])
            data = s.recv(65536)
            if not data:
                break
            frames.extend(dec.feed(data))
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            break
    return frames


# -- GET_MESSAGE at an offset inside a record -------------------------------------------


def test_reading_at_an_offset_inside_a_record_is_a_clean_error(tmp_path: Path) -> None:
    from lightqueue.index import ConsumeQueueIndex

    index = ConsumeQueueIndex(tmp_path / "index")
    log = CommitLog(tmp_path / "log", index, segment_size=1 << 20, flush="async")
    log.open()
    try:
        body = struct.pack(">I", 0xFFFFFFF0) * 64  # a body that looks like a huge length
        [m] = log.append([Message("a/b", body)], [["a/b"]]).result(10)
        tracemalloc.start()
        for off in range(m.phys_offset + 1, m.phys_offset + m.size, 7):
            with pytest.raises((CorruptRecord, KeyError)):
                log.read(off)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 4 << 20, peak
        assert log.read(m.phys_offset).body == body
    finally:
        log.close()
        index.close()


def test_get_message_inside_a_record_is_404(shared_server: Server) -> None:
    c = Raw(shared_server.native)
    res = c.call(p.SEND, {"topic": "gm", "messages": [{"topic": "gm", "size": 64}]},
                 struct.pack(">I", 0x7FFFFFF0) * 16)
    phys = res.header["results"][0]["phys"]
    for delta in (1, 5, 20, 40):
        err = c.call(p.GET_MESSAGE, {"msg_id": f"{phys + delta:016X}"})
        assert err.kind == p.ERROR and err.header["status"] == 404, err
    assert c.call(p.GET_MESSAGE, {"msg_id": f"{phys:016X}"}).kind == p.RESPONSE


# -- more than 65,535 queues for one message ---------------------------------------------


def test_a_message_for_more_than_65535_queues_is_stored_and_read_back() -> None:
    queues = [(f"w/{i}", i) for i in range(70_000)]
    m = Message("a/b", b"x", store_ts=5, queues=queues)
    raw = record.encode(m)
    assert struct.unpack_from(">I", raw)[0] == record.MAGIC_WIDE
    back = record.decode(raw)
    assert back.queues == queues and back.body == b"x"
    small = record.encode(Message("a/b", b"x", store_ts=5, queues=queues[:3]))
    assert struct.unpack_from(">I", small)[0] == record.MAGIC  # the usual format unchanged
