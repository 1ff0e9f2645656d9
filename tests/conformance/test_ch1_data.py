"""MQTT 5.0 chapter 1 (data representation): UTF-8 Encoded Strings (§1.5.4), Variable
Byte Integers (§1.5.5) and UTF-8 String Pairs (§1.5.7), one test per normative
statement. What the Server sends is held to the same rules by the reader on every
packet of every test; the tests here also give the Server the cases that need them."""

from __future__ import annotations

import pytest

from gateway import mqtt
from tests.conformance.reader import Connack, Disconnect, Publish, Suback, varint_bytes
from tests.conformance.wire import (
    Peer,
    connect_bytes,
    connected,
    frame,
    props,
    publish_bytes,
    s,
    subscribe_bytes,
    uid,
    unsubscribe_bytes,
)

ILL_FORMED = {
    "a surrogate U+D800": b"\xed\xa0\x80",
    "a surrogate U+DFFF": b"\xed\xbf\xbf",
    "an overlong '/'": b"\xc0\xaf",
    "an overlong U+20AC": b"\xf0\x82\x82\xac",
    "byte 0xFF": b"\xff",
    "a truncated sequence": b"\xe2\x82",
    "a lone continuation byte": b"\x80",
    "above U+10FFFF": b"\xf4\x90\x80\x80",
}


def strings_with(bad: bytes) -> dict[str, tuple[bool, bytes]]:
    """A packet for each kind of UTF-8 field a Client sends, `bad` inside that field:
    name -> (whether it is the connection's first packet, its bytes)."""
    return {
        "ClientID": (True, connect_bytes(b"c" + bad)),
        "User Name": (True, connect_bytes(uid(), flags=0x82, payload_tail=s(b"u" + bad))),
        "Will Topic": (True, connect_bytes(uid(), flags=0x06,
                                           payload_tail=b"\x00" + s(b"w/" + bad) + s(b"x"))),
        "Authentication Method": (True, connect_bytes(uid(), cprops=props(b"\x15" + s(bad)))),
        "Topic Name": (False, publish_bytes(b"t/" + bad, b"x")),
        "Content Type": (False, publish_bytes("t/x", b"x", pprops=props(b"\x03" + s(bad)))),
        "Response Topic": (False, publish_bytes("t/x", b"x",
                                                pprops=props(b"\x08" + s(b"r/" + bad)))),
        "Topic Filter": (False, subscribe_bytes(1, [(b"f/" + bad, 0)])),
        "UNSUBSCRIBE Topic Filter": (False, unsubscribe_bytes(1, [b"f/" + bad])),
    }


def will_survives_disconnect_with(port: int, bad: bytes) -> bool:
    """DISCONNECT 0x00 with `bad` in its Reason String: the Server closes the connection
    either way; only if it took the packet as malformed is the Will still published."""
    topic = uid("will/")
    w = connected(port)
    w.subscribe(topic, 0)
    c = connected(port, will=mqtt.Will(topic, b"bye"))
    c.send_raw(frame(0xE0, b"\x00" + props(b"\x1f" + s(b"r" + bad))))
    assert c.closed()
    return [m.payload for m in w.publishes_within(1.0)] == [b"bye"]


def refusal(port: int, first: bool, data: bytes) -> list[int]:
    """Send `data` (on a new connection, or after a CONNECT): the codes of the CONNACKs
    and DISCONNECTs the Server answers with, once it has closed the connection."""
    c = Peer(port) if first else connected(port)
    c.send_raw(data)
    assert c.closed(), f"connection left open; got {c.pending}"
    return [p.reason_code for p in c.pending if isinstance(p, (Connack, Disconnect))]


@pytest.mark.parametrize("bad", ILL_FORMED.values(), ids=ILL_FORMED.keys())
def test_mqtt_1_5_4_1(port: int, bad: bytes) -> None:
    """[MQTT-1.5.4-1] Ill-formed UTF-8, surrogates included, in any UTF-8 field: a
    Malformed Packet, refused with 0x81; in a DISCONNECT's Reason String, the DISCONNECT
    does not count (the Will is published)."""
    got = {where: refusal(port, first, data) for where, (first, data) in
           strings_with(bad).items()}
    assert got == {where: [0x81] for where in got}
    assert will_survives_disconnect_with(port, bad)


def test_well_formed_utf8_is_taken(port: int) -> None:
    """(The other side of 1.5.4-1: what is well-formed is not refused. Non-characters such
    as U+FFFF are well-formed; a Server MAY refuse them, this one takes them.)"""
    topic = uid("t/") + "/\U0001d11e/\uffff/\ufdd0/\u20ac/\u00e9"
    c = connected(port)
    c.subscribe(topic, 0)
    connected(port).publish(topic, b"x", content_type="\U0001f600\uffff")
    m = c.messages(1)[0]
    assert (m.topic, m.properties["content_type"]) == (topic, "\U0001f600\uffff")


