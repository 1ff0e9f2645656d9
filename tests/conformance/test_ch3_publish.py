"""MQTT 5.0 sections 3.3 (PUBLISH) to 3.7 (PUBCOMP), one test per normative statement."""

from __future__ import annotations

import time

import pytest

from gateway import mqtt
from tests.conformance.reader import (
    Disconnect,
    Pingresp,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
)
from tests.conformance.wire import Peer, connected, props, publish_bytes, s, uid

PUBACK_CODES = {0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99}
PUBREL_CODES = {0x00, 0x92}


def pair(port: int, qos: int = 1, **opts) -> tuple[Peer, Peer, str]:
    """A subscriber on a fresh topic, and a publisher."""
    topic = uid("p/")
    sub = connected(port)
    sub.subscribe(topic, qos, **opts)
    return sub, connected(port), topic


def refused_publish(port: int, data: bytes) -> list:
    c = connected(port)
    c.send_raw(data)
    return c.refused()


def forwarded(port: int, **properties) -> dict:
    sub, pub, topic = pair(port)
    pub.publish(topic, b"x", 1, **properties)
    return sub.messages(1)[0].properties


def test_mqtt_3_3_1_1(port: int) -> None:
    """[MQTT-3.3.1-1] A QoS 1 message re-delivered on reconnect has DUP 1."""
    cid, topic = uid(), uid("p/")
    c = connected(port, cid, session_expiry_interval=60)
    c.subscribe(topic, 1)
    connected(port).publish(topic, b"x", 1)
    first = c.messages(1, ack=False)[0]
    c.close()
    c = Peer(port)
    c.connect(cid, clean=False, session_expiry_interval=60)
    again = c.expect(Publish)
    assert (first.dup, again.dup, again.packet_id) == (False, True, first.packet_id)


def test_mqtt_3_3_1_2(port: int) -> None:
    """[MQTT-3.3.1-2] QoS 0 deliveries have DUP 0 (even of a DUP 1 QoS 1 publish)."""
    sub, pub, topic = pair(port, 0)
    pub.send(mqtt.Publish(topic, b"x", 1, dup=True, packet_id=3))
    m = sub.messages(1)[0]
    assert (m.qos, m.dup) == (0, False)


def test_mqtt_3_3_1_3(port: int) -> None:
    """[MQTT-3.3.1-3] Outgoing DUP does not copy the incoming DUP."""
    sub, pub, topic = pair(port, 1)
    pub.send(mqtt.Publish(topic, b"x", 1, dup=True, packet_id=4))
    assert not sub.messages(1)[0].dup


def test_mqtt_3_3_1_4(port: int) -> None:
    """[MQTT-3.3.1-4] QoS 3: malformed, closed."""
    refused_publish(port, publish_bytes("p/" + uid(), b"x", b0=0x36))


def test_mqtt_3_3_1_5(port: int) -> None:
    """[MQTT-3.3.1-5] A retained publish replaces the topic's retained message."""
    topic = uid("r/")
    p = connected(port)
    p.publish(topic, b"one", 1, retain=True)
    p.publish(topic, b"two", 1, retain=True)
    c = connected(port)
    c.subscribe(topic, 1)
    assert [m.payload for m in c.messages(1)] == [b"two"] and c.quiet(0.4)


def test_mqtt_3_3_1_6(port: int) -> None:
    """[MQTT-3.3.1-6] A retained empty payload removes the retained message."""
    topic = uid("r/")
    p = connected(port)
    p.publish(topic, b"one", 1, retain=True)
    p.publish(topic, b"", 1, retain=True)
    c = connected(port)
    c.subscribe(topic, 1)
    assert c.quiet()


def test_mqtt_3_3_1_7(port: int) -> None:
    """[MQTT-3.3.1-7] A retained empty payload is not itself stored as retained."""
    topic = uid("r/")
    connected(port).publish(topic, b"", 1, retain=True)
    c = connected(port)
    c.subscribe(topic, 1)
    assert c.quiet()


def test_mqtt_3_3_1_8(port: int) -> None:
    """[MQTT-3.3.1-8] RETAIN 0 neither stores nor replaces the retained message."""
    topic = uid("r/")
    p = connected(port)
    p.publish(topic, b"kept", 1, retain=True)
    p.publish(topic, b"live", 1)
    p.publish(uid("r/"), b"other", 1)
    c = connected(port)
    c.subscribe(topic, 1)
    assert [m.payload for m in c.messages(1)] == [b"kept"] and c.quiet(0.4)


