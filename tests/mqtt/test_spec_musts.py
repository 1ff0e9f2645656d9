"""Behaviours the OASIS MQTT 5.0 / 3.1.1 standards require (their MUSTs), driven from raw
sockets (exact bytes through our codec) or paho against a real `lightgate serve`."""

from __future__ import annotations

import socket
import struct
import time
import uuid

import pytest

from gateway import mqtt
from gateway.mqtt import reason as rc
from tests.conftest import Server
from tests.mqtt.paho_client import Client
from tests.mqtt.raw import RawClient


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def v5(port: int, client_id: str, **kw) -> Client:
    return Client(port, client_id, version=5, **kw)


# -- helpers: CONNECT packets no well-behaved encoder would make --------------------------
def _str(b: bytes) -> bytes:
    return struct.pack(">H", len(b)) + b


def _connect(level: int = 5, flags: int = 0x02, props: bytes = b"\x00",
             payload: bytes = b"", name: bytes = b"MQTT", client_id: bytes = b"c") -> bytes:
    body = _str(name) + bytes((level, flags)) + b"\x00\x3c"
    body += (props if level == 5 else b"") + _str(client_id) + payload
    assert len(body) < 128
    return bytes((0x10, len(body))) + body


def _will(topic: bytes, payload: bytes = b"x", props: bytes = b"\x00", level: int = 5) -> bytes:
    return (props if level == 5 else b"") + _str(topic) + _str(payload)


