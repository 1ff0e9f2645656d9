"""MQTT 5.0 chapter 4 (operational behaviour), one test per normative statement."""

from __future__ import annotations

import time

from gateway import mqtt
from tests.conformance.conftest import PASSWORD, USER
from tests.conformance.reader import (
    Connack,
    Disconnect,
    Pingresp,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
)
from tests.conformance.wire import Peer, connected, publish_bytes, subscribe_bytes, uid
from tests.conftest import Server


def persistent(port: int, topic: str, qos: int = 1, cid: str | None = None) -> tuple[Peer, str]:
    cid = cid or uid()
    c = connected(port, cid, session_expiry_interval=60)
    c.subscribe(topic, qos)
    return c, cid


def resume(port: int, cid: str) -> Peer:
    c = Peer(port)
    assert c.connect(cid, clean=False, session_expiry_interval=60).session_present
    return c


def filter_refused(port: int, topic_filter: bytes | str) -> None:
    """A bad filter gets a failing SUBACK, or DISCONNECT with a failure code and close."""
    c = connected(port)
    c.send_raw(subscribe_bytes(1, [(topic_filter, 0)]))
    first = c.recv()
    if isinstance(first, Suback):
        assert first.reason_codes[0] >= 0x80, first
    else:
        assert isinstance(first, Disconnect) and first.reason_code >= 0x80, first
        assert c.closed()


def test_mqtt_4_1_0_1(port: int) -> None:
    """[MQTT-4.1.0-1] Session State is kept while connected, past its expiry interval."""
    topic = uid("o/")
    c = connected(port, session_expiry_interval=1)
    c.subscribe(topic, 1)
    time.sleep(1.5)
    connected(port).publish(topic, b"x", 1)
    assert c.messages(1)[0].payload == b"x"


def test_mqtt_4_1_0_2(port: int) -> None:
    """[MQTT-4.1.0-2] The Session is discarded once closed for its expiry interval."""
    cid = uid()
    connected(port, cid, session_expiry_interval=1).disconnect()
    time.sleep(2.2)
    assert not Peer(port).connect(cid, clean=False).session_present


def test_mqtt_4_3_1_1(port: int) -> None:
    """[MQTT-4.3.1-1] QoS 0 deliveries have QoS 0 and DUP 0."""
    topic = uid("o/")
    c = connected(port)
    c.subscribe(topic, 0)
    connected(port).publish(topic, b"x", 2)
    m = c.messages(1)[0]
    assert (m.qos, m.dup, m.packet_id) == (0, False, None)


def _inflight(port: int, qos: int, n: int) -> list:
    topic = uid("o/")
    c = connected(port)
    c.subscribe(topic, qos)
    p = connected(port)
    for i in range(n):
        p.publish(topic, b"%d" % i, qos)
    return c.messages(n, ack=False)


def test_mqtt_4_3_2_1(port: int) -> None:
    """[MQTT-4.3.2-1] Unacknowledged QoS 1 deliveries have distinct non-zero ids."""
    ids = [m.packet_id for m in _inflight(port, 1, 5)]
    assert len(set(ids)) == 5 and 0 not in ids


def test_mqtt_4_3_2_2(port: int) -> None:
    """[MQTT-4.3.2-2] A new QoS 1 delivery has QoS 1 and DUP 0."""
    assert all((m.qos, m.dup) == (1, False) for m in _inflight(port, 1, 2))


def test_mqtt_4_3_2_3(port: int) -> None:
    """[MQTT-4.3.2-3] Unacknowledged until PUBACK: an unacked one is resent on resume,
    an acked one is not."""
    topic = uid("o/")
    c, cid = persistent(port, topic)
    p = connected(port)
    p.publish(topic, b"acked", 1)
    p.publish(topic, b"open", 1)
    a, b = c.messages(2, ack=False)
    c.ack(a)
    c.send(mqtt.Pingreq())
    c.expect(Pingresp)
    c.close()
    c = resume(port, cid)
    assert [m.payload for m in c.messages(1)] == [b"open"] and c.quiet(0.4)


def test_mqtt_4_3_2_4(port: int) -> None:
    """[MQTT-4.3.2-4] The Server's PUBACK carries the PUBLISH's id."""
    assert connected(port).publish(uid("o/"), b"x", 1, pid=999).packet_id == 999


