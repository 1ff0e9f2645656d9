"""MQTT 5.0 sections 3.8 (SUBSCRIBE) to 3.15 (AUTH), one test per normative statement."""

from __future__ import annotations

from gateway import mqtt
from tests.conformance.reader import Disconnect, Pingresp, Pubrel, Suback, Unsuback
from tests.conformance.wire import (
    Peer,
    connected,
    subscribe_bytes,
    uid,
    unsubscribe_bytes,
)

SUBACK_CODES = {0x00, 0x01, 0x02, 0x80, 0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1, 0xA2}
UNSUBACK_CODES = {0x00, 0x11, 0x80, 0x83, 0x87, 0x8F, 0x91}
DISCONNECT_CODES = {0x00, 0x04, 0x80, 0x81, 0x82, 0x83, 0x87, 0x89, 0x8B, 0x8D, 0x8E, 0x8F,
                    0x90, 0x93, 0x94, 0x95, 0x96, 0x97, 0x98, 0x99, 0x9A, 0x9B, 0x9C, 0x9D,
                    0x9E, 0x9F, 0xA0, 0xA1, 0xA2}


def refused_after_connect(port: int, data: bytes, **kw) -> list:
    c = connected(port, **kw)
    c.send_raw(data)
    return c.refused()


def test_mqtt_3_8_1_1(port: int) -> None:
    """[MQTT-3.8.1-1] SUBSCRIBE with flags 0000: malformed, closed."""
    refused_after_connect(port, subscribe_bytes(1, [("a/b", 0)], b0=0x80))


def test_mqtt_3_8_3_1(port: int) -> None:
    """[MQTT-3.8.3-1] A Topic Filter that is not UTF-8: malformed, closed."""
    refused_after_connect(port, subscribe_bytes(1, [(b"a/\xfe", 0)]))


def test_mqtt_3_8_3_2(port: int) -> None:
    """[MQTT-3.8.3-2] SUBSCRIBE without a Topic Filter: Protocol Error, closed."""
    refused_after_connect(port, subscribe_bytes(1, []))


def test_mqtt_3_8_3_3(port: int) -> None:
    """[MQTT-3.8.3-3] No Local: the publisher's own messages are not sent back to it."""
    topic = uid("s/")
    c = connected(port)
    c.subscribe(topic, 1, no_local=True)
    c.publish(topic, b"mine", 1)
    other = connected(port)
    other.publish(topic, b"theirs", 1)
    assert [m.payload for m in c.messages(1)] == [b"theirs"]


def test_mqtt_3_8_3_4(port: int) -> None:
    """[MQTT-3.8.3-4] No Local on a Shared Subscription: Protocol Error, closed."""
    refused_after_connect(port, subscribe_bytes(1, [("$share/g/" + uid(), 0x04)]))


def test_mqtt_3_8_3_5(port: int) -> None:
    """[MQTT-3.8.3-5] Reserved Subscription Options bits set: malformed, closed."""
    refused_after_connect(port, subscribe_bytes(1, [("a/" + uid(), 0xC0)]))


def test_mqtt_3_8_4_1(port: int) -> None:
    """[MQTT-3.8.4-1] SUBSCRIBE is answered with SUBACK."""
    assert isinstance(connected(port).subscribe(uid("s/"), 0), Suback)


def test_mqtt_3_8_4_2(port: int) -> None:
    """[MQTT-3.8.4-2] The SUBACK carries the SUBSCRIBE's Packet Identifier."""
    assert connected(port).subscribe(uid("s/"), 0, pid=4242).packet_id == 4242


def test_mqtt_3_8_4_3(port: int) -> None:
    """[MQTT-3.8.4-3] Subscribing again to the same filter replaces the subscription: one
    copy, at the new QoS."""
    topic = uid("s/")
    c = connected(port)
    c.subscribe(topic, 0)
    c.subscribe(topic, 1, pid=2)
    connected(port).publish(topic, b"x", 1)
    assert c.messages(1)[0].qos == 1 and c.quiet(0.5)


