"""MQTT 5.0 sections 3.1 (CONNECT) and 3.2 (CONNACK), one test per normative statement."""

from __future__ import annotations

import time

from gateway import mqtt
from tests.conformance.conftest import PASSWORD, USER
from tests.conformance.reader import Connack, Pingresp
from tests.conformance.wire import (
    Peer,
    connect_bytes,
    connected,
    publish_bytes,
    s,
    uid,
)

CONNACK_CODES = {0x00, 0x80, 0x81, 0x82, 0x83, 0x84, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8A, 0x8C,
                 0x90, 0x95, 0x97, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9F}
DISCONNECT_CODES = {0x00, 0x04, 0x80, 0x81, 0x82, 0x83, 0x87, 0x89, 0x8B, 0x8D, 0x8E, 0x8F,
                    0x90, 0x93, 0x94, 0x95, 0x96, 0x97, 0x98, 0x99, 0x9A, 0x9B, 0x9C, 0x9D,
                    0x9E, 0x9F, 0xA0, 0xA1, 0xA2}
WILL = b"\x00" + s("will/t") + s(b"bye")  # will properties, topic, payload


def refused_connect(port: int, data: bytes) -> list:
    """Send `data` as the first bytes of a connection; the server must close it."""
    peer = Peer(port)
    peer.send_raw(data)
    return peer.refused()


def watcher(port: int, topic: str, **opts) -> Peer:
    w = connected(port)
    w.subscribe(topic, 1, **opts)
    return w


def test_mqtt_3_1_0_1(port: int) -> None:
    """[MQTT-3.1.0-1] A connection that starts with PUBLISH, not CONNECT, is closed."""
    refused_connect(port, publish_bytes("a/b", b"x"))


def test_mqtt_3_1_0_2(port: int) -> None:
    """[MQTT-3.1.0-2] A second CONNECT is a Protocol Error: the connection is closed."""
    peer = connected(port)
    peer.send_raw(connect_bytes(uid()))
    got = peer.refused()
    assert all(not isinstance(p, Connack) for p in got)


def test_mqtt_3_1_2_1(port: int) -> None:
    """[MQTT-3.1.2-1] Protocol name other than "MQTT": (CONNACK 0x84 and) close."""
    refused_connect(port, connect_bytes(uid(), name=b"MQTX"))


def test_mqtt_3_1_2_2(port: int) -> None:
    """[MQTT-3.1.2-2] Protocol version 6: CONNACK 0x84 (may) and close (must)."""
    c = Peer(port, decode=False)  # the answer may be in either version: its bytes
    c.send_raw(connect_bytes(uid(), level=6))
    c.refused()
    # 0x84 as 5.0 says, or 0x01 in the 3.1.1 form a client of an unknown version reads
    assert bytes(c.raw_in) in (b"", b"\x20\x03\x00\x84\x00", b"\x20\x02\x00\x01"), c.raw_in


def test_mqtt_3_1_2_3(port: int) -> None:
    """[MQTT-3.1.2-3] The reserved CONNECT flag set: malformed, closed."""
    refused_connect(port, connect_bytes(uid(), flags=0x03))


def test_mqtt_3_1_2_4(port: int) -> None:
    """[MQTT-3.1.2-4] Clean Start 1 discards the existing Session (its subscription)."""
    cid, topic = uid(), uid("t/")
    c = connected(port, cid, clean=True, session_expiry_interval=60)
    c.subscribe(topic, 1)
    c.disconnect()
    c = Peer(port)
    assert not c.connect(cid, clean=True, session_expiry_interval=60).session_present
    connected(port).publish(topic, b"x", 1)
    assert c.quiet()


def test_mqtt_3_1_2_5(port: int) -> None:
    """[MQTT-3.1.2-5] Clean Start 0 resumes the Session: its subscription still delivers."""
    cid, topic = uid(), uid("t/")
    c = connected(port, cid, session_expiry_interval=60)
    c.subscribe(topic, 1)
    c.disconnect()
    c = Peer(port)
    assert c.connect(cid, clean=False, session_expiry_interval=60).session_present
    connected(port).publish(topic, b"x", 1)
    assert c.messages(1)[0].payload == b"x"