def test_mqtt_3_3_1_9(port: int) -> None:
    """[MQTT-3.3.1-9] Retain Handling 0 sends the retained messages on subscribe."""
    topic = uid("r/")
    connected(port).publish(topic, b"r", 1, retain=True)
    c = connected(port)
    c.subscribe(topic, 1, retain_handling=0)
    assert c.messages(1)[0].payload == b"r"


def test_mqtt_3_3_1_10(port: int) -> None:
    """[MQTT-3.3.1-10] Retain Handling 1: retained only for a new subscription."""
    topic = uid("r/")
    connected(port).publish(topic, b"r", 1, retain=True)
    c = connected(port)
    c.subscribe(topic, 1, retain_handling=1)
    assert c.messages(1)[0].payload == b"r"
    c.subscribe(topic, 1, pid=2, retain_handling=1)
    assert c.quiet()


def test_mqtt_3_3_1_11(port: int) -> None:
    """[MQTT-3.3.1-11] Retain Handling 2: no retained messages."""
    topic = uid("r/")
    connected(port).publish(topic, b"r", 1, retain=True)
    c = connected(port)
    c.subscribe(topic, 1, retain_handling=2)
    assert c.quiet()


def test_mqtt_3_3_1_12(port: int) -> None:
    """[MQTT-3.3.1-12] Retain As Published 0: live messages forwarded with RETAIN 0."""
    sub, pub, topic = pair(port, retain_as_published=False)
    pub.publish(topic, b"x", 1, retain=True)
    assert not sub.messages(1)[0].retain


def test_mqtt_3_3_1_13(port: int) -> None:
    """[MQTT-3.3.1-13] Retain As Published 1: RETAIN kept as published."""
    sub, pub, topic = pair(port, retain_as_published=True)
    pub.publish(topic, b"x", 1, retain=True)
    pub.publish(topic, b"y", 1, retain=False)
    assert [m.retain for m in sub.messages(2)] == [True, False]


def test_mqtt_3_3_2_1(port: int) -> None:
    """[MQTT-3.3.2-1] A Topic Name that is not UTF-8: malformed, closed."""
    refused_publish(port, publish_bytes(b"p/\xff", b"x"))


def test_mqtt_3_3_2_2(port: int) -> None:
    """[MQTT-3.3.2-2] A Topic Name with '+': refused, closed."""
    refused_publish(port, publish_bytes("p/+/x", b"x"))


def test_mqtt_3_3_2_3(port: int) -> None:
    """[MQTT-3.3.2-3] The Topic Name sent matches the subscription's filter."""
    base = uid("p/")
    c = connected(port)
    c.subscribe(base + "/+/z", 0)
    connected(port).publish(base + "/y/z", b"x")
    assert c.messages(1)[0].topic == base + "/y/z"


def test_mqtt_3_3_2_4(port: int) -> None:
    """[MQTT-3.3.2-4] The Payload Format Indicator is forwarded unaltered."""
    assert forwarded(port, payload_format_indicator=1)["payload_format_indicator"] == 1


def test_mqtt_3_3_2_5(port: int) -> None:
    """[MQTT-3.3.2-5] A message that expired while the subscriber was away is deleted."""
    cid, topic = uid(), uid("p/")
    c = connected(port, cid, session_expiry_interval=60)
    c.subscribe(topic, 1)
    c.disconnect()
    p = connected(port)
    p.publish(topic, b"short", 1, message_expiry_interval=1)
    p.publish(topic, b"long", 1, message_expiry_interval=100)
    time.sleep(2.1)
    c = Peer(port)
    c.connect(cid, clean=False, session_expiry_interval=60)
    assert [m.payload for m in c.messages(1)] == [b"long"] and c.quiet(0.4)


def test_mqtt_3_3_2_6(port: int) -> None:
    """[MQTT-3.3.2-6] The Message Expiry Interval is lowered by the time waited."""
    topic = uid("r/")
    connected(port).publish(topic, b"r", 1, retain=True, message_expiry_interval=30)
    time.sleep(2.1)
    c = connected(port)
    c.subscribe(topic, 1)
    assert c.messages(1)[0].properties["message_expiry_interval"] <= 28