def test_mqtt_3_8_4_4(port: int) -> None:
    """[MQTT-3.8.4-4] Replacing with Retain Handling 0 re-sends the retained message."""
    topic = uid("s/")
    connected(port).publish(topic, b"r", 1, retain=True)
    c = connected(port)
    c.subscribe(topic, 1)
    c.messages(1)
    c.subscribe(topic, 1, pid=2, retain_handling=0)
    assert c.messages(1)[0].payload == b"r"


def test_mqtt_3_8_4_5(port: int) -> None:
    """[MQTT-3.8.4-5] Several filters in one SUBSCRIBE act as several SUBSCRIBEs."""
    a, b = uid("s/"), uid("s/")
    c = connected(port)
    c.send(mqtt.Subscribe(1, [(a, mqtt.SubscriptionOptions(0)),
                              (b, mqtt.SubscriptionOptions(1))]))
    assert c.expect(Suback).reason_codes == [0, 1]
    p = connected(port)
    p.publish(a, b"a", 1)
    p.publish(b, b"b", 1)
    assert sorted((m.payload, m.qos) for m in c.messages(2)) == [(b"a", 0), (b"b", 1)]


def test_mqtt_3_8_4_6(port: int) -> None:
    """[MQTT-3.8.4-6] One Reason Code per Topic Filter."""
    c = connected(port)
    c.send(mqtt.Subscribe(1, [(uid("s/"), mqtt.SubscriptionOptions(q)) for q in (0, 1, 2)]))
    assert len(c.expect(Suback).reason_codes) == 3


def test_mqtt_3_8_4_7(port: int) -> None:
    """[MQTT-3.8.4-7] Each code is the granted QoS (or a failure)."""
    c = connected(port)
    c.send(mqtt.Subscribe(1, [(uid("s/"), mqtt.SubscriptionOptions(q)) for q in (2, 0, 1)]))
    assert c.expect(Suback).reason_codes == [2, 0, 1]


def test_mqtt_3_8_4_8(port: int) -> None:
    """[MQTT-3.8.4-8] Delivered QoS is min(published, granted)."""
    topic = uid("s/")
    c = connected(port)
    c.subscribe(topic, 1)
    p = connected(port)
    p.publish(topic, b"2", 2)
    p.publish(topic, b"0", 0)
    assert sorted(m.qos for m in c.messages(2)) == [0, 1]


def test_mqtt_3_9_3_1(port: int) -> None:
    """[MQTT-3.9.3-1] SUBACK codes are in the order of the filters."""
    c = connected(port)
    c.send(mqtt.Subscribe(1, [(uid("s/"), mqtt.SubscriptionOptions(q)) for q in (1, 2, 0, 1)]))
    assert c.expect(Suback).reason_codes == [1, 2, 0, 1]


def test_mqtt_3_9_3_2(port: int) -> None:
    """[MQTT-3.9.3-2] SUBACK codes are Subscribe Reason Codes."""
    c = connected(port)
    c.send(mqtt.Subscribe(1, [(uid("s/"), mqtt.SubscriptionOptions(2)),
                              ("$share/g/" + uid(), mqtt.SubscriptionOptions(1))]))
    assert set(c.expect(Suback).reason_codes) <= SUBACK_CODES


def test_mqtt_3_10_1_1(port: int) -> None:
    """[MQTT-3.10.1-1] UNSUBSCRIBE with flags 0000: malformed, closed."""
    refused_after_connect(port, unsubscribe_bytes(1, ["a/b"], b0=0xA0))


def test_mqtt_3_10_3_1(port: int) -> None:
    """[MQTT-3.10.3-1] An UNSUBSCRIBE filter that is not UTF-8: malformed, closed."""
    refused_after_connect(port, unsubscribe_bytes(1, [b"a/\xff"]))