def test_mqtt_3_1_2_6(port: int) -> None:
    """[MQTT-3.1.2-6] Clean Start 0 without a Session creates one (kept after close)."""
    cid = uid()
    c = Peer(port)
    assert not c.connect(cid, clean=False, session_expiry_interval=60).session_present
    c.disconnect()
    assert Peer(port).connect(cid, clean=False, session_expiry_interval=60).session_present


def test_mqtt_3_1_2_7(port: int) -> None:
    """[MQTT-3.1.2-7] A Will is stored with the Session: published when the link fails."""
    topic = uid("w/")
    w = watcher(port, topic)
    c = connected(port, will=mqtt.Will(topic, b"gone"))
    c.close()
    assert w.messages(1)[0].payload == b"gone"


def test_mqtt_3_1_2_8(port: int) -> None:
    """[MQTT-3.1.2-8] No Will after DISCONNECT 0x00; a Will after a broken connection."""
    topic = uid("w/")
    w = watcher(port, topic)
    connected(port, will=mqtt.Will(topic, b"a")).disconnect(0)
    assert w.quiet()
    connected(port, will=mqtt.Will(topic, b"b")).close()
    assert w.messages(1)[0].payload == b"b"


def test_mqtt_3_1_2_9(port: int) -> None:
    """[MQTT-3.1.2-9] Will Flag 1 without will fields: malformed, closed."""
    refused_connect(port, connect_bytes(uid(), flags=0x06))


def test_mqtt_3_1_2_10(port: int) -> None:
    """[MQTT-3.1.2-10] After DISCONNECT 0x00 the Will is gone from the Session: a later
    broken connection of the resumed Session publishes nothing."""
    cid, topic = uid(), uid("w/")
    w = watcher(port, topic)
    connected(port, cid, will=mqtt.Will(topic, b"a"), session_expiry_interval=60).disconnect()
    c = Peer(port)
    c.connect(cid, clean=False, session_expiry_interval=60)
    c.close()
    assert w.quiet(1.0)


def test_mqtt_3_1_2_11(port: int) -> None:
    """[MQTT-3.1.2-11] Will QoS 1 with Will Flag 0: malformed, closed."""
    refused_connect(port, connect_bytes(uid(), flags=0x0A))


def test_mqtt_3_1_2_12(port: int) -> None:
    """[MQTT-3.1.2-12] Will QoS 3: malformed, closed."""
    refused_connect(port, connect_bytes(uid(), flags=0x1E, payload_tail=WILL))


def test_mqtt_3_1_2_13(port: int) -> None:
    """[MQTT-3.1.2-13] Will Retain 1 with Will Flag 0: malformed, closed."""
    refused_connect(port, connect_bytes(uid(), flags=0x22))


def test_mqtt_3_1_2_14(port: int) -> None:
    """[MQTT-3.1.2-14] Will Retain 0: published non-retained, and not kept as retained."""
    topic = uid("w/")
    w = watcher(port, topic)
    connected(port, will=mqtt.Will(topic, b"nr", retain=False)).close()
    assert not w.messages(1)[0].retain
    assert watcher(port, topic).quiet()


def test_mqtt_3_1_2_15(port: int) -> None:
    """[MQTT-3.1.2-15] Will Retain 1: published as a retained message."""
    topic = uid("w/")
    w = watcher(port, topic)
    connected(port, will=mqtt.Will(topic, b"r", retain=True)).close()
    w.messages(1)
    late = watcher(port, topic)
    m = late.messages(1)[0]
    assert (m.payload, m.retain) == (b"r", True)


def test_mqtt_3_1_2_16(port: int) -> None:
    """[MQTT-3.1.2-16] User Name Flag 0 but a user name present: malformed, closed."""
    refused_connect(port, connect_bytes(uid(), payload_tail=s("bob")))


def test_mqtt_3_1_2_17(port: int) -> None:
    """[MQTT-3.1.2-17] User Name Flag 1 without a user name: malformed, closed."""
    refused_connect(port, connect_bytes(uid(), flags=0x82))