def _connack(port: int, data: bytes, version: int) -> tuple[mqtt.Connack | None, bool]:
    """Send `data`, return the CONNACK the server answered with (None: none) and whether
    it then closed the connection."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        sock.sendall(data)
        got = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                break
            got += chunk
        closed = True
    except TimeoutError:
        closed = False
    finally:
        sock.close()
    if not got:
        return None, closed
    packets = mqtt.Decoder(server=False, version=version).feed(got)
    assert isinstance(packets[0], mqtt.Connack), packets
    return packets[0], closed


# -- 1. a bad CONNECT gets a CONNACK with a reason code before the close ------------------
@pytest.mark.parametrize("what,data,code", [
    ("receive maximum 0", _connect(props=b"\x03\x21\x00\x00"), rc.PROTOCOL_ERROR),
    ("maximum packet size 0", _connect(props=b"\x05\x27\x00\x00\x00\x00"), rc.PROTOCOL_ERROR),
    ("property repeated", _connect(props=b"\x06\x21\x00\x05\x21\x00\x05"), rc.PROTOCOL_ERROR),
    ("unknown property", _connect(props=b"\x02\x7f\x00"), rc.MALFORMED_PACKET),
    ("will topic with a wildcard", _connect(flags=0x06, payload=_will(b"a/+")),
     rc.TOPIC_NAME_INVALID),
    ("will topic not UTF-8", _connect(flags=0x06, payload=_will(b"a/\xff")),
     rc.MALFORMED_PACKET),
    ("will QoS 3", _connect(flags=0x1E, payload=_will(b"a")), rc.MALFORMED_PACKET),
    ("will retain without will", _connect(flags=0x22), rc.MALFORMED_PACKET),
    ("reserved flag", _connect(flags=0x03), rc.MALFORMED_PACKET),
    ("auth data without method", _connect(props=b"\x04\x16\x00\x01x"), rc.PROTOCOL_ERROR),
    ("client id not UTF-8", _connect(client_id=b"\xc3"), rc.MALFORMED_PACKET),
    ("trailing bytes", _connect(payload=b"zz"), rc.MALFORMED_PACKET),
    ("will payload not UTF-8 as its format says",
     _connect(flags=0x06, payload=_will(b"a", b"\xff", b"\x02\x01\x01")),
     rc.PAYLOAD_FORMAT_INVALID),
])
def test_3_2_2_2_bad_connect_gets_connack_reason_code(shared_server, what, data, code) -> None:
    ack, closed = _connack(shared_server.port, data, 5)
    assert ack is not None, f"{what}: closed without a CONNACK"
    assert (ack.reason_code, ack.session_present) == (code, False), what
    assert closed, what


def test_3_2_2_2_connect_too_large(shared_server) -> None:
    # Past --max-connect-packet (64 KiB): 0x95 Packet too large, read before the body.
    data = mqtt.encode(mqtt.Connect("big", 5, "MQTT", True, 60, username="u" * 2000,
                                     password=b"x" * 65_000), 5)
    ack, closed = _connack(shared_server.port, data, 5)
    assert ack is not None and ack.reason_code == rc.PACKET_TOO_LARGE and closed


def test_3_2_2_2_unsupported_protocol_level(shared_server) -> None:
    # MQTT 5 §3.1.2.2 [MQTT-3.1.2-2]: 0x84 in a v5 CONNACK for a version 5 client.
    ack, closed = _connack(shared_server.port, _connect(name=b"MQIsdp", level=5), 5)
    assert ack is not None and ack.reason_code == rc.UNSUPPORTED_PROTOCOL_VERSION and closed
    # An unknown level: the client's version is unknown, 3.1.1's return code 0x01.
    ack, closed = _connack(shared_server.port, _connect(level=6), 4)
    assert ack is not None and ack.reason_code == rc.CONNACK_UNACCEPTABLE_PROTOCOL_VERSION
    assert closed


def test_3_2_2_3_v311_client_id_rejected(shared_server) -> None:
    # 3.1.1 [MQTT-3.1.3-8]: a zero-byte id with CleanSession=0 gets return code 0x02.
    ack, closed = _connack(shared_server.port, _connect(level=4, flags=0, client_id=b""), 4)
    assert ack is not None and ack.reason_code == rc.CONNACK_IDENTIFIER_REJECTED and closed


def test_3_2_2_2_will_topic_past_the_servers_limits(tmp_path) -> None:
    srv = Server(tmp_path / "data", "--max-topic-levels", "3").start()
    try:
        ack, closed = _connack(srv.port, _connect(flags=0x06, payload=_will(b"a/b/c/d")), 5)
        assert ack is not None and ack.reason_code == rc.TOPIC_NAME_INVALID and closed
    finally:
        assert srv.stop() == 0


def test_3_2_2_2_bad_connect_v311_is_closed_without_a_code(shared_server) -> None:
    # 3.1.1 has no return code for a malformed CONNECT: just the close [MQTT-3.1.4-1].
    ack, closed = _connack(shared_server.port,
                           _connect(level=4, flags=0x06, payload=_will(b"a/#", level=4)), 4)
    assert ack is None and closed


# -- 2. Topic Alias 0 or above the maximum: DISCONNECT 0x94 ---------------------------------
@pytest.mark.parametrize("alias", [0, 65535])
def test_3_3_2_3_4_topic_alias_invalid(shared_server, alias: int) -> None:
    raw = RawClient(shared_server.port, version=5)
    raw.connect(uid("ta"))
    # Alias 0 cannot be encoded by our codec (it refuses what the spec forbids).
    body = _str(b"a/b") + b"\x03\x23" + struct.pack(">H", alias) + b"hi"
    raw.send_raw(bytes((0x30, len(body))) + body)
    d = raw.recv()
    assert isinstance(d, mqtt.Disconnect) and d.reason_code == rc.TOPIC_ALIAS_INVALID
    assert raw.closed_by_server()


# -- 3. server-to-client topic aliases on QoS 1 and 2, per network connection --------------
def test_3_3_2_3_4_topic_alias_server_to_client_qos1_and_2(shared_server) -> None:
    topic = uid("alias") + "/q"
    cid = uid("r")
    raw = RawClient(shared_server.port, version=5)
    raw.connect(cid, clean=False, properties={"topic_alias_maximum": 5,
                                              "session_expiry_interval": 60})
    raw.subscribe(topic, 2)
    pub = v5(shared_server.port, uid("p"))
    pub.publish(topic, b"a", 1)
    first = raw.recv()
    assert (first.topic, first.qos, first.properties.get("topic_alias")) == (topic, 1, 1)
    raw.send(mqtt.Puback(first.packet_id))
    pub.publish(topic, b"b", 2)
    second = raw.recv()
    assert (second.topic, second.qos, second.properties.get("topic_alias")) == ("", 2, 1)
    raw.close()  # unacknowledged: resent on the next connection, where alias 1 means nothing
    raw = RawClient(shared_server.port, version=5)
    assert raw.connect(cid, clean=False, properties={"session_expiry_interval": 60}
                       ).session_present
    again = raw.recv()
    assert (again.topic, again.payload, again.dup) == (topic, b"b", True)
    assert "topic_alias" not in again.properties
    raw.send(mqtt.Pubrec(again.packet_id))
    assert raw.recv() == mqtt.Pubrel(again.packet_id)
    raw.send(mqtt.Pubcomp(again.packet_id))
    raw.close()
    pub.disconnect()


# -- 4. inbound flow control: Receive Maximum counts QoS 2 until PUBCOMP ---------------------
def test_4_9_receive_maximum_counts_qos2_until_pubcomp(shared_server) -> None:
    raw = RawClient(shared_server.port, version=5)
    ack = raw.connect(uid("rm"))
    limit = ack.properties["receive_maximum"]
    topic = uid("rm")
    for pid in range(1, limit + 1):
        raw.send(mqtt.Publish(topic, b"x", qos=2, packet_id=pid))
        assert raw.recv() == mqtt.Pubrec(pid)  # never a PUBREL: each stays counted
    raw.send(mqtt.Publish(topic, b"x", qos=2, packet_id=limit + 1))
    d = raw.recv()
    assert isinstance(d, mqtt.Disconnect) and d.reason_code == rc.RECEIVE_MAXIMUM_EXCEEDED
    assert raw.closed_by_server()


def test_4_9_pubcomp_frees_the_receive_window(shared_server) -> None:
    raw = RawClient(shared_server.port, version=5)
    limit = raw.connect(uid("rm")).properties["receive_maximum"]
    topic = uid("rm")
    for pid in range(1, 2 * limit + 1):
        raw.send(mqtt.Publish(topic, b"x", qos=2, packet_id=pid))
        assert raw.recv() == mqtt.Pubrec(pid)
        raw.send(mqtt.Pubrel(pid))
        assert raw.recv() == mqtt.Pubcomp(pid)
    raw.close()


# -- 5. Will Delay vs Session Expiry; a reconnect cancels the will -------------------------
def _v5_will(topic: str, payload: bytes, delay: int) -> mqtt.Will:
    return mqtt.Will(topic, payload, 1, False, {"will_delay_interval": delay})


def test_3_1_3_2_2_will_goes_when_the_session_ends_first(shared_server) -> None:
    topic = uid("wse")
    watcher = v5(shared_server.port, uid("w"))
    watcher.subscribe(topic, 1)
    dev = RawClient(shared_server.port, version=5)
    dev.connect(uid("dev"), clean=False, will=_v5_will(topic, b"gone", 10),
                properties={"session_expiry_interval": 2})
    t0 = time.monotonic()
    dev.close()
    [m] = watcher.expect(1, timeout=8)
    assert m.payload == b"gone" and 1.5 <= time.monotonic() - t0 < 5
    watcher.disconnect()


def test_3_1_3_9_reconnect_cancels_the_will_and_the_new_will_applies(shared_server) -> None:
    topic = uid("wrc")
    watcher = v5(shared_server.port, uid("w"))
    watcher.subscribe(topic, 1)
    cid = uid("dev")
    props = {"session_expiry_interval": 60}
    dev = RawClient(shared_server.port, version=5)
    dev.connect(cid, clean=False, will=_v5_will(topic, b"old", 2), properties=props)
    dev.close()
    time.sleep(0.5)
    dev = RawClient(shared_server.port, version=5)  # back within the delay: no "old"
    dev.connect(cid, clean=False, will=_v5_will(topic, b"new", 3), properties=props)
    dev.close()  # gone again: only this connection's will, 3 s from now
    t0 = time.monotonic()
    [m] = watcher.expect(1, timeout=8)
    assert m.payload == b"new" and 2.5 <= time.monotonic() - t0 < 5.5
    watcher.expect_none(1.0)
    watcher.disconnect()


def test_3_1_2_5_clean_start_ends_the_session_and_sends_its_will(shared_server) -> None:
    topic = uid("wcs")
    watcher = v5(shared_server.port, uid("w"))
    watcher.subscribe(topic, 1)
    cid = uid("dev")
    dev = RawClient(shared_server.port, version=5)
    dev.connect(cid, clean=False, will=_v5_will(topic, b"ended", 30),
                properties={"session_expiry_interval": 60})
    dev.close()
    time.sleep(0.3)
    t0 = time.monotonic()
    dev = RawClient(shared_server.port, version=5)  # Clean Start: the old session ends
    assert not dev.connect(cid, clean=True).session_present
    [m] = watcher.expect(1, timeout=5)
    assert m.payload == b"ended" and time.monotonic() - t0 < 3
    dev.close()
    watcher.disconnect()


# -- 6. shared subscriptions get no retained messages ------------------------------------
def test_4_8_2_shared_subscription_gets_no_retained(shared_server) -> None:
    topic = uid("shr")
    pub = v5(shared_server.port, uid("p"))
    pub.publish(topic, b"kept", 1, retain=True)
    sub = v5(shared_server.port, uid("s"))
    sub.subscribe(f"$share/g/{topic}", 1)
    sub.expect_none(1.0)
    pub.publish(topic, b"live", 1)
    assert [m.payload for m in sub.expect(1)] == [b"live"]
    plain = v5(shared_server.port, uid("s"))
    plain.subscribe(topic, 1)  # a plain one does get it
    assert [m.payload for m in plain.expect(1)] == [b"kept"]
    for c in (pub, sub, plain):
        c.disconnect()


# -- 7. one copy for overlapping subscriptions: each Subscription Identifier once --------
def test_3_3_4_overlapping_subscriptions_each_identifier_once(shared_server) -> None:
    topic = uid("sid") + "/a/b"
    raw = RawClient(shared_server.port, version=5)
    raw.connect(uid("r"))
    base = topic.split("/")[0]
    opts = mqtt.SubscriptionOptions(1)
    # One SUBSCRIBE, one identifier, two filters matching the topic; then a third filter
    # with another identifier.
    raw.send(mqtt.Subscribe(1, [(f"{base}/+/b", opts), (f"{base}/#", opts)],
                            {"subscription_identifier": 7}))
    assert isinstance(raw.recv(), mqtt.Suback)
    raw.send(mqtt.Subscribe(2, [(topic, opts)], {"subscription_identifier": 9}))
    assert isinstance(raw.recv(), mqtt.Suback)
    pub = v5(shared_server.port, uid("p"))
    pub.publish(topic, b"once", 1)
    got = raw.recv()
    assert got.payload == b"once"
    assert sorted(got.properties["subscription_identifier"]) == [7, 9]
    raw.send(mqtt.Puback(got.packet_id))
    with pytest.raises(TimeoutError):  # one copy only
        raw.sock.settimeout(1.0)
        raw.recv()
    raw.close()
    pub.disconnect()


# -- 10. delayed wills survive a restart ----------------------------------------------------
def _persistent_watcher(port: int, cid: str, topic: str) -> Client:
    w = v5(port, cid, clean_start=False, properties=_session_props(300))
    w.subscribe(topic, 1)
    return w


def _session_props(expiry: int):
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    p = Properties(PacketTypes.CONNECT)
    p.SessionExpiryInterval = expiry
    return p


def _drop_device(srv: Server, topic: str, delay: int) -> float:
    dev = RawClient(srv.port, version=5)
    cid = uid("dev")
    dev.connect(cid, clean=False, will=_v5_will(topic, b"late", delay),
                properties={"session_expiry_interval": 60})
    dev.close()
    t0 = time.monotonic()
    assert srv.wait_log(f"client {cid!r}", 1)
    assert srv.wait_log("disconnected: connection closed by the client")
    return t0


def test_3_1_3_2_2_delayed_will_survives_a_restart(tmp_path) -> None:
    srv = Server(tmp_path / "data").start()
    topic, wid = uid("wr"), uid("w")
    try:
        _persistent_watcher(srv.port, wid, topic).disconnect()
        t0 = _drop_device(srv, topic, 5)
        assert srv.stop() == 0
        srv.start()
        watcher = _persistent_watcher(srv.port, wid, topic)
        watcher.expect_none(max(0.0, 3.5 - (time.monotonic() - t0)))  # not before its time
        [m] = watcher.expect(1, timeout=8)
        assert m.payload == b"late" and 4 <= time.monotonic() - t0 < 9
        watcher.disconnect()
        assert srv.stop() == 0
        srv.start()  # published: not again after another restart
        watcher = _persistent_watcher(srv.port, wid, topic)
        watcher.expect_none(1.5)
        watcher.disconnect()
    finally:
        if srv.proc is not None:
            assert srv.stop() == 0, srv.logs()[-3000:]


def test_3_1_3_2_2_overdue_will_goes_at_once_after_a_restart(tmp_path) -> None:
    srv = Server(tmp_path / "data").start()
    topic, wid = uid("wo"), uid("w")
    try:
        _persistent_watcher(srv.port, wid, topic).disconnect()
        _drop_device(srv, topic, 2)
        assert srv.stop() == 0
        time.sleep(2.5)  # due while the server was down
        srv.start()
        watcher = _persistent_watcher(srv.port, wid, topic)
        [m] = watcher.expect(1, timeout=5)
        assert m.payload == b"late"
        watcher.disconnect()
    finally:
        if srv.proc is not None:
            assert srv.stop() == 0, srv.logs()[-3000:]


def test_3_1_3_9_reconnect_after_a_restart_cancels_the_stored_will(tmp_path) -> None:
    srv = Server(tmp_path / "data").start()
    topic, wid = uid("wc"), uid("w")
    try:
        _persistent_watcher(srv.port, wid, topic).disconnect()
        dev = RawClient(srv.port, version=5)
        cid = uid("dev")
        # The restart must come within the delay: 8 s leaves room on a busy machine.
        delay = 8
        dev.connect(cid, clean=False, will=_v5_will(topic, b"late", delay),
                    properties={"session_expiry_interval": 60})
        dev.close()
        t0 = time.monotonic()
        assert srv.wait_log("disconnected: connection closed by the client")
        assert srv.stop() == 0
        srv.start()
        dev = RawClient(srv.port, version=5)
        assert dev.connect(cid, clean=False,
                           properties={"session_expiry_interval": 60}).session_present
        assert time.monotonic() - t0 < delay, "the restart took longer than the will's delay"
        watcher = _persistent_watcher(srv.port, wid, topic)
        watcher.expect_none(max(1.0, delay + 1 - (time.monotonic() - t0)))  # past its time
        dev.send(mqtt.Disconnect())
        dev.close()
        watcher.disconnect()
    finally:
        if srv.proc is not None:
            assert srv.stop() == 0, srv.logs()[-3000:]