def test_mqtt_3_10_3_2(port: int) -> None:
    """[MQTT-3.10.3-2] UNSUBSCRIBE without a filter: Protocol Error, closed."""
    refused_after_connect(port, unsubscribe_bytes(1, []))


def test_mqtt_3_10_4_1(port: int) -> None:
    """[MQTT-3.10.4-1] Filters compare character by character: "b/x" does not remove
    "b/+"; "b/+" does."""
    base = uid("u/")
    c = connected(port)
    c.subscribe(base + "/+", 0)
    c.send(mqtt.Unsubscribe(2, [base + "/x"]))
    assert c.expect(Unsuback).reason_codes == [0x11]
    c.send(mqtt.Unsubscribe(3, [base + "/+"]))
    assert c.expect(Unsuback).reason_codes == [0x00]


def test_mqtt_3_10_4_2(port: int) -> None:
    """[MQTT-3.10.4-2] After UNSUBSCRIBE no new messages are sent."""
    topic = uid("u/")
    c = connected(port)
    c.subscribe(topic, 1)
    c.send(mqtt.Unsubscribe(2, [topic]))
    c.expect(Unsuback)
    connected(port).publish(topic, b"x", 1)
    assert c.quiet()


def test_mqtt_3_10_4_3(port: int) -> None:
    """[MQTT-3.10.4-3] A QoS 2 delivery started before UNSUBSCRIBE is completed."""
    topic = uid("u/")
    c = connected(port)
    c.subscribe(topic, 2)
    connected(port).publish(topic, b"x", 2)
    m = c.messages(1, ack=False)[0]
    c.send(mqtt.Unsubscribe(2, [topic]))
    c.expect(Unsuback)
    c.send(mqtt.Pubrec(m.packet_id))
    assert c.expect(Pubrel) == Pubrel(m.packet_id)


def test_mqtt_3_10_4_4(port: int) -> None:
    """[MQTT-3.10.4-4] UNSUBSCRIBE is answered with UNSUBACK."""
    c = connected(port)
    c.send(mqtt.Unsubscribe(5, [uid("u/")]))
    assert isinstance(c.expect(Unsuback), Unsuback)


def test_mqtt_3_10_4_5(port: int) -> None:
    """[MQTT-3.10.4-5] UNSUBACK has the UNSUBSCRIBE's id, even when nothing was deleted."""
    c = connected(port)
    c.send(mqtt.Unsubscribe(31337, [uid("u/")]))
    assert c.expect(Unsuback).packet_id == 31337


def test_mqtt_3_10_4_6(port: int) -> None:
    """[MQTT-3.10.4-6] Several filters: each handled, one UNSUBACK."""
    a, b = uid("u/"), uid("u/")
    c = connected(port)
    c.subscribe(a, 0)
    c.send(mqtt.Unsubscribe(2, [a, b]))
    assert c.expect(Unsuback).reason_codes == [0x00, 0x11]
    assert c.quiet(0.3, Unsuback)


def test_mqtt_3_11_3_1(port: int) -> None:
    """[MQTT-3.11.3-1] UNSUBACK codes are in the order of the filters."""
    a, b = uid("u/"), uid("u/")
    c = connected(port)
    c.subscribe(b, 0)
    c.send(mqtt.Unsubscribe(2, [a, b, a]))
    assert c.expect(Unsuback).reason_codes == [0x11, 0x00, 0x11]


def test_mqtt_3_11_3_2(port: int) -> None:
    """[MQTT-3.11.3-2] UNSUBACK codes are Unsubscribe Reason Codes."""
    c = connected(port)
    c.subscribe("x/" + uid(), 0)
    c.send(mqtt.Unsubscribe(2, ["x/#", "$share/g/" + uid()]))
    assert set(c.expect(Unsuback).reason_codes) <= UNSUBACK_CODES


def test_mqtt_3_12_4_1(port: int) -> None:
    """[MQTT-3.12.4-1] PINGREQ is answered with PINGRESP."""
    c = connected(port)
    c.send(mqtt.Pingreq())
    assert isinstance(c.recv(), Pingresp)


