"""MQTT 3.1.1 statements where 3.1.1 differs from 5.0 (return codes instead of reason
codes, CleanSession instead of Clean Start and Session Expiry, no properties), and the
3.1.1 statements of chapters 1 and 2."""

from __future__ import annotations

from gateway import mqtt
from tests.conformance.reader import Connack, Suback
from tests.conformance.wire import (
    Peer,
    connect_bytes,
    connected,
    publish_bytes,
    subscribe_bytes,
    uid,
)


def v4(port: int) -> Peer:
    return Peer(port, version=4)


def test_mqtt311_3_1_2_2(port: int) -> None:
    """[MQTT-3.1.2-2] (3.1.1) Protocol Level 6: CONNACK return code 0x01, then closed."""
    c = v4(port)
    c.send_raw(connect_bytes(uid(), level=6))
    assert c.closed()
    assert bytes(c.raw_in) == b"\x20\x02\x00\x01"


def test_mqtt311_3_1_2_4(port: int) -> None:
    """[MQTT-3.1.2-4] (3.1.1) CleanSession 0 resumes the Session: messages wait for it."""
    cid, topic = uid(), uid("v/")
    c = v4(port)
    c.connect(cid, clean=False)
    c.subscribe(topic, 1)
    c.disconnect()
    p = v4(port)
    p.connect(uid())
    p.publish(topic, b"kept", 1)
    c = v4(port)
    assert c.connect(cid, clean=False).session_present
    assert c.messages(1)[0].payload == b"kept"


def test_mqtt311_3_1_2_6(port: int) -> None:
    """[MQTT-3.1.2-6] (3.1.1) CleanSession 1 discards the stored Session and keeps none."""
    cid = uid()
    c = v4(port)
    c.connect(cid, clean=False)
    c.disconnect()
    c = v4(port)
    assert not c.connect(cid, clean=True).session_present
    c.disconnect()
    assert not v4(port).connect(cid, clean=False).session_present


def test_mqtt311_3_1_3_6(port: int) -> None:
    """[MQTT-3.1.3-6] (3.1.1) A zero-byte ClientId with CleanSession 1 is accepted."""
    assert v4(port).connect("", clean=True).reason_code == 0


def test_mqtt311_3_1_3_8(port: int) -> None:
    """[MQTT-3.1.3-8] (3.1.1) A zero-byte ClientId with CleanSession 0: CONNACK 0x02,
    closed."""
    c = v4(port)
    c.send(mqtt.Connect("", 4, clean_start=False))
    assert c.closed()
    assert [p.return_code for p in c.pending] == [0x02]


def test_mqtt311_3_1_4_1(port: int) -> None:
    """[MQTT-3.1.4-1] (3.1.1) A malformed CONNECT (reserved flag set): closed without a
    CONNACK."""
    c = v4(port)
    c.send_raw(connect_bytes(uid(), level=4, flags=0x03))
    assert c.closed()
    assert bytes(c.raw_in) == b""


def test_mqtt311_3_2_2_1(port: int) -> None:
    """[MQTT-3.2.2-1] (3.1.1) CleanSession 1: Session Present 0, return code 0."""
    cid = uid()
    v4(port).connect(cid, clean=False)
    ack = v4(port).connect(cid, clean=True)
    assert (ack.session_present, ack.return_code) == (False, 0)


def test_mqtt311_3_2_2_2(port: int) -> None:
    """[MQTT-3.2.2-2] (3.1.1) CleanSession 0 with a stored Session: Session Present 1."""
    cid = uid()
    v4(port).connect(cid, clean=False)
    assert v4(port).connect(cid, clean=False).session_present


def test_mqtt311_3_2_2_3(port: int) -> None:
    """[MQTT-3.2.2-3] (3.1.1) CleanSession 0 without a Session: Session Present 0."""
    assert not v4(port).connect(uid(), clean=False).session_present


def test_mqtt311_3_2_2_4(auth_broker) -> None:
    """[MQTT-3.2.2-4] (3.1.1) A refusing CONNACK (bad password, 0x04) has Session
    Present 0."""
    c = v4(auth_broker.port)
    c.send(mqtt.Connect(uid(), 4, clean_start=False, username="alice", password=b"bad"))
    ack = c.expect(Connack)
    assert (ack.session_present, ack.return_code) == (False, 0x04)


def test_mqtt311_3_2_2_5(auth_broker) -> None:
    """[MQTT-3.2.2-5] (3.1.1) After a non-zero return code (0x05) the link is closed."""
    c = v4(auth_broker.port)
    c.send(mqtt.Connect(uid(), 4))
    assert c.closed()
    assert [p.return_code for p in c.pending] == [0x05]


def test_mqtt311_3_9_3_2(port: int) -> None:
    """[MQTT-3.9.3-2] (3.1.1) SUBACK return codes are 0, 1, 2 or 0x80 only."""
    c = v4(port)
    c.connect(uid())
    c.send_raw(subscribe_bytes(1, [(uid("v/"), 2), (uid("v/"), 0), (uid("v/"), 1)],
                               version=4))
    assert c.expect(Suback).reason_codes == [2, 0, 1]


def test_mqtt311_3_14_1_1(port: int) -> None:
    """[MQTT-3.14.1-1] (3.1.1) DISCONNECT with reserved bits set: the Client is
    disconnected (no DISCONNECT packet exists to send back)."""
    c = v4(port)
    c.connect(uid())
    c.send_raw(b"\xe2\x00")
    assert c.closed()
    assert not c.pending

# -- chapters 1 and 2 in 3.1.1: no reason codes, so a refusal is a close with nothing sent


def closes_silently(c: Peer, data: bytes) -> None:
    """Send `data`: the Server closes the connection and sends nothing more."""
    before = len(c.log)
    c.send_raw(data)
    assert c.closed()
    assert c.log[before:] == [], c.log[before:]


def test_mqtt311_1_5_3_1(port: int) -> None:
    """[MQTT-1.5.3-1] (3.1.1) Ill-formed UTF-8 (a surrogate, an overlong form, 0xFF) in a
    ClientId, a Topic Name or a Topic Filter: the connection is closed."""
    for bad in (b"\xed\xa0\x80", b"\xc0\xaf", b"\xff"):
        closes_silently(v4(port), connect_bytes(b"c" + bad, level=4))
        closes_silently(connected(port, version=4), publish_bytes(b"t/" + bad, version=4))
        closes_silently(connected(port, version=4),
                        subscribe_bytes(1, [(b"t/" + bad, 0)], version=4))


def test_mqtt311_1_5_3_2(port: int) -> None:
    """[MQTT-1.5.3-2] (3.1.1) U+0000 in a ClientId, a Topic Name or a Topic Filter: the
    connection is closed."""
    closes_silently(v4(port), connect_bytes(b"c\x00", level=4))
    closes_silently(connected(port, version=4), publish_bytes(b"t/\x00", version=4))
    closes_silently(connected(port, version=4), subscribe_bytes(1, [(b"t/\x00", 0)], version=4))


def test_mqtt311_1_5_3_3(port: int) -> None:
    """[MQTT-1.5.3-3] (3.1.1) 0xEF 0xBB 0xBF is U+FEFF, not stripped: a topic starting
    with it is another topic, and it reaches the subscriber as sent."""
    base = uid("bom/")
    exact, plain = connected(port, version=4), connected(port, version=4)
    exact.subscribe("\ufeff" + base, 0)
    plain.subscribe(base, 0)
    connected(port, version=4).publish("\ufeff" + base, b"x")
    assert exact.messages(1)[0].topic == "\ufeff" + base
    assert plain.quiet(0.4)