def test_mqtt_3_3_2_7(port: int) -> None:
    """[MQTT-3.3.2-7] An alias set on one connection means nothing on the next."""
    cid, topic = uid(), uid("p/")
    c = connected(port, cid)
    c.publish(topic, b"x", 1, topic_alias=1)
    c.disconnect()
    c = connected(port, cid)
    c.send(mqtt.Publish("", b"y", 1, packet_id=2, properties={"topic_alias": 1}))
    c.refused()


def test_mqtt_3_3_2_8(port: int) -> None:
    """[MQTT-3.3.2-8] Topic Alias 0: DISCONNECT 0x94 and closed."""
    got = refused_publish(port, publish_bytes("p/x", b"x", pprops=props(b"\x23\x00\x00")))
    assert [p.reason_code for p in got if isinstance(p, Disconnect)] == [0x94]


def test_mqtt_3_3_2_9(port: int) -> None:
    """[MQTT-3.3.2-9] An alias above the Server's maximum: 0x94, closed."""
    c = Peer(port)
    top = c.connect(uid()).properties["topic_alias_maximum"]
    c.send_raw(publish_bytes("p/x", b"x", pprops=props(b"\x23" + (top + 1).to_bytes(2, "big"))))
    c.refused_with(0x94)


def test_mqtt_3_3_2_11(port: int) -> None:
    """[MQTT-3.3.2-11] Client Topic Alias Maximum 1: alias 1 is used (the first topic,
    twice), none above it for the other three."""
    base = uid("ta/")
    c = connected(port, topic_alias_maximum=1)
    c.subscribe(base + "/+", 0)
    p = connected(port)
    for i in (0, 0, 1, 2, 3):
        p.publish(f"{base}/{i}", b"x")
    assert [m.properties.get("topic_alias") for m in c.messages(5)] == [1, 1, None, None, None]


def test_mqtt_3_3_2_12(port: int) -> None:
    """[MQTT-3.3.2-12] Aliases 1 and the returned maximum are both accepted."""
    sub, _, topic = pair(port, 0)
    c = Peer(port)
    top = c.connect(uid()).properties["topic_alias_maximum"]
    for alias in (1, top):
        c.send(mqtt.Publish(topic, b"set", properties={"topic_alias": alias}))
        c.send(mqtt.Publish("", b"use", properties={"topic_alias": alias}))
    assert [m.payload for m in sub.messages(4)] == [b"set", b"use"] * 2


def test_mqtt_3_3_2_13(port: int) -> None:
    """[MQTT-3.3.2-13] A Response Topic that is not UTF-8: malformed, closed."""
    refused_publish(port, publish_bytes("p/x", b"x", pprops=props(b"\x08" + s(b"r/\xc0"))))


def test_mqtt_3_3_2_14(port: int) -> None:
    """[MQTT-3.3.2-14] A Response Topic with a wildcard: refused, closed."""
    refused_publish(port, publish_bytes("p/x", b"x", pprops=props(b"\x08" + s("r/#"))))


def test_mqtt_3_3_2_15(port: int) -> None:
    """[MQTT-3.3.2-15] The Response Topic is forwarded unaltered."""
    assert forwarded(port, response_topic="re/ply/ü")["response_topic"] == "re/ply/ü"


def test_mqtt_3_3_2_16(port: int) -> None:
    """[MQTT-3.3.2-16] The Correlation Data is forwarded unaltered."""
    assert forwarded(port, correlation_data=b"\x00\xffid")["correlation_data"] == b"\x00\xffid"


def test_mqtt_3_3_2_17(port: int) -> None:
    """[MQTT-3.3.2-17] All User Properties are forwarded unaltered (repeated keys too)."""
    ups = [("a", "1"), ("a", "1"), ("b", "")]
    assert forwarded(port, user_property=ups)["user_property"] == ups


def test_mqtt_3_3_2_18(port: int) -> None:
    """[MQTT-3.3.2-18] User Properties keep their order."""
    ups = [("z", "1"), ("a", "2"), ("m", "3"), ("a", "0")]
    assert forwarded(port, user_property=ups)["user_property"] == ups


