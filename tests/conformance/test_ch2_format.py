"""MQTT 5.0 chapter 2 (the packet format): fixed header flags (§2.1.3), Packet
Identifiers (§2.2.1) and Properties (§2.2.2), one test per normative statement, and the
two requirements of §2.2.2.2 that have no identifier."""

from __future__ import annotations

import pytest

from gateway import mqtt
from tests.conformance.reader import (
    Connack,
    Disconnect,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Unsuback,
    varint_bytes,
)
from tests.conformance.wire import (
    Peer,
    connect_bytes,
    connected,
    frame,
    props,
    publish_bytes,
    s,
    subscribe_bytes,
    sweep,
    uid,
    unsubscribe_bytes,
)

# Table 2-2: the flags of each packet type but PUBLISH (whose are DUP, QoS, RETAIN).
FLAGS = {"CONNECT": 0, "CONNACK": 0, "PUBACK": 0, "PUBREC": 0, "PUBREL": 0b0010, "PUBCOMP": 0,
         "SUBSCRIBE": 0b0010, "SUBACK": 0, "UNSUBSCRIBE": 0b0010, "UNSUBACK": 0, "PINGREQ": 0,
         "PINGRESP": 0, "DISCONNECT": 0, "AUTH": 0}


def codes(c: Peer) -> list[int]:
    """Once the Server has closed `c`: the codes of its CONNACKs and DISCONNECTs."""
    assert c.closed(), f"connection left open; got {c.pending}"
    return [p.reason_code for p in c.pending if isinstance(p, (Connack, Disconnect))]


def after_connect(port: int, data: bytes) -> list[int]:
    c = connected(port)
    c.send_raw(data)
    return codes(c)


def as_first(port: int, data: bytes) -> list[int]:
    c = Peer(port)
    c.send_raw(data)
    return codes(c)


def wrong_flags(name: str) -> list[int]:
    """Every other value of the four flag bits."""
    return [f for f in range(16) if f != FLAGS[name]]


WRONG = {  # a well-formed packet of each type a Client sends, but for its first byte
    "PUBACK": (0x4, b"\x00\x01"), "PUBREC": (0x5, b"\x00\x01"), "PUBREL": (0x6, b"\x00\x01"),
    "PUBCOMP": (0x7, b"\x00\x01"), "SUBSCRIBE": (0x8, b"\x00\x01\x00" + s("a/b") + b"\x00"),
    "UNSUBSCRIBE": (0xA, b"\x00\x01\x00" + s("a/b")), "PINGREQ": (0xC, b""),
    "DISCONNECT": (0xE, b""), "AUTH": (0xF, b"\x18\x00"),
}


@pytest.mark.parametrize("name", [*WRONG, "CONNECT", "the Server's"])
def test_mqtt_2_1_3_1(port: int, name: str) -> None:
    """[MQTT-2.1.3-1] Reserved flags have the values of Table 2-2: the Server's own, on
    every type it sends; a Client's packet with any other value is a Malformed Packet,
    DISCONNECT 0x81 and close (a CONNECT is only closed: its CONNACK is a MAY)."""
    if name == "the Server's":
        sent = {(type(p).__name__.upper(), p.raw[0] & 0x0F) for p in sweep(port)
                if not isinstance(p, Publish)}
        assert sent == {(n, FLAGS[n]) for n in ("CONNACK", "PUBACK", "PUBREC", "PUBREL",
                                                 "PUBCOMP", "SUBACK", "UNSUBACK", "PINGRESP",
                                                 "DISCONNECT")}
    elif name == "CONNECT":
        good = connect_bytes(uid())
        got = {f: as_first(port, bytes([0x10 | f]) + good[1:]) for f in wrong_flags(name)}
        assert {f: c in ([], [0x81]) for f, c in got.items()} == {f: True for f in got}
    else:
        ptype, body = WRONG[name]
        got = {f: after_connect(port, frame(ptype << 4 | f, body)) for f in wrong_flags(name)}
        assert got == {f: [0x81] for f in got}