def test_mqtt_1_5_4_2(port: int) -> None:
    """[MQTT-1.5.4-2] U+0000 in any UTF-8 field: a Malformed Packet, refused with 0x81."""
    got = {where: refusal(port, first, data) for where, (first, data) in
           strings_with(b"\x00").items()}
    assert got == {where: [0x81] for where in got}
    assert will_survives_disconnect_with(port, b"\x00")


def test_mqtt_1_5_4_3(port: int) -> None:
    """[MQTT-1.5.4-3] 0xEF 0xBB 0xBF is U+FEFF wherever it is, never skipped or stripped:
    a topic starting with it is another topic than without it, and it reaches the
    subscriber in the topic, a User Property and the Content Type as sent."""
    base = uid("bom/")
    with_bom, without = "\ufeff" + base, base
    exact, plain = connected(port), connected(port)
    exact.subscribe(with_bom, 0)
    plain.subscribe(without, 0)
    connected(port).publish(with_bom, b"x", content_type="\ufefftext/plain",
                            user_property=[("\ufeffk", "v\ufeff")])
    m = exact.messages(1)[0]
    assert m.raw.count(b"\xef\xbb\xbf") == 4
    assert (m.topic, m.properties["content_type"], m.properties["user_property"]) == \
        (with_bom, "\ufefftext/plain", [("\ufeffk", "v\ufeff")])
    assert plain.quiet(0.4)


def _length_field(raw: bytes) -> bytes:
    """The Remaining Length bytes of a packet as sent."""
    n = 1
    while raw[n] & 0x80:
        n += 1
    return raw[1:n + 1]


def test_mqtt_1_5_5_1(port: int) -> None:
    """[MQTT-1.5.5-1] Variable Byte Integers in the fewest bytes. The Server's: Remaining
    Lengths of one, two and three bytes, a two-byte Subscription Identifier, a Property
    Length above 127. A Client's that are not (Remaining Length, Property Length,
    Subscription Identifier): a Malformed Packet, DISCONNECT 0x81."""
    topic = uid("v/")
    c = connected(port)
    c.subscribe(topic, 0, sid=300)
    p = connected(port)
    for size in (10, 200, 20_000):
        p.publish(topic, b"x" * size, user_property=[("k", "v" * 150)])
    got = c.messages(3)
    assert [len(_length_field(m.raw)) for m in got] == [2, 2, 3]  # 10 + 150: two bytes
    assert [_length_field(m.raw) == varint_bytes(m.size - 1 - len(_length_field(m.raw)))
            for m in got] == [True] * 3
    assert {m.properties["subscription_identifier"] == [300] for m in got} == {True}
    assert b"\x0b\xac\x02" in got[0].raw  # 300, in two bytes
    for data in (b"\xc0\x80\x00",  # PINGREQ, Remaining Length 0 in two bytes
                 publish_bytes("t/x", b"x", pprops=b"\x80\x00"),  # Property Length 0
                 subscribe_bytes(1, [("t/x", 0)], sprops=props(b"\x0b\x81\x00"))):  # id 1
        assert refusal(port, False, data) == [0x81], data


def test_spec_1_5_5_a(port: int) -> None:
    """[§1.5.5] A Variable Byte Integer has four bytes at most: a Client's of five (a
    Remaining Length, a Property Length) is a Malformed Packet, DISCONNECT 0x81."""
    assert refusal(port, False, b"\xc0\x80\x80\x80\x80\x00") == [0x81]
    assert refusal(port, False, publish_bytes("t/x", b"x", pprops=b"\x80\x80\x80\x80\x00")) \
        == [0x81]


def test_mqtt_1_5_7_1(port: int) -> None:
    """[MQTT-1.5.7-1] Both strings of a UTF-8 String Pair (a User Property) follow the
    rules of UTF-8 Encoded Strings: ill-formed or U+0000 in the name or the value, in a
    CONNECT, a PUBLISH or a SUBSCRIBE, is a Malformed Packet (0x81). Pairs that follow
    them, empty strings included, are forwarded as sent."""
    pairs = [(s(b"k\xed\xa0\x80") + s(b"v")), (s(b"k") + s(b"\xc0\xaf")),
             (s(b"k\x00") + s(b"v")), (s(b"k") + s(b"v\x00"))]
    for pair in pairs:
        up = props(b"\x26" + pair)
        got = [refusal(port, True, connect_bytes(uid(), cprops=up)),
               refusal(port, False, publish_bytes("t/x", b"x", pprops=up)),
               refusal(port, False, subscribe_bytes(1, [("t/x", 0)], sprops=up))]
        assert got == [[0x81]] * 3, pair
    topic = uid("up/")
    c = connected(port)
    assert isinstance(c.subscribe(topic, 0), Suback)
    ups = [("", ""), ("\U0001f600", "\uffff"), ("k", "")]
    connected(port).publish(topic, b"x", user_property=ups)
    m = c.expect(Publish)
    assert m.properties["user_property"] == ups