def test_mqtt_3_3_2_19(port: int) -> None:
    """[MQTT-3.3.2-19] A Content Type that is not UTF-8: malformed, closed."""
    refused_publish(port, publish_bytes("p/x", b"x", pprops=props(b"\x03" + s(b"\xff"))))


def test_mqtt_3_3_2_20(port: int) -> None:
    """[MQTT-3.3.2-20] The Content Type is forwarded unaltered."""
    assert forwarded(port, content_type="app/x; q=1")["content_type"] == "app/x; q=1"


def test_mqtt_3_3_4_1(port: int) -> None:
    """[MQTT-3.3.4-1] The Server answers QoS 1 with PUBACK, QoS 2 with PUBREC."""
    c = connected(port)
    topic = uid("p/")
    assert c.publish(topic, b"x", 1, pid=5).packet_id == 5
    assert c.publish(topic, b"x", 2, pid=6).packet_id == 6


def test_mqtt_3_3_4_2(port: int) -> None:
    """[MQTT-3.3.4-2] Overlapping subscriptions: delivered at the highest granted QoS."""
    base = uid("p/")
    c = connected(port)
    c.subscribe(base + "/+", 0)
    c.subscribe(base + "/#", 1, pid=2)
    connected(port).publish(base + "/x", b"x", 1)
    got = [c.expect(Publish)]
    got += [] if c.quiet(0.5) else [c.expect(Publish)]
    assert max(m.qos for m in got) == 1


def _overlap(port: int, shared: bool = False) -> list:
    """The copies one client gets of one message matching two of its subscriptions,
    ids 7 and 9: both plain, or the second one a Shared Subscription."""
    base = uid("p/")
    c = connected(port)
    c.subscribe(base + "/+", 1, sid=7)
    c.subscribe(f"$share/{uid('g')}/{base}/#" if shared else base + "/#", 1, pid=2, sid=9)
    connected(port).publish(base + "/x", b"x", 1)
    got = [c.messages(1)[0]]
    while not c.quiet(0.5):
        got.append(c.messages(1)[0])
    return [sorted(m.properties.get("subscription_identifier", [])) for m in got]


def test_mqtt_3_3_4_3(port: int) -> None:
    """[MQTT-3.3.4-3] Overlapping subscriptions with identifiers: both ids are sent."""
    assert sorted(i for ids in _overlap(port) for i in ids) == [7, 9]


def test_mqtt_3_3_4_4(port: int) -> None:
    """[MQTT-3.3.4-4] Two plain subscriptions match: the Server sends one copy, and it
    carries both identifiers."""
    assert _overlap(port) == [[7, 9]]


def test_mqtt_3_3_4_5(port: int) -> None:
    """[MQTT-3.3.4-5] A plain and a Shared Subscription of one client match: the Server
    sends a copy for each (the share group delivers its own), each with its own id."""
    assert sorted(_overlap(port, shared=True)) == [[7], [9]]


def test_mqtt_3_3_4_6(port: int) -> None:
    """[MQTT-3.3.4-6] A PUBLISH from a client with a Subscription Identifier: closed."""
    refused_publish(port, publish_bytes("p/x", b"x", pprops=props(b"\x0b\x05")))


@pytest.mark.parametrize("qos", [1, 2])
def test_mqtt_3_3_4_7(port: int, qos: int) -> None:
    """[MQTT-3.3.4-7] More unacknowledged QoS 1 or 2 publishes than the Server's Receive
    Maximum, in one write: DISCONNECT 0x93, closed; each one stored before the one too
    many is acknowledged first (PUBACK or PUBREC), so that it is not sent again."""
    c = Peer(port)
    rmax = c.connect(uid()).properties["receive_maximum"]
    topic = uid("p/")
    c.send_raw(b"".join(mqtt.encode(mqtt.Publish(topic, b"x", qos, packet_id=i + 1), 5)
                        for i in range(rmax + 1)))
    got = c.refused()
    ack = Puback if qos == 1 else Pubrec
    assert [(type(p), p.packet_id) for p in got[:-1]] == \
        [(ack, i + 1) for i in range(rmax)], got
    assert isinstance(got[-1], Disconnect) and got[-1].reason_code == 0x93, got