def test_mqtt_3_1_2_18(port: int) -> None:
    """[MQTT-3.1.2-18] Password Flag 0 but a password present: malformed, closed."""
    refused_connect(port, connect_bytes(uid(), flags=0x82, payload_tail=s("bob") + s("pw")))


def test_mqtt_3_1_2_19(port: int) -> None:
    """[MQTT-3.1.2-19] Password Flag 1 without a password: malformed, closed."""
    refused_connect(port, connect_bytes(uid(), flags=0xC2, payload_tail=s("bob")))


def test_mqtt_3_1_2_22(port: int) -> None:
    """[MQTT-3.1.2-22] Keep Alive 1 s and silence: closed after 1.5 s (not before 1 s)."""
    c = connected(port, keepalive=1)
    t0 = time.monotonic()
    assert c.closed(4.0)
    assert 1.0 <= time.monotonic() - t0 <= 3.5


def test_mqtt_3_1_2_23(port: int) -> None:
    """[MQTT-3.1.2-23] Session Expiry > 0: the Session (and messages for it) outlive the
    connection."""
    cid, topic = uid(), uid("t/")
    c = connected(port, cid, session_expiry_interval=60)
    c.subscribe(topic, 1)
    c.disconnect()
    connected(port).publish(topic, b"kept", 1)
    c = Peer(port)
    assert c.connect(cid, clean=False, session_expiry_interval=60).session_present
    assert c.messages(1)[0].payload == b"kept"


def test_mqtt_3_1_2_24(port: int) -> None:
    """[MQTT-3.1.2-24] Nothing larger than the client's Maximum Packet Size is sent."""
    topic = uid("t/")
    c = connected(port, maximum_packet_size=200)
    c.subscribe(topic, 0)
    p = connected(port)
    p.publish(topic, b"x" * 500)
    p.publish(topic, b"small")
    assert c.messages(1)[0].payload == b"small"  # the big one, published first, is not
    c.ping()
    assert [p.size for p in c.log if p.size > 200] == []


def test_mqtt_3_1_2_25(port: int) -> None:
    """[MQTT-3.1.2-25] A QoS 1 message too large for the client is dropped as if sent:
    not resent on reconnect, and the next message flows."""
    cid, topic = uid(), uid("t/")
    c = connected(port, cid, session_expiry_interval=60, maximum_packet_size=200)
    c.subscribe(topic, 1)
    p = connected(port)
    p.publish(topic, b"x" * 500, 1)
    p.publish(topic, b"next", 1)
    assert c.messages(1)[0].payload == b"next"
    c.close()
    c = Peer(port)
    c.connect(cid, clean=False, session_expiry_interval=60, maximum_packet_size=200)
    assert c.quiet()


def test_mqtt_3_1_2_26(port: int) -> None:
    """[MQTT-3.1.2-26] The Server uses Topic Aliases up to the client's maximum (2), and
    none above it: five topics, aliases 1 and 2 only."""
    base = uid("ta/")
    c = connected(port, topic_alias_maximum=2)
    c.subscribe(base + "/+", 0)
    p = connected(port)
    for i in range(5):
        for _ in range(2):
            p.publish(f"{base}/{i}", b"x")
    aliases = {m.properties.get("topic_alias") for m in c.messages(10)}
    assert aliases == {1, 2, None}


def test_mqtt_3_1_2_27(port: int) -> None:
    """[MQTT-3.1.2-27] No Topic Alias Maximum from the client: no aliases at all."""
    topic = uid("ta/")
    c = connected(port)
    c.subscribe(topic, 0)
    p = connected(port)
    for _ in range(3):
        p.publish(topic, b"x")
    assert all("topic_alias" not in m.properties for m in c.messages(3))


def test_mqtt_3_1_2_29(port: int) -> None:
    """[MQTT-3.1.2-29] Request Problem Information 0: no Reason String on a refusing PUBACK
    or PUBREC, which carry one otherwise."""
    topic = "$x/" + uid()
    plain = connected(port)
    assert "reason_string" in plain.publish(topic, b"x", 1).properties
    assert "reason_string" in plain.publish(topic, b"x", 2, pid=2).properties
    c = connected(port, request_problem_information=0)
    ack, rec = c.publish(topic, b"x", 1), c.publish(topic, b"x", 2, pid=2)
    assert (ack.reason_code >= 0x80, ack.properties) == (True, {})
    assert (rec.reason_code >= 0x80, rec.properties) == (True, {})