def test_mqtt_4_3_2_5(port: int) -> None:
    """[MQTT-4.3.2-5] After PUBACK, the same id is a new message (delivered again)."""
    topic = uid("o/")
    w = connected(port)
    w.subscribe(topic, 1)
    c = connected(port)
    c.publish(topic, b"a", 1, pid=3)
    c.send(mqtt.Publish(topic, b"a", 1, dup=True, packet_id=3))
    c.expect(Puback)
    assert [m.payload for m in w.messages(2)] == [b"a", b"a"]


def test_mqtt_4_3_3_1(port: int) -> None:
    """[MQTT-4.3.3-1] Unacknowledged QoS 2 deliveries have distinct non-zero ids."""
    ids = [m.packet_id for m in _inflight(port, 2, 4)]
    assert len(set(ids)) == 4 and 0 not in ids


def test_mqtt_4_3_3_2(port: int) -> None:
    """[MQTT-4.3.3-2] A new QoS 2 delivery has QoS 2 and DUP 0."""
    assert all((m.qos, m.dup) == (2, False) for m in _inflight(port, 2, 2))


def test_mqtt_4_3_3_3(port: int) -> None:
    """[MQTT-4.3.3-3] Unacknowledged until PUBREC: resent (DUP) on resume."""
    topic = uid("o/")
    c, cid = persistent(port, topic, 2)
    connected(port).publish(topic, b"x", 2)
    first = c.messages(1, ack=False)[0]
    c.close()
    again = resume(port, cid).expect(Publish)
    assert (again.packet_id, again.dup, again.payload) == (first.packet_id, True, b"x")


def test_mqtt_4_3_3_4(port: int) -> None:
    """[MQTT-4.3.3-4] PUBREC below 0x80 is followed by PUBREL with the same id."""
    topic = uid("o/")
    c = connected(port)
    c.subscribe(topic, 2)
    connected(port).publish(topic, b"x", 2)
    m = c.messages(1, ack=False)[0]
    c.send(mqtt.Pubrec(m.packet_id))
    assert c.expect(Pubrel) == Pubrel(m.packet_id)


def _after_pubrec(port: int) -> tuple[Peer, str, int]:
    topic = uid("o/")
    c, cid = persistent(port, topic, 2)
    connected(port).publish(topic, b"x", 2)
    m = c.messages(1, ack=False)[0]
    c.send(mqtt.Pubrec(m.packet_id))
    c.expect(Pubrel)
    c.close()
    return resume(port, cid), cid, m.packet_id


def test_mqtt_4_3_3_5(port: int) -> None:
    """[MQTT-4.3.3-5] The PUBREL is unacknowledged until PUBCOMP: resent on resume."""
    c, _, pid = _after_pubrec(port)
    assert c.recv() == Pubrel(pid)


def test_mqtt_4_3_3_6(port: int) -> None:
    """[MQTT-4.3.3-6] Once PUBREL is sent, the PUBLISH is not sent again."""
    c, _, pid = _after_pubrec(port)
    c.expect(Pubrel)
    c.send(mqtt.Pubcomp(pid))
    assert c.quiet()


def test_mqtt_4_3_3_7(port: int) -> None:
    """[MQTT-4.3.3-7] A QoS 2 delivery already sent is not expired: resent after its
    Message Expiry Interval has passed."""
    topic = uid("o/")
    c, cid = persistent(port, topic, 2)
    connected(port).publish(topic, b"x", 2, message_expiry_interval=1)
    c.messages(1, ack=False)
    c.close()
    time.sleep(2.1)
    assert resume(port, cid).expect(Publish).payload == b"x"


def test_mqtt_4_3_3_8(port: int) -> None:
    """[MQTT-4.3.3-8] The Server's PUBREC carries the PUBLISH's id."""
    c = connected(port)
    c.send(mqtt.Publish(uid("o/"), b"x", 2, packet_id=4321))
    assert c.expect(Pubrec).packet_id == 4321


def test_mqtt_4_3_3_9(port: int) -> None:
    """[MQTT-4.3.3-9] After a PUBREC >= 0x80, the same id is a new message."""
    topic = uid("o/")
    w = connected(port)
    w.subscribe(topic, 2)
    c = connected(port)
    assert c.publish("$no/" + uid(), b"x", 2, pid=8).reason_code >= 0x80
    assert c.publish(topic, b"new", 2, pid=8).reason_code == 0
    assert w.messages(1)[0].payload == b"new"