def test_mqtt_3_3_4_9(port: int) -> None:
    """[MQTT-3.3.4-9] Client Receive Maximum 2: at most 2 unacknowledged deliveries."""
    sub = connected(port, receive_maximum=2)
    topic = uid("p/")
    sub.subscribe(topic, 1)
    p = connected(port)
    for i in range(5):
        p.publish(topic, b"%d" % i, 1)
    first = sub.messages(2, ack=False)
    assert sub.quiet(0.8)
    sub.ack(first[0])
    assert sub.messages(1, ack=False)[0].payload == b"2" and sub.quiet(0.5)


def test_mqtt_3_3_4_10(port: int) -> None:
    """[MQTT-3.3.4-10] With the window full, PINGRESP and SUBACK still come."""
    sub = connected(port, receive_maximum=1)
    topic = uid("p/")
    sub.subscribe(topic, 1)
    p = connected(port)
    p.publish(topic, b"1", 1)
    p.publish(topic, b"2", 1)
    sub.messages(1, ack=False)
    sub.send(mqtt.Pingreq())
    sub.expect(Pingresp)
    assert sub.subscribe(uid("p/"), 1, pid=9).packet_id == 9


def test_mqtt_3_4_2_1(port: int) -> None:
    """[MQTT-3.4.2-1] PUBACK codes are PUBACK Reason Codes (success and refusal)."""
    c = connected(port)
    codes = [c.publish(uid("p/"), b"x", 1, pid=1).reason_code,
             c.publish("$sys/" + uid(), b"x", 1, pid=2).reason_code]
    assert set(codes) <= PUBACK_CODES and codes[1] >= 0x80


def test_mqtt_3_4_2_2(port: int) -> None:
    """[MQTT-3.4.2-2] A refusing PUBACK, which carries a Reason String, leaves it out to
    fit the client's Maximum Packet Size (8)."""
    topic = "$x/" + uid()
    assert connected(port).publish(topic, b"x", 1).properties["reason_string"]
    ack = connected(port, maximum_packet_size=8).publish(topic, b"x", 1)
    assert ack.reason_code >= 0x80 and ack.size <= 8


def test_mqtt_3_5_2_1(port: int) -> None:
    """[MQTT-3.5.2-1] PUBREC codes are PUBREC Reason Codes."""
    c = connected(port)
    codes = [c.publish(uid("p/"), b"x", 2, pid=1).reason_code,
             c.publish("$x/" + uid(), b"x", 2, pid=2).reason_code]
    assert set(codes) <= PUBACK_CODES and codes[1] >= 0x80


def test_mqtt_3_5_2_2(port: int) -> None:
    """[MQTT-3.5.2-2] A refusing PUBREC, which carries a Reason String, leaves it out to
    fit the client's Maximum Packet Size (8)."""
    topic = "$x/" + uid()
    assert connected(port).publish(topic, b"x", 2).properties["reason_string"]
    rec = connected(port, maximum_packet_size=8).publish(topic, b"x", 2)
    assert rec.reason_code >= 0x80 and rec.size <= 8


def test_mqtt_3_6_1_1(port: int) -> None:
    """[MQTT-3.6.1-1] PUBREL with flags 0000: malformed, closed."""
    c = connected(port)
    c.publish(uid("p/"), b"x", 2, pid=1)  # completes; the id is free
    c.send_raw(b"\x60\x02\x00\x01")
    c.refused()


def test_mqtt_3_6_2_1(port: int) -> None:
    """[MQTT-3.6.2-1] PUBRELs (after PUBREC, and for an unknown id) use PUBREL codes."""
    sub, pub, topic = pair(port, 2)
    pub.publish(topic, b"x", 2)
    m = sub.messages(1, ack=False)[0]
    sub.send(mqtt.Pubrec(m.packet_id))
    codes = [sub.expect(Pubrel).reason_code]
    sub.send(mqtt.Pubrec(60000))
    codes.append(sub.expect(Pubrel).reason_code)
    assert set(codes) <= PUBREL_CODES


def test_mqtt_3_7_2_1(port: int) -> None:
    """[MQTT-3.7.2-1] PUBCOMPs (known and unknown id) use PUBCOMP codes."""
    c = connected(port)
    c.send(mqtt.Publish(uid("p/"), b"x", 2, packet_id=1))
    c.expect(Pubrec)
    c.send(mqtt.Pubrel(1))
    c.send(mqtt.Pubrel(2))
    assert {c.expect(Pubcomp).reason_code for _ in range(2)} <= PUBREL_CODES