def test_mqtt_3_1_3_2(port: int) -> None:
    """[MQTT-3.1.3-2] The ClientID identifies the Session: another id does not get it."""
    cid = uid()
    connected(port, cid, session_expiry_interval=60).disconnect()
    assert not Peer(port).connect(uid(), clean=False).session_present
    assert Peer(port).connect(cid, clean=False, session_expiry_interval=60).session_present


def test_mqtt_3_1_3_3(port: int) -> None:
    """[MQTT-3.1.3-3] A CONNECT whose payload has no ClientID: malformed, closed."""
    body = s(b"MQTT") + bytes([5, 0x02]) + b"\x00\x3c\x00"
    refused_connect(port, bytes([0x10, len(body)]) + body)


def test_mqtt_3_1_3_4(port: int) -> None:
    """[MQTT-3.1.3-4] A ClientID that is not UTF-8: malformed, closed."""
    refused_connect(port, connect_bytes(b"ab\xff\xfe"))


def test_mqtt_3_1_3_5(port: int) -> None:
    """[MQTT-3.1.3-5] A 23-character alphanumeric ClientID is allowed."""
    cid = ("Az09" + uid())[:23].ljust(23, "x")
    assert Peer(port).connect(cid).reason_code == 0


def test_mqtt_3_1_3_6(port: int) -> None:
    """[MQTT-3.1.3-6] A zero-length ClientID is given a unique one."""
    a = Peer(port).connect("").properties["assigned_client_identifier"]
    b = Peer(port).connect("").properties["assigned_client_identifier"]
    assert a and b and a != b


def test_mqtt_3_1_3_7(port: int) -> None:
    """[MQTT-3.1.3-7] The CONNECT is processed under the assigned id, which CONNACK
    returns: reconnecting with it resumes the Session."""
    c = Peer(port)
    cid = c.connect("", session_expiry_interval=60).properties["assigned_client_identifier"]
    c.disconnect()
    assert Peer(port).connect(cid, clean=False, session_expiry_interval=60).session_present


def test_mqtt_3_1_3_9(port: int) -> None:
    """[MQTT-3.1.3-9] Reconnecting before the Will Delay Interval: no Will."""
    cid, topic = uid(), uid("w/")
    w = watcher(port, topic)
    will = mqtt.Will(topic, b"late", properties={"will_delay_interval": 2})
    connected(port, cid, will=will, session_expiry_interval=60).close()
    time.sleep(0.3)
    back = connected(port, cid, clean=False, session_expiry_interval=60)
    assert w.quiet(2.5)
    back.disconnect()


def test_mqtt_3_1_3_10(port: int) -> None:
    """[MQTT-3.1.3-10] The Will's User Properties keep their order."""
    topic = uid("w/")
    w = watcher(port, topic)
    ups = [("k", "2"), ("a", "1"), ("k", "1"), ("z", "0")]
    connected(port, will=mqtt.Will(topic, b"x", properties={"user_property": ups})).close()
    assert w.messages(1)[0].properties["user_property"] == ups


def test_mqtt_3_1_3_11(port: int) -> None:
    """[MQTT-3.1.3-11] A Will Topic that is not UTF-8: malformed, closed."""
    refused_connect(port, connect_bytes(uid(), flags=0x06,
                                        payload_tail=b"\x00" + s(b"w/\xc3") + s(b"x")))


def test_mqtt_3_1_3_12(port: int) -> None:
    """[MQTT-3.1.3-12] A User Name that is not UTF-8: malformed, closed."""
    refused_connect(port, connect_bytes(uid(), flags=0x82, payload_tail=s(b"\xed\xa0\x80")))


def test_mqtt_3_1_4_1(port: int) -> None:
    """[MQTT-3.1.4-1] A CONNECT whose property length overruns the packet: closed."""
    refused_connect(port, connect_bytes(uid(), cprops=b"\x20\x11"))