def test_mqtt_4_3_3_10(port: int) -> None:
    """[MQTT-4.3.3-10] Before PUBREL a repeated PUBLISH gets PUBREC, and one delivery."""
    topic = uid("o/")
    w = connected(port)
    w.subscribe(topic, 2)
    c = connected(port)
    c.send(mqtt.Publish(topic, b"once", 2, packet_id=5))
    c.expect(Pubrec)
    c.send(mqtt.Publish(topic, b"once", 2, dup=True, packet_id=5))
    assert c.expect(Pubrec).packet_id == 5
    c.send(mqtt.Pubrel(5))
    c.expect(Pubcomp)
    assert len(w.messages(1)) == 1 and w.quiet(0.6)


def test_mqtt_4_3_3_11(port: int) -> None:
    """[MQTT-4.3.3-11] PUBREL is answered with PUBCOMP of the same id."""
    c = connected(port)
    c.send(mqtt.Publish(uid("o/"), b"x", 2, packet_id=77))
    c.expect(Pubrec)
    c.send(mqtt.Pubrel(77))
    assert c.expect(Pubcomp) == Pubcomp(77)


def test_mqtt_4_3_3_12(port: int) -> None:
    """[MQTT-4.3.3-12] After PUBCOMP, the same id is a new message."""
    topic = uid("o/")
    w = connected(port)
    w.subscribe(topic, 2)
    c = connected(port)
    c.publish(topic, b"1", 2, pid=9)
    c.publish(topic, b"2", 2, pid=9)
    assert [m.payload for m in w.messages(2)] == [b"1", b"2"]


def test_mqtt_4_3_3_13(port: int) -> None:
    """[MQTT-4.3.3-13] The QoS 2 exchange completes even past the Message Expiry."""
    c = connected(port)
    c.send(mqtt.Publish(uid("o/"), b"x", 2, packet_id=12,
                        properties={"message_expiry_interval": 1}))
    c.expect(Pubrec)
    time.sleep(1.5)
    c.send(mqtt.Pubrel(12))
    assert c.expect(Pubcomp) == Pubcomp(12)


def test_mqtt_4_4_0_1(port: int) -> None:
    """[MQTT-4.4.0-1] Unacknowledged messages are resent on resume with their ids, and
    not during the connection."""
    topic = uid("o/")
    c, cid = persistent(port, topic)
    connected(port).publish(topic, b"x", 1)
    m = c.messages(1, ack=False)[0]
    assert c.quiet(1.0)
    c.close()
    again = resume(port, cid).expect(Publish)
    assert again.packet_id == m.packet_id


def test_mqtt_4_4_0_2(port: int) -> None:
    """[MQTT-4.4.0-2] A delivery answered with PUBACK 0x80 is done: not resent."""
    topic = uid("o/")
    c, cid = persistent(port, topic)
    connected(port).publish(topic, b"x", 1)
    m = c.messages(1, ack=False)[0]
    c.send(mqtt.Puback(m.packet_id, 0x80))
    c.send(mqtt.Pingreq())
    c.expect(Pingresp)
    c.close()
    assert resume(port, cid).quiet()


def test_mqtt_4_5_0_1(port: int) -> None:
    """[MQTT-4.5.0-1] A message is added to every matching Session, offline ones too."""
    topic = uid("o/")
    a, acid = persistent(port, topic)
    a.disconnect()
    b = connected(port)
    b.subscribe(topic, 1)
    connected(port).publish(topic, b"x", 1)
    assert b.messages(1)[0].payload == b"x"
    assert resume(port, acid).messages(1)[0].payload == b"x"


def test_mqtt_4_6_0_5(port: int) -> None:
    """[MQTT-4.6.0-5] Messages of one topic and QoS arrive in the order published."""
    topic = uid("o/")
    c = connected(port)
    c.subscribe(topic, 1)
    p = connected(port)
    for i in range(20):
        p.send(mqtt.Publish(topic, b"%d" % i, 1, packet_id=i + 1))
    assert [m.payload for m in c.messages(20)] == [b"%d" % i for i in range(20)]


def test_mqtt_4_6_0_6(port: int) -> None:
    """[MQTT-4.6.0-6] Non-shared subscriptions are ordered by default (QoS 0 too)."""
    topic = uid("o/")
    c = connected(port)
    c.subscribe(topic, 0)
    p = connected(port)
    for i in range(20):
        p.publish(topic, b"%d" % i)
    assert [m.payload for m in c.messages(20)] == [b"%d" % i for i in range(20)]


def test_mqtt_4_7_0_1(port: int) -> None:
    """[MQTT-4.7.0-1] A Topic Name with '#': refused, closed."""
    c = connected(port)
    c.send_raw(publish_bytes("o/#", b"x"))
    c.refused()