def test_mqtt_3_14_0_1(port: int) -> None:
    """[MQTT-3.14.0-1] A refused CONNECT gets no DISCONNECT (at most a CONNACK)."""
    c = Peer(port)
    c.send_raw(b"\x10\x05\x00\x04MQ")  # truncated protocol name, then garbage
    c.send_raw(b"\xff" * 8)
    c.refused()
    assert not any(isinstance(p, Disconnect) for p in c.pending)


def test_mqtt_3_14_1_1(port: int) -> None:
    """[MQTT-3.14.1-1] DISCONNECT with reserved bits set: malformed, closed (not taken as
    a normal disconnect: the will is published)."""
    topic = uid("d/")
    w = connected(port)
    w.subscribe(topic, 0)
    refused_after_connect(port, b"\xe1\x00", will=mqtt.Will(topic, b"w"))
    assert w.messages(1)[0].payload == b"w"


def test_mqtt_3_14_2_1(port: int) -> None:
    """[MQTT-3.14.2-1] The Server's DISCONNECTs use DISCONNECT Reason Codes (takeover,
    protocol error)."""
    cid = uid()
    a = connected(port, cid)
    connected(port, cid)
    codes = [p.reason_code for p in a.refused() if isinstance(p, Disconnect)]
    codes += [p.reason_code for p in refused_after_connect(port, b"\x20\x02\x00\x00")
              if isinstance(p, Disconnect)]
    assert codes and set(codes) <= DISCONNECT_CODES


def test_mqtt_3_14_2_2(port: int) -> None:
    """[MQTT-3.14.2-2] The Server's DISCONNECT (a takeover of a Session with an expiry)
    has no Session Expiry Interval."""
    cid = uid()
    a = connected(port, cid, session_expiry_interval=30)
    connected(port, cid, session_expiry_interval=30)
    [d] = [p for p in a.refused() if isinstance(p, Disconnect)]
    assert "session_expiry_interval" not in d.properties


def test_mqtt_3_14_2_3(port: int) -> None:
    """[MQTT-3.14.2-3] The Server's DISCONNECT, which carries a Reason String, leaves it
    out to fit the client's Maximum Packet Size (8)."""
    [plain] = refused_after_connect(port, b"\x20\x02\x00\x00")
    assert isinstance(plain, Disconnect) and plain.properties["reason_string"]
    [d] = refused_after_connect(port, b"\x20\x02\x00\x00", maximum_packet_size=8)
    assert isinstance(d, Disconnect) and d.size <= 8


def test_mqtt_3_14_4_1(port: int) -> None:
    """[MQTT-3.14.4-1] After its DISCONNECT the Server sends nothing more."""
    cid = uid()
    a = connected(port, cid)
    connected(port, cid)
    got = a.refused()
    assert got and isinstance(got[-1], Disconnect)


def test_mqtt_3_14_4_2(port: int) -> None:
    """[MQTT-3.14.4-2] After its DISCONNECT the Server closes the connection."""
    got = refused_after_connect(port, b"\xc0\x01\x00")  # PINGREQ with a body: malformed
    assert [type(p) for p in got] == [Disconnect]


def test_mqtt_3_14_4_3(port: int) -> None:
    """[MQTT-3.14.4-3] DISCONNECT 0x00 discards the Will; 0x04 would have sent it."""
    topic = uid("d/")
    w = connected(port)
    w.subscribe(topic, 0)
    connected(port, will=mqtt.Will(topic, b"no")).disconnect(0x00)
    connected(port, will=mqtt.Will(topic, b"yes")).disconnect(0x04)
    assert [m.payload for m in w.messages(1)] == [b"yes"] and w.quiet(0.5)


def test_mqtt_3_15_1_1(port: int) -> None:
    """[MQTT-3.15.1-1] AUTH with reserved flags set: malformed, closed."""
    refused_after_connect(port, b"\xf1\x02\x18\x00")