def test_mqtt_3_1_4_2(auth_broker) -> None:
    """[MQTT-3.1.4-2] Failed authentication: CONNACK 0x86 and the connection closed."""
    c = Peer(auth_broker.port)
    c.send(mqtt.Connect(uid(), 5, username=USER, password=b"wrong"))
    got = c.refused()
    assert [p.reason_code for p in got if isinstance(p, Connack)] in ([0x86], [0x87], [])


def test_mqtt_3_1_4_3(port: int) -> None:
    """[MQTT-3.1.4-3] A second connection with the same ClientID: the first gets
    DISCONNECT 0x8E and is closed."""
    cid = uid()
    first = connected(port, cid)
    connected(port, cid)
    first.refused_with(0x8E)


def test_mqtt_3_1_4_4(port: int) -> None:
    """[MQTT-3.1.4-4] Clean Start is processed: messages queued for the old Session are
    gone with it."""
    cid, topic = uid(), uid("t/")
    c = connected(port, cid, session_expiry_interval=60)
    c.subscribe(topic, 1)
    c.disconnect()
    connected(port).publish(topic, b"old", 1)
    c = Peer(port)
    assert not c.connect(cid, clean=True).session_present
    assert c.quiet()


def test_mqtt_3_1_4_5(port: int) -> None:
    """[MQTT-3.1.4-5] An acceptable CONNECT gets CONNACK 0x00."""
    assert Peer(port).connect(uid()).reason_code == 0


def test_mqtt_3_1_4_6(auth_broker) -> None:
    """[MQTT-3.1.4-6] Data after a rejected CONNECT is not processed: a retained PUBLISH
    sent right behind it is not stored."""
    topic = uid("t/")
    c = Peer(auth_broker.port)
    c.send_raw(mqtt.encode(mqtt.Connect(uid(), 5, username=USER, password=b"no"), 5)
               + publish_bytes(topic, b"sneak", 0, b0=0x31))
    c.refused()
    w = Peer(auth_broker.port)
    w.send(mqtt.Connect(uid(), 5, username=USER, password=PASSWORD.encode()))
    assert w.expect(Connack).reason_code == 0
    w.subscribe(topic, 0)
    assert w.quiet()


def test_mqtt_3_2_0_1(port: int) -> None:
    """[MQTT-3.2.0-1] CONNACK comes first, even with a PINGREQ sent right behind CONNECT."""
    c = Peer(port)
    c.send_raw(connect_bytes(uid()) + b"\xc0\x00")
    assert isinstance(c.recv(), Connack)
    assert isinstance(c.recv(), Pingresp)


def test_mqtt_3_2_0_2(port: int) -> None:
    """[MQTT-3.2.0-2] Only one CONNACK per connection (a second CONNECT gets none)."""
    c = connected(port)
    c.send_raw(connect_bytes(uid()))
    assert c.closed()
    assert not any(isinstance(p, Connack) for p in c.pending)


def test_mqtt_3_2_2_1(port: int) -> None:
    """[MQTT-3.2.2-1] CONNACK flags bits 7-1 are 0."""
    c = Peer(port)
    c.connect(uid())
    assert c.raw_in[0] == 0x20 and c.raw_in[2] & 0xFE == 0


def test_mqtt_3_2_2_2(port: int) -> None:
    """[MQTT-3.2.2-2] Clean Start 1 with a stored Session: Session Present 0, code 0."""
    cid = uid()
    connected(port, cid, session_expiry_interval=60).disconnect()
    ack = Peer(port).connect(cid, clean=True)
    assert (ack.session_present, ack.reason_code) == (False, 0)


def test_mqtt_3_2_2_3(port: int) -> None:
    """[MQTT-3.2.2-3] Clean Start 0: Session Present 1 with a Session, 0 without."""
    cid = uid()
    assert not Peer(port).connect(cid, clean=False, session_expiry_interval=60).session_present
    assert Peer(port).connect(cid, clean=False, session_expiry_interval=60).session_present


