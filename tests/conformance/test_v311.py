"""MQTT 3.1.1 statements where 3.1.1 differs from 5.0 (return codes instead of reason
codes, CleanSession instead of Clean Start and Session Expiry, no properties), and the
3.1.1 statements of chapters 1 and 2. Chapter 6's are in test_ch6_websocket.py."""

from __future__ import annotations

from gateway import mqtt
from tests.conformance.reader import (
    Connack,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Unsuback,
)
from tests.conformance.wire import (
    Peer,
    connect_bytes,
    connected,
    publish_bytes,
    s,
    subscribe_bytes,
    sweep,
    uid,
    unsubscribe_bytes,
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


FLAGS_311 = {"CONNACK": 0, "PUBACK": 0, "PUBREC": 0, "PUBREL": 0b0010, "PUBCOMP": 0,
             "SUBACK": 0, "UNSUBACK": 0, "PINGRESP": 0}


def test_mqtt311_2_2_2_1(port: int) -> None:
    """[MQTT-2.2.2-1] (3.1.1) Reserved flags have the values of Table 2.2 on every type
    of packet the Server sends."""
    sent = {(type(p).__name__.upper(), p.raw[0] & 0x0F) for p in sweep(port, version=4)
            if not isinstance(p, Publish)}
    assert sent == set(FLAGS_311.items())


def test_mqtt311_2_2_2_2(port: int) -> None:
    """[MQTT-2.2.2-2] (3.1.1) A packet with invalid flags closes the connection: CONNECT,
    PUBACK, PUBREC, PUBREL, PUBCOMP, SUBSCRIBE, UNSUBSCRIBE, PINGREQ, DISCONNECT."""
    closes_silently(v4(port), b"\x11" + connect_bytes(uid(), level=4)[1:])
    for data in (b"\x41\x02\x00\x01", b"\x52\x02\x00\x01", b"\x60\x02\x00\x01",
                 b"\x78\x02\x00\x01", subscribe_bytes(1, [("a/b", 0)], b0=0x80, version=4),
                 unsubscribe_bytes(1, ["a/b"], b0=0xA3, version=4), b"\xc4\x00", b"\xe1\x00"):
        closes_silently(connected(port, version=4), data)


def test_mqtt311_2_3_1_1(port: int) -> None:
    """[MQTT-2.3.1-1] (3.1.1) SUBSCRIBE, UNSUBSCRIBE and QoS 1/2 PUBLISH carry a non-zero
    Packet Identifier: the Server closes a connection that sends 0."""
    for data in (subscribe_bytes(0, [("a/b", 0)], version=4),
                 unsubscribe_bytes(0, ["a/b"], version=4),
                 publish_bytes("a/b", b"x", 1, pid=0, version=4),
                 publish_bytes("a/b", b"x", 2, pid=0, version=4)):
        closes_silently(connected(port, version=4), data)


def test_mqtt311_2_3_1_4(port: int) -> None:
    """[MQTT-2.3.1-4] (3.1.1) The Server's QoS 1/2 PUBLISHes carry non-zero identifiers
    not in use, and a re-sent one (on reconnect) its first identifier."""
    cid, topic = uid(), uid("v/")
    c = v4(port)
    c.connect(cid, clean=False)
    c.subscribe(topic, 2)
    p = connected(port, version=4)
    for i in range(4):
        p.publish(topic, b"%d" % i, 1 + i % 2, pid=i + 1)
    first = c.messages(4, ack=False)
    ids = [m.packet_id for m in first]
    assert len(set(ids)) == 4 and 0 not in ids
    c.close()
    c = v4(port)
    assert c.connect(cid, clean=False).session_present
    again = c.messages(4, ack=False)
    assert [(m.packet_id, m.dup) for m in again] == [(i, True) for i in ids]


def test_mqtt311_2_3_1_5(port: int) -> None:
    """[MQTT-2.3.1-5] (3.1.1) A QoS 0 PUBLISH has no Packet Identifier: the Server's is
    byte for byte fixed header, Topic Name, payload."""
    topic = uid("v/")
    c = connected(port, version=4)
    c.subscribe(topic, 0)
    connected(port, version=4).publish(topic, b"two", 2)
    assert c.messages(1)[0].raw == bytes([0x30, 2 + len(topic) + 3]) + s(topic) + b"two"


def test_mqtt311_2_3_1_6(port: int) -> None:
    """[MQTT-2.3.1-6] (3.1.1) PUBACK, PUBREC and PUBREL carry the identifier of their
    PUBLISH: the Server's answers to a Client's, and its PUBREL to its own."""
    topic = uid("v/")
    w = connected(port, version=4)
    w.subscribe(topic, 2)
    c = connected(port, version=4)
    assert c.publish(topic, b"x", 1, pid=0xFFFF) == Puback(0xFFFF)
    c.send(mqtt.Publish(topic, b"x", 2, packet_id=0x8001))
    assert c.expect(Pubrec) == Pubrec(0x8001)
    c.send(mqtt.Pubrel(0x8001))
    c.expect(Pubcomp)
    w.messages(1)
    m = w.messages(1, ack=False)[0]
    w.send(mqtt.Pubrec(m.packet_id))
    assert w.expect(Pubrel) == Pubrel(m.packet_id)


def test_mqtt311_2_3_1_7(port: int) -> None:
    """[MQTT-2.3.1-7] (3.1.1) SUBACK and UNSUBACK carry the identifier of their SUBSCRIBE
    and UNSUBSCRIBE."""
    c = connected(port, version=4)
    for pid in (1, 0x1234, 0xFFFF):
        assert c.subscribe(uid("v/"), 0, pid=pid).packet_id == pid
        c.send(mqtt.Unsubscribe(pid, [uid("v/")]))
        assert c.expect(Unsuback) == Unsuback(pid)