def test_mqtt_4_7_1_1(port: int) -> None:
    """[MQTT-4.7.1-1] '#' not last, or glued to a level: refused."""
    filter_refused(port, "o/#/x")
    filter_refused(port, "o/a#")


def test_mqtt_4_7_1_2(port: int) -> None:
    """[MQTT-4.7.1-2] '+' sharing a level: refused."""
    filter_refused(port, "o/a+/x")


def test_mqtt_4_7_2_1(port: int) -> None:
    """[MQTT-4.7.2-1] '#' and '+/broker/#' do not match the $SYS/broker/... topics the
    Server publishes every second, which a '$SYS/#' subscriber gets meanwhile."""
    c = connected(port)
    c.send(mqtt.Subscribe(1, [("#", mqtt.SubscriptionOptions(0)),
                              ("+/broker/#", mqtt.SubscriptionOptions(0))]))
    c.expect(Suback)
    sys = connected(port)
    sys.subscribe("$SYS/#", 0)
    seen = [m.topic for m in sys.publishes_within(2.5)]
    assert any(t.startswith("$SYS/broker/") for t in seen), seen
    assert [m.topic for m in c.publishes_within(0.1) if m.topic.startswith("$")] == []


def test_mqtt_4_7_3_1(port: int) -> None:
    """[MQTT-4.7.3-1] An empty Topic Filter is refused; so is an empty Topic Name."""
    filter_refused(port, "")
    c = connected(port)
    c.send_raw(publish_bytes("", b"x"))
    c.refused()


def test_mqtt_4_7_3_2(port: int) -> None:
    """[MQTT-4.7.3-2] U+0000 in a Topic Name: refused, closed."""
    c = connected(port)
    c.send_raw(publish_bytes(b"o/\x00x", b"x"))
    c.refused()


def test_mqtt_4_7_3_4(port: int) -> None:
    """[MQTT-4.7.3-4] No normalization: NFC and NFD forms are different topics."""
    base = uid("o/")
    c = connected(port)
    c.subscribe(base + "/caf\u00e9", 0)
    p = connected(port)
    p.publish(base + "/cafe\u0301", b"nfd")
    p.publish(base + "/caf\u00e9", b"nfc")
    assert [m.payload for m in c.messages(1)] == [b"nfc"] and c.quiet(0.4)


def test_mqtt_4_8_2_1(port: int) -> None:
    """[MQTT-4.8.2-1] "$share//x" (empty ShareName) is refused."""
    filter_refused(port, "$share//x")


def test_mqtt_4_8_2_2(port: int) -> None:
    """[MQTT-4.8.2-2] A ShareName with '+' or without a filter after it is refused."""
    filter_refused(port, "$share/a+b/x")
    filter_refused(port, "$share/g")


def test_mqtt_4_8_2_3(port: int) -> None:
    """[MQTT-4.8.2-3] A shared subscription's granted QoS 0 caps the delivery."""
    topic = uid("o/")
    c = connected(port)
    c.subscribe(f"$share/{uid('g')}/{topic}", 0)
    connected(port).publish(topic, b"x", 2)
    assert c.messages(1)[0].qos == 0


def test_mqtt_4_8_2_4(port: int) -> None:
    """[MQTT-4.8.2-4] A QoS 2 message in flight to a member whose link breaks is completed
    to that member when it comes back."""
    topic, group = uid("o/"), uid("g")
    c, cid = persistent(port, f"$share/{group}/{topic}", 2)
    connected(port).publish(topic, b"x", 2)
    m = c.messages(1, ack=False)[0]
    c.close()
    again = resume(port, cid).expect(Publish)
    assert (again.payload, again.packet_id) == (b"x", m.packet_id)


def test_mqtt_4_8_2_5(port: int) -> None:
    """[MQTT-4.8.2-5] If that member's Session ends first, no other member gets it."""
    topic, group = uid("o/"), uid("g")
    a = connected(port)  # session expiry 0: ends with the connection
    a.subscribe(f"$share/{group}/{topic}", 2)
    connected(port).publish(topic, b"x", 2)
    a.messages(1, ack=False)
    b = connected(port)
    b.subscribe(f"$share/{group}/{topic}", 2)
    a.close()
    assert b.quiet(1.5)
    connected(port).publish(topic, b"next", 2)  # b is a member: it gets what comes next
    assert [m.payload for m in b.messages(1)] == [b"next"]