def test_mqtt_3_2_2_6(auth_broker) -> None:
    """[MQTT-3.2.2-6] A refusing CONNACK has Session Present 0, even with a Session."""
    cid = uid()
    c = Peer(auth_broker.port)
    c.send(mqtt.Connect(cid, 5, clean_start=False, username=USER, password=PASSWORD.encode(),
                        properties={"session_expiry_interval": 60}))
    assert c.expect(Connack).reason_code == 0
    c.disconnect()
    c = Peer(auth_broker.port)
    c.send(mqtt.Connect(cid, 5, clean_start=False, username=USER, password=b"bad"))
    ack = c.expect(Connack)
    assert ack.reason_code >= 0x80 and not ack.session_present


def test_mqtt_3_2_2_7(port: int) -> None:
    """[MQTT-3.2.2-7] After CONNACK >= 0x80 (unsupported version) the link is closed."""
    c = Peer(port, decode=False)
    c.send_raw(connect_bytes(uid(), level=7))
    c.refused()
    assert c.raw_in[:1] == b"\x20"  # a CONNACK (0x84, or 3.1.1's 0x01), then closed


def test_mqtt_3_2_2_8(port: int, auth_broker) -> None:
    """[MQTT-3.2.2-8] CONNACK codes are Connect Reason Codes (success and refusals)."""
    codes = [Peer(port).connect(uid()).reason_code]
    c = Peer(port)
    c.send(mqtt.Connect(uid(), 5, properties={"authentication_method": "X-NONE"}))
    [refusal] = [p for p in c.refused() if isinstance(p, Connack)]
    codes.append(refusal.reason_code)
    c = Peer(auth_broker.port)
    c.send(mqtt.Connect(uid(), 5, username=USER, password=b"bad"))
    codes.append(c.expect(Connack).reason_code)
    assert set(codes) <= CONNACK_CODES, codes


def test_mqtt_3_2_2_15(port: int) -> None:
    """[MQTT-3.2.2-15] A packet above the Server's Maximum Packet Size: (0x95 and) close."""
    from tests.conformance.conftest import MAX_PACKET
    c = connected(port)
    c.send_raw(publish_bytes("big/" + uid(), b"x" * (MAX_PACKET + 10)))
    c.refused_with(0x95)


def test_mqtt_3_2_2_16(port: int) -> None:
    """[MQTT-3.2.2-16] The Assigned Client Identifier is new: no stored Session has it."""
    c = Peer(port)
    ack = c.connect("", clean=False, session_expiry_interval=60)
    assert ack.properties.get("assigned_client_identifier") and not ack.session_present


def test_mqtt_3_2_2_17(port: int) -> None:
    """[MQTT-3.2.2-17] A Topic Alias above the Server's maximum: 0x94 and closed."""
    c = Peer(port)
    top = c.connect(uid()).properties.get("topic_alias_maximum", 0)
    c.send(mqtt.Publish("t/x", b"x", properties={"topic_alias": top + 1}))
    c.refused_with(0x94)


def test_mqtt_3_2_2_19(port: int) -> None:
    """[MQTT-3.2.2-19] A refusing CONNACK drops its Reason String rather than exceed the
    client's Maximum Packet Size (16 bytes); without the limit it carries one."""
    sizes = []
    for limit in ({}, {"maximum_packet_size": 16}):
        c = Peer(port)
        c.send(mqtt.Connect(uid(), 5, properties={"authentication_method": "X-NONE-AT-ALL",
                                                  **limit}))
        [ack] = c.refused()
        sizes.append((ack.size > 16, "reason_string" in ack.properties))
    assert sizes == [(True, True), (False, False)]


def test_mqtt_3_2_2_22(port: int) -> None:
    """[MQTT-3.2.2-22] No Server Keep Alive: the client's Keep Alive (1 s) is used; a
    client that pings stays connected past 1.5 s."""
    c = Peer(port)
    assert "server_keep_alive" not in c.connect(uid(), keepalive=1).properties
    for _ in range(5):
        time.sleep(0.5)
        c.send(mqtt.Pingreq())
        assert isinstance(c.expect(Pingresp), Pingresp)
    assert c.closed(4.0)