def test_mqtt_2_2_1_2(port: int) -> None:
    """[MQTT-2.2.1-2] A QoS 0 PUBLISH has no Packet Identifier: the Server's, to a QoS 0
    subscriber of a QoS 2 message and to a QoS 1 subscriber of a QoS 0 one, is byte for
    byte fixed header, Topic Name, Property Length 0, payload."""
    topic = uid("pid/")
    at0, at1 = connected(port), connected(port)
    at0.subscribe(topic, 0)
    at1.subscribe(topic, 1)
    p = connected(port)
    p.publish(topic, b"two", 2)
    p.publish(topic, b"zero", 0)
    body = {pl: s(topic) + b"\x00" + pl for pl in (b"two", b"zero")}
    expect = {pl: b"\x30" + varint_bytes(len(b)) + b for pl, b in body.items()}
    assert [m.raw for m in at0.messages(2)] == [expect[b"two"], expect[b"zero"]]
    assert [m.raw for m in at1.messages(2) if m.qos == 0] == [expect[b"zero"]]


def test_mqtt_2_2_1_3(port: int) -> None:
    """[MQTT-2.2.1-3] A Client's SUBSCRIBE, UNSUBSCRIBE and QoS 1/2 PUBLISH carry a
    non-zero Packet Identifier: 0 is refused (0x81 or 0x82) and the connection closed.
    An identifier is free again once acknowledged: reused at once, it is a new message."""
    for data in (subscribe_bytes(0, [("a/b", 0)]), unsubscribe_bytes(0, ["a/b"]),
                 publish_bytes("a/b", b"x", 1, pid=0), publish_bytes("a/b", b"x", 2, pid=0)):
        got = after_connect(port, data)
        assert len(got) == 1 and got[0] in (0x81, 0x82), (data, got)
    topic = uid("pid/")
    w = connected(port)
    w.subscribe(topic, 2)
    c = connected(port)
    for payload, qos in ((b"1", 1), (b"2", 1), (b"3", 2), (b"4", 2), (b"5", 1)):
        c.publish(topic, payload, qos, pid=7)
    assert [m.payload for m in w.messages(5)] == [b"1", b"2", b"3", b"4", b"5"]


def test_mqtt_2_2_1_4(port: int) -> None:
    """[MQTT-2.2.1-4] The Server's QoS 1 and 2 PUBLISHes carry non-zero identifiers not
    in use: six in flight at once are distinct; after three complete, the next three
    take none of the three still in use (one of them a QoS 2 at its PUBREL)."""
    topic = uid("pid/")
    c = connected(port, receive_maximum=20)
    c.subscribe(topic, 2)
    p = connected(port)
    for i in range(6):
        p.publish(topic, b"%d" % i, 1 + i % 2, pid=i + 1)
    first = c.messages(6, ack=False)
    ids = [m.packet_id for m in first]
    assert len(set(ids)) == 6 and 0 not in ids
    for m in first[:3]:
        c.ack(m)
    c.send(mqtt.Pubrec(first[3].packet_id))  # QoS 2: its id stays in use until PUBCOMP
    assert c.expect(Pubrel).packet_id == first[3].packet_id
    for i in range(3):
        p.publish(topic, b"n%d" % i, 1, pid=i + 1)
    later = [m.packet_id for m in c.messages(3, ack=False)]
    assert len(set(later)) == 3 and 0 not in later and not set(later) & set(ids[3:])


def test_mqtt_2_2_1_5(port: int) -> None:
    """[MQTT-2.2.1-5] PUBACK, PUBREC, PUBREL and PUBCOMP carry the identifier of their
    PUBLISH: the Server's answers to a Client's (ids 1, 0x8000, 0xFFFF), and the Server's
    PUBREL to its own PUBLISH."""
    topic = uid("pid/")
    c = connected(port)
    for pid in (1, 0x8000, 0xFFFF):
        assert c.publish(topic, b"x", 1, pid=pid) == Puback(pid)
        c.send(mqtt.Publish(topic, b"x", 2, packet_id=pid))
        assert c.expect(Pubrec) == Pubrec(pid)
        c.send(mqtt.Pubrel(pid))
        assert c.expect(Pubcomp) == Pubcomp(pid)
    w = connected(port)
    w.subscribe(topic, 2)
    c.publish(topic, b"x", 2, pid=5)
    m = w.messages(1, ack=False)[0]
    w.send(mqtt.Pubrec(m.packet_id))
    assert w.expect(Pubrel) == Pubrel(m.packet_id)


def test_mqtt_2_2_1_6(port: int) -> None:
    """[MQTT-2.2.1-6] SUBACK and UNSUBACK carry the identifier of their SUBSCRIBE and
    UNSUBSCRIBE (1, 0x1234, 0xFFFF)."""
    c = connected(port)
    for pid in (1, 0x1234, 0xFFFF):
        assert c.subscribe(uid("pid/"), 0, pid=pid).packet_id == pid
        c.send(mqtt.Unsubscribe(pid, [uid("pid/")]))
        assert c.expect(Unsuback).packet_id == pid