def test_mqtt_4_8_2_6(port: int) -> None:
    """[MQTT-4.8.2-6] A member's PUBACK 0x80 discards the message: no other member gets
    it."""
    topic, group = uid("o/"), uid("g")
    a = connected(port)
    a.subscribe(f"$share/{group}/{topic}", 1)
    connected(port).publish(topic, b"x", 1)
    m = a.messages(1, ack=False)[0]
    b = connected(port)
    b.subscribe(f"$share/{group}/{topic}", 1)
    a.send(mqtt.Puback(m.packet_id, 0x80))
    a.close()
    assert b.quiet(1.5)
    connected(port).publish(topic, b"next", 1)  # b is a member: it gets what comes next
    assert [m.payload for m in b.messages(1)] == [b"next"]


def test_mqtt_4_9_0_1(port: int) -> None:
    """[MQTT-4.9.0-1] Receive Maximum 1: the send quota is 1, not 0 and not more."""
    topic = uid("o/")
    c = connected(port, receive_maximum=1)
    c.subscribe(topic, 1)
    p = connected(port)
    p.publish(topic, b"1", 1)
    p.publish(topic, b"2", 1)
    assert c.messages(1, ack=False)[0].payload == b"1" and c.quiet(0.6)


def test_mqtt_4_9_0_2(port: int) -> None:
    """[MQTT-4.9.0-2] Quota 0: no QoS 1/2 PUBLISH until a PUBACK frees one."""
    topic = uid("o/")
    c = connected(port, receive_maximum=1)
    c.subscribe(topic, 2)
    p = connected(port)
    p.publish(topic, b"1", 2)
    p.publish(topic, b"2", 1)
    first = c.messages(1, ack=False)[0]
    assert c.quiet(0.6)
    c.ack(first)
    assert c.messages(1)[0].payload == b"2"


def test_mqtt_4_9_0_3(port: int) -> None:
    """[MQTT-4.9.0-3] Quota 0: QoS 0 messages and other packets still flow."""
    topic = uid("o/")
    c = connected(port, receive_maximum=1)
    c.subscribe(topic, 1)
    p = connected(port)
    p.publish(topic, b"held", 1)
    c.messages(1, ack=False)
    p.publish(topic, b"q0", 0)
    assert c.expect(Publish).payload == b"q0"
    c.send(mqtt.Pingreq())
    c.expect(Pingresp)


def test_mqtt_4_12_0_1(port: int) -> None:
    """[MQTT-4.12.0-1] An unsupported Authentication Method: (0x8C) and closed."""
    c = Peer(port)
    c.send(mqtt.Connect(uid(), 5, properties={"authentication_method": "NOPE-1"}))
    got = c.refused()
    assert [p.reason_code for p in got if isinstance(p, Connack)] in ([0x8C], [0x87], [])


def test_mqtt_4_12_0_6(auth_broker: Server) -> None:
    """[MQTT-4.12.0-6] On a Server that offers enhanced authentication (SCRAM-SHA-256), a
    CONNECT without an Authentication Method (a user name and password): none in the
    CONNACK, and no AUTH, before the CONNACK or after it."""
    c = Peer(auth_broker.port)
    c.send(mqtt.Connect(uid(), 5, username=USER, password=PASSWORD.encode()))
    ack = c.recv()
    assert isinstance(ack, Connack) and ack.reason_code == 0, ack
    assert "authentication_method" not in ack.properties
    c.ping()
    assert [type(p) for p in c.log] == [Connack, Pingresp]


def test_mqtt_4_12_0_7(port: int) -> None:
    """[MQTT-4.12.0-7] AUTH without an Authentication Method in CONNECT: Protocol Error."""
    c = connected(port)
    c.send(mqtt.Auth(0x19, {"authentication_method": "X"}))
    c.refused()


def test_mqtt_4_13_1_1(port: int) -> None:
    """[MQTT-4.13.1-1] A Malformed Packet (packet type 0) closes the connection."""
    c = connected(port)
    c.send_raw(b"\x00\x00")
    c.refused()


def test_mqtt_4_13_2_1(port: int) -> None:
    """[MQTT-4.13.2-1] After a DISCONNECT >= 0x80 the connection is closed."""
    c = connected(port)
    c.send_raw(b"\x20\x02\x00\x00")  # CONNACK from a client: Protocol Error
    got = c.refused()  # closed, and the DISCONNECT's code is 0x80 or more
    assert [type(p) for p in got] == [Disconnect]