def test_mqtt_2_2_2_1(port: int) -> None:
    """[MQTT-2.2.2-1] No properties is written as Property Length 0: the Server's PUBLISH,
    SUBACK and UNSUBACK without properties have the 0x00 byte. A Client's PUBLISH that
    leaves it out reads its payload as properties: here a Malformed Packet (0x81)."""
    topic = uid("props/")
    c = connected(port)
    ack = c.subscribe(topic, 0, pid=9)
    assert ack.raw == b"\x90\x04\x00\x09\x00\x00"
    c.send(mqtt.Unsubscribe(10, [topic + "/none"]))
    assert c.expect(Unsuback).raw == b"\xb0\x04\x00\x0a\x00\x11"
    connected(port).publish(topic, b"hello")
    assert c.messages(1)[0].raw == b"\x30" + varint_bytes(len(topic) + 8) + s(topic) \
        + b"\x00hello"
    assert after_connect(port, frame(0x30, s("a/b") + b"hello")) == [0x81]


def test_spec_2_2_2_2_a(port: int) -> None:
    """[§2.2.2.2] A property identifier not valid for its packet type (unknown, or one
    that belongs to another packet), or a value not of the property's data type, is a
    Malformed Packet: CONNACK or DISCONNECT 0x81."""
    bad_props = [props(b"\x7f\x00"),  # unknown identifier 0x7F
                 props(b"\x80\x01\x00"),  # identifier 0x80 (two-byte form): unknown
                 props(b"\x24\x01")]  # Maximum QoS: a CONNACK property
    for prop in bad_props:
        assert as_first(port, connect_bytes(uid(), cprops=prop)) == [0x81], prop
        assert after_connect(port, publish_bytes("a/b", b"x", pprops=prop)) == [0x81], prop
        assert after_connect(port, subscribe_bytes(1, [("a/b", 0)], sprops=prop)) == [0x81]
    assert after_connect(port, publish_bytes("a/b", b"x", pprops=props(b"\x11\x00\x00\x00\x05"))
                         ) == [0x81]  # Session Expiry Interval on PUBLISH
    assert after_connect(port, subscribe_bytes(1, [("a/b", 0)], sprops=props(b"\x23\x00\x01"))
                         ) == [0x81]  # Topic Alias on SUBSCRIBE
    assert after_connect(port, publish_bytes("a/b", b"", pprops=props(b"\x02\x00\x00"))
                         ) == [0x81]  # a Four Byte Integer cut to two
    assert as_first(port, connect_bytes(uid(), cprops=props(b"\x11\x00\x00"))) == [0x81]


def test_spec_2_2_2_2_b(port: int) -> None:
    """[§2.2.2.2, said of each property in chapter 3] A property included more than once
    where only one is allowed is a Protocol Error: CONNACK or DISCONNECT 0x82. User
    Properties may repeat."""
    twice = {
        "Session Expiry Interval": (True, connect_bytes(uid(), cprops=props(
            b"\x11\x00\x00\x00\x01\x11\x00\x00\x00\x02"))),
        "Receive Maximum": (True, connect_bytes(uid(), cprops=props(b"\x21\x00\x05" * 2))),
        "Payload Format Indicator": (False, publish_bytes("a/b", b"x", pprops=props(
            b"\x01\x00\x01\x00"))),
        "Content Type": (False, publish_bytes("a/b", b"x", pprops=props(
            b"\x03" + s("a") + b"\x03" + s("b")))),
        "Message Expiry Interval": (False, publish_bytes("a/b", b"x", pprops=props(
            b"\x02\x00\x00\x00\x05" * 2))),
        "Subscription Identifier": (False, subscribe_bytes(1, [("a/b", 0)], sprops=props(
            b"\x0b\x01\x0b\x02"))),
    }
    got = {what: as_first(port, data) if first else after_connect(port, data)
           for what, (first, data) in twice.items()}
    assert got == {what: [0x82] for what in twice}
    topic = uid("props/")
    c = connected(port)
    c.subscribe(topic, 0)
    connected(port).send_raw(publish_bytes(topic, b"x", pprops=props(
        b"\x26" + s("k") + s("1") + b"\x26" + s("k") + s("2"))))
    assert c.messages(1)[0].properties["user_property"] == [("k", "1"), ("k", "2")]
