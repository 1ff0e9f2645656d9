"""Table tests for the sans-IO MQTT codec (gateway.mqtt)."""

from __future__ import annotations

import random

import pytest

from gateway.mqtt import (
    Auth,
    Connack,
    Connect,
    Decoder,
    Disconnect,
    Pingreq,
    Pingresp,
    ProtocolError,
    Puback,
    Pubcomp,
    Publish,
    PublishTemplate,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    SubscriptionOptions,
    Unsuback,
    Unsubscribe,
    UnsupportedProtocolError,
    Will,
    connack_v5_to_v3,
    encode,
    encode_publish,
)
from gateway.mqtt import reason as rc

H = bytes.fromhex


def server(version: int | None = None) -> Decoder:
    """A server decoder that has already seen a CONNECT of `version`."""
    d = Decoder()
    if version is not None:
        assert len(d.feed(encode(Connect("c", version), version))) == 1
    return d


def client(version: int) -> Decoder:
    return Decoder(server=False, version=version)


def one(decoder: Decoder, data: bytes) -> object:
    packets = decoder.feed(data)
    assert len(packets) == 1, packets
    return packets[0]


def raises(decoder: Decoder, data: bytes, code: int) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decoder.feed(data)
    assert info.value.reason_code == code, str(info.value)
    return info.value


# --- exact bytes -------------------------------------------------------------------------

# 3.1.1 CONNECT, flags 0xCE as in the spec's example (user, password, will QoS 1, will,
# clean session), keepalive 10.
V4_CONNECT = Connect(
    "cid", 4, clean_start=True, keepalive=10, username="u", password=b"p",
    will=Will("w", b"m", qos=1),
)
V4_CONNECT_BYTES = H("101b" "00044d515454" "04" "ce" "000a" "0003636964" "000177" "00016d"
                     "000175" "000170")
V3_CONNECT = Connect("cid", 3, keepalive=60)
V3_CONNECT_BYTES = H("1011" "00064d514973647003" "02" "003c" "0003636964")
V5_CONNECT = Connect("cid", 5, keepalive=60, properties={"session_expiry_interval": 10})
V5_CONNECT_BYTES = H("1015" "00044d51545405" "02" "003c" "05" "110000000a" "0003636964")


@pytest.mark.parametrize(
    ("packet", "version", "wire"),
    [
        (V3_CONNECT, 3, V3_CONNECT_BYTES),
        (V4_CONNECT, 4, V4_CONNECT_BYTES),
        (V5_CONNECT, 5, V5_CONNECT_BYTES),
        # 3.1.1 §3.3.2.3 style PUBLISH: topic "a/b", packet id 10
        (Publish("a/b", b"hi", qos=1, packet_id=10), 4, H("3209" "0003612f62" "000a" "6869")),
        (Publish("a/b", b"", retain=True), 4, H("3105" "0003612f62")),
        (Publish("a/b", b"x", qos=2, dup=True, packet_id=1), 5, H("3c09" "0003612f62000100" "78")),
        (Connack(True, 0), 4, H("20020100")),
        (Connack(False, 5), 3, H("20020005")),
        (Connack(False, 0x86), 5, H("2003008600")),
        (Puback(1), 4, H("40020001")),
        (Pubrec(2), 4, H("50020002")),
        (Pubrel(3), 4, H("62020003")),
        (Pubcomp(4), 4, H("70020004")),
        # v5 short forms: reason 0 and no properties -> 2 bytes; reason only -> 3 bytes
        (Puback(1), 5, H("40020001")),
        (Puback(1, rc.NO_MATCHING_SUBSCRIBERS), 5, H("4003000110")),
        (Pubrel(7, rc.PACKET_IDENTIFIER_NOT_FOUND), 5, H("6203000792")),
        (Puback(1, 0, {"reason_string": "ok"}), 5, H("4009" "0001" "00" "05" "1f00026f6b")),
        (Subscribe(10, [("a/+", SubscriptionOptions(1))]), 4, H("8208000a" "0003612f2b" "01")),
        (Subscribe(10, [("a/#", SubscriptionOptions(2, True, True, 2))]), 5,
         H("8209000a" "00" "0003612f23" "2e")),
        (Suback(10, [0, 1, 0x80]), 4, H("9005000a000180")),
        (Unsubscribe(11, ["a/b"]), 4, H("a207000b0003612f62")),
        (Unsuback(11), 4, H("b002000b")),
        (Unsuback(11, [0, 0x11]), 5, H("b005000b000011")),
        (Pingreq(), 4, H("c000")),
        (Pingresp(), 4, H("d000")),
        (Disconnect(), 4, H("e000")),
        (Disconnect(), 5, H("e000")),
        (Disconnect(rc.SESSION_TAKEN_OVER), 5, H("e0018e")),
        (Disconnect(0, {"session_expiry_interval": 0}), 5, H("e00700" "05" "1100000000")),
        (Auth(), 5, H("f000")),
        (Auth(0x18, {"authentication_method": "x"}), 5, H("f00618" "04" "15000178")),
    ],
)
def test_exact_bytes(packet: object, version: int, wire: bytes) -> None:
    assert encode(packet, version) == wire  # type: ignore[arg-type]
    if isinstance(packet, Connect):
        d = Decoder()
    elif isinstance(packet, Connack | Suback | Unsuback | Pingresp):
        d = client(version)
    else:
        d = server(version)
    assert one(d, wire) == packet


def test_connect_sets_version() -> None:
    d = Decoder()
    assert d.version is None
    d.feed(V4_CONNECT_BYTES)
    assert d.version == 4
    d = Decoder()
    d.feed(V3_CONNECT_BYTES)
    assert d.version == 3
    d = Decoder()
    d.feed(V5_CONNECT_BYTES)
    assert d.version == 5


def test_v5_acks_decode_all_forms() -> None:
    for version in (5,):
        d = server(version)
        assert one(d, H("40020001")) == Puback(1)
        assert one(d, H("4003000110")) == Puback(1, 0x10)
        assert one(d, H("400400011000")) == Puback(1, 0x10)
        assert one(d, H("50020009")) == Pubrec(9)
        assert one(d, H("6203000992")) == Pubrel(9, 0x92)
        assert one(d, H("7004000900" "00")) == Pubcomp(9)
        c = client(version)
        assert one(c, H("e000")) == Disconnect()
        assert one(c, H("e0018b")) == Disconnect(rc.SERVER_SHUTTING_DOWN)
        assert one(c, H("f000")) == Auth()
        assert one(c, H("b004000100" "11")) == Unsuback(1, [0x11])


# --- round trips per packet type and version ------------------------------------------------

PROPS_PUBLISH = {
    "payload_format_indicator": 1,
    "message_expiry_interval": 60,
    "content_type": "text/plain",
    "response_topic": "reply/to",
    "correlation_data": b"\x00\x01",
    "topic_alias": 3,
    "user_property": [("k", "v"), ("k", "w"), ("a", "")],
}

C2S = {
    3: [
        Connect("dev-1", 3, clean_start=False, keepalive=0, username="u", password=b"pw",
                will=Will("will/t", b"bye", 2, True)),
        Publish("a/b", b"payload", 1, False, True, 65535),
        Puback(5), Pubrec(6), Pubrel(7), Pubcomp(8),
        Subscribe(9, [("a/+/c", SubscriptionOptions(0)), ("#", SubscriptionOptions(2))]),
        Unsubscribe(10, ["a/+/c", "#"]),
        Pingreq(), Disconnect(),
    ],
    4: [
        Connect("", 4, username="u"),
        Publish("a/b", b"", 0, True),
        Publish("ü/€/𝄞", b"\x00" * 300, 2, False, False, 1),
        Puback(5), Pubrec(6), Pubrel(7), Pubcomp(8),
        Subscribe(9, [("$share/g/a/#", SubscriptionOptions(1))]),
        Unsubscribe(10, ["a", "b/#"]),
        Pingreq(), Disconnect(),
    ],
    5: [
        Connect("dev-5", 5, password=b"only-password", keepalive=600,
                will=Will("w", b"", 1, False, {"will_delay_interval": 5,
                                                "user_property": [("a", "b")]}),
                properties={"session_expiry_interval": 0xFFFFFFFF, "receive_maximum": 10,
                            "maximum_packet_size": 1 << 20, "topic_alias_maximum": 5,
                            "request_response_information": 1,
                            "request_problem_information": 0,
                            "authentication_method": "SCRAM", "authentication_data": b"x",
                            "user_property": [("x", "1"), ("x", "2")]}),
        Publish("a/b", b"p" * 200, 1, False, False, 2, PROPS_PUBLISH),
        Publish("", b"aliased", 0, False, False, None, {"topic_alias": 3}),
        Puback(5, 0x97, {"reason_string": "quota"}), Pubrec(6, 0x10), Pubrel(7),
        Pubcomp(8, 0x92, {"user_property": [("k", "v")]}),
        Subscribe(9, [("a/+", SubscriptionOptions(1, True, False, 1)),
                      ("$share/g/x", SubscriptionOptions(0, False, True, 2))],
                  {"subscription_identifier": [7], "user_property": [("k", "v")]}),
        Unsubscribe(10, ["a/+"], {"user_property": [("k", "v")]}),
        Pingreq(),
        Disconnect(rc.DISCONNECT_WITH_WILL_MESSAGE, {"session_expiry_interval": 30,
                                                     "reason_string": "bye"}),
        Auth(rc.RE_AUTHENTICATE, {"authentication_method": "SCRAM",
                                  "authentication_data": b"\xff"}),
    ],
}

S2C = {
    3: [Connack(False, 2), Publish("x", b"y", 1, True, False, 3), Puback(1), Pubrec(2),
        Pubrel(3), Pubcomp(4), Suback(5, [0, 1, 2]), Unsuback(6), Pingresp()],
    4: [Connack(True, 0), Publish("x", b"y", 2, True, True, 3), Puback(1), Suback(5, [0x80]),
        Unsuback(6), Pingresp()],
    5: [
        Connack(True, 0, {
            "session_expiry_interval": 10, "assigned_client_identifier": "auto-1",
            "server_keep_alive": 30, "response_information": "resp", "server_reference": "s2",
            "reason_string": "hi", "receive_maximum": 100, "topic_alias_maximum": 10,
            "maximum_qos": 1, "retain_available": 0, "maximum_packet_size": 1000,
            "wildcard_subscription_available": 1, "subscription_identifier_available": 1,
            "shared_subscription_available": 0, "user_property": [("a", "b")],
            "authentication_method": "m", "authentication_data": b"d"}),
        Connack(False, rc.BANNED),
        Publish("x", b"y", 1, False, False, 3, {"subscription_identifier": [1, 268435455]}),
        Puback(1, rc.NOT_AUTHORIZED),
        Suback(5, [0, 1, 2, 0x80, 0x97, 0xA2], {"reason_string": "r"}),
        Unsuback(6, [0, 0x11, 0x87]), Pingresp(),
        Disconnect(rc.SERVER_MOVED, {"server_reference": "other:1883"}),
        Auth(0x18, {"authentication_method": "m"}),
    ],
}


@pytest.mark.parametrize("version", [3, 4, 5])
def test_client_to_server_round_trip(version: int) -> None:
    packets = C2S[version]
    assert isinstance(packets[0], Connect)
    wire = b"".join(encode(p, version) for p in packets)
    assert Decoder().feed(wire) == packets


@pytest.mark.parametrize("version", [3, 4, 5])
def test_server_to_client_round_trip(version: int) -> None:
    packets = S2C[version]
    wire = b"".join(encode(p, version) for p in packets)
    assert client(version).feed(wire) == packets


@pytest.mark.parametrize("version", [3, 4, 5])
def test_split_feed_equals_whole_feed(version: int) -> None:
    wire = b"".join(encode(p, version) for p in C2S[version])
    whole = Decoder().feed(wire)
    d = Decoder()
    byte_by_byte = [p for i in range(len(wire)) for p in d.feed(wire[i : i + 1])]
    assert byte_by_byte == whole
    rnd = random.Random(version)
    for _ in range(20):
        d = Decoder()
        got = []
        i = 0
        while i < len(wire):
            step = rnd.randint(1, 40)
            got += d.feed(memoryview(wire)[i : i + step])
            i += step
        assert got == whole
    s2c = b"".join(encode(p, version) for p in S2C[version])
    d = client(version)
    assert [p for i in range(len(s2c)) for p in d.feed(s2c[i : i + 1])] == S2C[version]


def test_large_packet_split_is_linear_and_exact() -> None:
    d = server(4)
    big = encode_publish("t", b"z" * 1_000_000, 1, packet_id=1)
    got = []
    for i in range(0, len(big), 997):
        got += d.feed(big[i : i + 997])
    assert got == [Publish("t", b"z" * 1_000_000, 1, packet_id=1)]
    # many packets in one chunk
    assert len(d.feed(encode(Puback(1), 4) * 10_000)) == 10_000


def test_remaining_length_boundaries() -> None:
    d = server(4)
    for size in (0, 1, 120, 121, 122, 16380, 16381, 16382, 16383, 16384, 2_097_151, 2_097_152):
        wire = encode_publish("ab", b"q" * size, 0)
        assert one(d, wire) == Publish("ab", b"q" * size)


# --- protections: every violation is a ProtocolError with the right reason -----------------

M, P = rc.MALFORMED_PACKET, rc.PROTOCOL_ERROR


def s(text: str | bytes) -> bytes:
    """A length-prefixed MQTT string (bytes are taken as already encoded)."""
    raw = text.encode() if isinstance(text, str) else text
    return len(raw).to_bytes(2, "big") + raw


def F(first: int, *parts: str | bytes) -> bytes:  # noqa: N802
    """A packet with the given first byte; hex-string or bytes parts; length computed."""
    body = b"".join(H(p) if isinstance(p, str) else p for p in parts)
    assert len(body) < 128
    return bytes((first, len(body))) + body


@pytest.mark.parametrize(
    ("version", "wire", "code"),
    [
        # fixed header
        (4, H("30ffffffff7f"), M),  # remaining length longer than 4 bytes
        (4, H("c08000"), M),  # remaining length not minimally encoded
        (4, F(0x00), M),  # reserved packet type 0
        (4, F(0xF0), M),  # AUTH before MQTT 5
        (4, F(0x80, "000a", s("a"), "00"), M),  # SUBSCRIBE flags 0000
        (4, F(0xA0, "000a", s("a")), M),  # UNSUBSCRIBE flags 0000
        (4, F(0x60, "0001"), M),  # PUBREL flags 0000
        (4, F(0x41, "0001"), M),  # PUBACK flags 0001
        (4, F(0xC1), M),  # PINGREQ flags
        (4, F(0xE1), M),  # DISCONNECT flags
        (4, F(0x20, "0000"), P),  # CONNACK sent to a server
        (4, F(0x90, "000100"), P),  # SUBACK sent to a server
        (4, F(0xD0), P),  # PINGRESP sent to a server
        (4, V4_CONNECT_BYTES, P),  # second CONNECT
        # PUBLISH
        (4, F(0x36, s("a"), "0001"), M),  # QoS 3
        (4, F(0x38, s("a")), M),  # QoS 0 with DUP
        (5, F(0x38, s("a"), "00"), M),
        (4, F(0x32, s("a"), "0000"), P),  # packet id 0
        (4, F(0x30, "00ff61"), M),  # truncated topic
        (4, F(0x30, s(b"\xff")), M),  # invalid UTF-8
        (4, F(0x30, s(b"a\x00b")), M),  # U+0000 in topic
        (4, F(0x30, s(b"a\xc0\x80")), M),  # overlong UTF-8 (NUL)
        (4, F(0x30, s(b"\xed\xa0\x80")), M),  # UTF-16 surrogate
        (4, F(0x30, s(b"a\xed\xa0")), M),  # truncated sequence
        (4, F(0x30, s("a/+")), rc.TOPIC_NAME_INVALID),  # wildcard in topic name
        (4, F(0x30, s("#")), rc.TOPIC_NAME_INVALID),
        (4, F(0x30, s("")), P),  # empty topic
        (5, F(0x30, s(""), "00"), P),  # empty topic without alias
        (4, F(0x32, "00"), M),  # truncated
        (4, F(0x32, s("a"), "00"), M),  # truncated packet id
        # acks
        (4, F(0x40, "000100"), M),  # trailing byte before v5
        (4, F(0x40, "00"), M),
        (4, F(0x40, "0000"), P),  # packet id 0
        (5, F(0x40, "000101"), P),  # reason code not allowed on PUBACK
        (5, F(0x62, "000110"), P),  # reason code not allowed on PUBREL
        (5, F(0x40, "0001", "10", "00", "00"), M),  # trailing bytes after properties
        (5, F(0x40, "0001", "10", "01", "26"), M),  # truncated user property
        # SUBSCRIBE
        (4, F(0x82, "0001"), P),  # no subscriptions
        (4, F(0x82, "0001", s("a")), M),  # options byte missing
        (4, F(0x82, "0001", s("a"), "03"), M),  # QoS 3
        (4, F(0x82, "0001", s("a"), "04"), M),  # v5 option bits before v5
        (5, F(0x82, "0001", "00", s("a"), "40"), M),  # reserved option bits
        (5, F(0x82, "0001", "00", s("a"), "30"), P),  # retain handling 3
        (5, F(0x82, "0001", "00", s("$share/g/a"), "04"), P),  # no_local on $share
        (4, F(0x82, "0001", s("a+"), "00"), rc.TOPIC_FILTER_INVALID),
        (4, F(0x82, "0001", s("#/a"), "00"), rc.TOPIC_FILTER_INVALID),
        (4, F(0x82, "0001", s("$share/g"), "00"), rc.TOPIC_FILTER_INVALID),
        (4, F(0x82, "0001", s("$share//a"), "00"), rc.TOPIC_FILTER_INVALID),
        (4, F(0x82, "0001", s("$share/+/a"), "00"), rc.TOPIC_FILTER_INVALID),
        (4, F(0x82, "0001", s(""), "00"), rc.TOPIC_FILTER_INVALID),
        (4, F(0x82, "0000", s("a"), "00"), P),  # packet id 0
        (4, F(0x82, "0001", s(b"\x00"), "00"), M),  # U+0000 in filter
        (4, F(0x82, "0001", s(b"\xed\xbf\xbf"), "00"), M),  # surrogate in filter
        # UNSUBSCRIBE
        (4, F(0xA2, "0001"), P),
        (4, F(0xA2, "0001", "0002", "61"), M),
        (4, F(0xA2, "0001", s("+a")), rc.TOPIC_FILTER_INVALID),
        # properties
        (5, F(0x30, s("a"), "05", "1100000000"), M),  # session expiry not allowed on PUBLISH
        (5, F(0x30, s("a"), "03", "7f0000"), M),  # unknown property id
        (5, F(0x30, s("a"), "0a", "0200000001", "0200000002"), P),  # duplicate property
        (5, F(0x30, s("a"), "02", "0b01"), P),  # subscription id from a client
        (5, F(0x30, s("a"), "02", "0102"), P),  # payload format indicator 2
        (5, F(0x30, s("a"), "03", "230000"), rc.TOPIC_ALIAS_INVALID),  # topic alias 0
        (5, F(0x30, s("a"), "0a", "2300"), M),  # property length beyond packet
        (5, F(0x30, s("a"), "01", "23"), M),  # truncated property value
        (5, F(0x30, s("a"), "84808080", "00"), M),  # 5-byte property length
        (5, F(0x30, s("a"), "8000"), M),  # non-minimal property length
        (5, F(0x30, s("a"), "04", "08", s(b"\xff")), M),  # invalid UTF-8 in a property
        (5, F(0x30, s("a"), "04", "08", s("ab")), M),  # value overruns property length
        (5, F(0x30, s("a"), "06", "08", s("a/+")), P),  # wildcard in response topic
        (5, F(0x82, "0001", "04", "0b01", "0b02", s("a"), "00"), P),  # 2 subscription ids
        (5, F(0x82, "0001", "03", "0b8000", s("a"), "00"), M),  # non-minimal varint
        (5, F(0x82, "0001", "02", "0b00", s("a"), "00"), P),  # subscription id 0
        (5, F(0x82, "0001", "05", "0b80808080", s("a"), "00"), M),  # 5-byte varint
        (5, F(0x82, "0001", "02", "2600", s("a"), "00"), M),  # truncated user property
        # DISCONNECT / AUTH
        (4, F(0xE0, "00"), M),
        (5, F(0xE0, "03"), P),  # reason code 3 is not defined
        (5, F(0xE0, "00", "02", "00"), M),  # truncated properties
        (5, F(0xF0, "01"), P),
        (5, F(0xF0, "00", "02", "1600"), M),  # truncated binary
        (5, F(0xF0, "00", "04", "16000178"), P),  # authentication data without method
        (5, F(0xC0, "00"), M),  # PINGREQ with body
    ],
)
def test_protocol_errors(version: int, wire: bytes, code: int) -> None:
    d = server(version)
    err = raises(d, wire, code)
    # the decoder stays failed
    with pytest.raises(ProtocolError) as again:
        d.feed(encode(Pingreq(), version))
    assert again.value is err


@pytest.mark.parametrize(
    ("version", "wire", "code"),
    [
        (4, F(0x20, "0006"), P),  # undefined 3.1.1 return code
        (4, F(0x20, "0201"), M),  # reserved connack flags
        (4, F(0x20, "0101"), P),  # session present with a failure
        (4, F(0x20, "0000", "00"), M),  # trailing byte
        (5, F(0x20, "0003", "00"), P),  # undefined v5 CONNACK reason
        (5, F(0x20, "0000"), M),  # missing property length
        (5, F(0x20, "0000", "05", "1700000001"), M),  # CONNECT-only property on CONNACK
        (5, F(0x20, "0000", "02", "24"), M),  # truncated
        (5, F(0x20, "0000", "02", "2402"), P),  # maximum_qos 2
        (5, F(0x20, "0000", "04", "16000178"), P),  # authentication data without method
        (4, F(0x10, "0000"), P),  # CONNECT sent to a client
        (4, F(0x82, "0001", s("a"), "00"), P),  # SUBSCRIBE sent to a client
        (4, F(0xC0), P),
        (4, F(0xE0), P),  # DISCONNECT from a 3.1.1 server
        (5, F(0xE0, "00", "05", "1100000001"), P),  # session expiry in server DISCONNECT
        (4, F(0x90, "0001"), P),  # SUBACK without codes
        (4, F(0x90, "0001", "03"), P),  # invalid SUBACK return code
        (5, F(0x90, "0001", "00", "03"), P),
        (4, F(0xB0, "0001", "00"), M),  # v3/v4 UNSUBACK with a body
        (5, F(0xB0, "0001", "00"), P),  # v5 UNSUBACK without codes
        (5, F(0xB0, "0001", "00", "02"), P),
        (5, F(0x32, s("a"), "0001", "02", "0b"), M),  # truncated subscription id
    ],
)
def test_client_side_protocol_errors(version: int, wire: bytes, code: int) -> None:
    raises(client(version), wire, code)


def test_client_may_receive_repeated_subscription_ids() -> None:
    wire = F(0x30, s("a"), "06", "0b01", "0b02", "0b03")
    assert one(client(5), wire) == Publish("a", b"", properties={"subscription_identifier":
                                                                 [1, 2, 3]})


def test_first_packet_must_be_connect() -> None:
    raises(Decoder(), H("c000"), P)
    raises(Decoder(), F(0x30, s("a")), P)
    # rejected from the header alone, before a huge body is buffered
    raises(Decoder(), H("30ffffff7f"), P)
    raises(Decoder(), H("20020000"), P)


def test_packet_too_large_is_rejected_from_the_header() -> None:
    d = Decoder(max_packet_size=100)
    d.feed(encode(Connect("c", 4), 4))
    big = encode_publish("t", b"x" * 200, 0)
    raises(d, big[:3], rc.PACKET_TOO_LARGE)
    d = Decoder(max_packet_size=100)
    d.feed(encode(Connect("c", 4), 4))
    assert d.feed(encode_publish("t", b"x" * 95, 0))  # exactly 100 bytes
    raises(d, encode_publish("t", b"x" * 96, 0), rc.PACKET_TOO_LARGE)
    raises(Decoder(max_packet_size=10), V4_CONNECT_BYTES, rc.PACKET_TOO_LARGE)


def test_connect_protections() -> None:
    def connect(body: bytes) -> bytes:
        return bytes((0x10, len(body))) + body

    base = H("00044d515454" "04")
    raises(Decoder(), connect(base + H("03003c" "000161")), M)  # reserved flag
    raises(Decoder(), connect(base + H("0a003c" "000161")), M)  # will QoS without will flag
    raises(Decoder(), connect(base + H("22003c" "000161")), M)  # will retain without will
    raises(Decoder(), connect(base + H("1e003c" "000161" "000161" "0000")), M)  # will QoS 3
    raises(Decoder(), connect(base + H("42003c" "000161" "0000")), M)  # password, no user
    raises(Decoder(), connect(base + H("02003c" "000161" "00")), M)  # trailing byte
    raises(Decoder(), connect(base + H("02003c" "0001")), M)  # truncated client id
    raises(Decoder(), connect(base + H("02003c" "0001ff")), M)  # invalid UTF-8 client id
    raises(Decoder(), connect(base + H("02")), M)  # truncated header
    raises(Decoder(), connect(base + H("06003c" "000161" "00012b" "0000")),
           rc.TOPIC_NAME_INVALID)  # wildcard will topic
    raises(Decoder(), connect(base + H("82003c" "000161")), M)  # user flag, no user name
    raises(Decoder(), H("11020000"), M)  # CONNECT flags
    # v5: password without user name is allowed, bad properties are not
    v5 = H("00044d515454" "05")
    assert one(Decoder(), connect(v5 + H("42003c" "00" "000161" "000170"))) == Connect(
        "a", 5, keepalive=60, password=b"p")
    raises(Decoder(), connect(v5 + H("02003c" "02" "2100" "000161")), M)  # truncated
    raises(Decoder(), connect(v5 + H("02003c" "03" "210000" "000161")), P)  # receive max 0
    raises(Decoder(), connect(v5 + H("02003c" "03" "230001" "000161")), M)  # topic alias
    raises(Decoder(), connect(v5 + H("02003c" "04" "16000178" "000161")), P)  # data, no method
    # will properties are checked against the will's allowed set
    raises(Decoder(), connect(v5 + H("06003c" "00" "000161" "05" "1100000001" "000161" "0000")),
           M)


@pytest.mark.parametrize(
    ("name", "level"),
    [("MQTT", 6), ("MQTT", 3), ("MQIsdp", 4), ("MQIsdp", 5), ("mqtt", 4), ("HTTP", 1)],
)
def test_unsupported_protocol(name: str, level: int) -> None:
    raw = name.encode()
    body = len(raw).to_bytes(2, "big") + raw + bytes((level, 2, 0, 60)) + H("000161")
    with pytest.raises(UnsupportedProtocolError) as info:
        Decoder().feed(bytes((0x10, len(body))) + body)
    err = info.value
    assert isinstance(err, ProtocolError)
    assert err.reason_code == rc.UNSUPPORTED_PROTOCOL_VERSION
    assert err.v3_return_code == rc.CONNACK_UNACCEPTABLE_PROTOCOL_VERSION
    assert (err.protocol_name, err.protocol_level) == (name, level)


def test_error_keeps_packets_decoded_before_it() -> None:
    d = server(4)
    with pytest.raises(ProtocolError) as info:
        d.feed(encode(Pingreq(), 4) + encode(Puback(3), 4) + H("c00100"))
    assert info.value.packets == [Pingreq(), Puback(3)]


def test_topic_alias_allows_empty_topic_only_in_v5() -> None:
    wire = encode_publish("", b"x", 0, version=5, properties={"topic_alias": 1})
    assert one(server(5), wire) == Publish("", b"x", properties={"topic_alias": 1})
    with pytest.raises(ValueError):
        encode_publish("", b"x", 0, version=5)
    with pytest.raises(ValueError):
        encode_publish("", b"x", 0, version=4)


# --- encoder validation -------------------------------------------------------------------


class _Huge(bytes):
    def __len__(self) -> int:
        return 268_435_455


@pytest.mark.parametrize(
    "call",
    [
        lambda: encode_publish("a", b"", 3, packet_id=1),
        lambda: encode_publish("a", b"", -1),
        lambda: encode_publish("a", b"", 1),  # missing packet id
        lambda: encode_publish("a", b"", 1, packet_id=0),
        lambda: encode_publish("a", b"", 1, packet_id=65536),
        lambda: encode_publish("a", b"", 0, packet_id=1),
        lambda: encode_publish("a", b"", 0, dup=True),
        lambda: encode_publish("a/+", b""),
        lambda: encode_publish("a/#", b""),
        lambda: encode_publish("a\x00", b""),
        lambda: encode_publish("\ud800", b""),
        lambda: encode_publish("x" * 65536, b""),
        lambda: encode_publish("a", b"", version=4, properties={"topic_alias": 1}),
        lambda: encode_publish("a", b"", version=5, properties={"topic_alias": 0}),
        lambda: encode_publish("a", b"", version=5, properties={"session_expiry_interval": 1}),
        lambda: encode_publish("a", b"", version=5, properties={"nonsense": 1}),
        lambda: encode_publish("a", b"", version=5, properties={"payload_format_indicator": 2}),
        lambda: encode_publish("a", b"", version=5, properties={"user_property": [("a",)]}),
        lambda: encode_publish("a", b"", version=5, properties={"user_property": ["ab"]}),
        lambda: encode_publish("a", b"", version=5, properties={"message_expiry_interval": True}),
        lambda: encode_publish("a", b"", version=5, properties={"content_type": 1}),
        lambda: encode_publish("a", b"", version=5, properties={"correlation_data": "s"}),
        lambda: encode_publish("a", b"", version=5,
                               properties={"subscription_identifier": [268_435_456]}),
        lambda: encode_publish("a", b"", version=5, properties={"response_topic": "a/#"}),
        lambda: encode_publish("a", b"", version=6),
        lambda: encode_publish("a", _Huge(), 0),
        lambda: encode(Publish("a", b"", 3, packet_id=1), 4),
        lambda: encode(Puback(0), 4),
        lambda: encode(Puback(1, 0x10), 4),  # reason codes need v5
        lambda: encode(Puback(1, 0x92), 5),  # not a PUBACK reason
        lambda: encode(Pubrel(1, 0x10), 5),
        lambda: encode(Subscribe(1, []), 4),
        lambda: encode(Subscribe(1, [("a+", SubscriptionOptions())]), 4),
        lambda: encode(Subscribe(1, [("a", SubscriptionOptions(3))]), 4),
        lambda: encode(Subscribe(1, [("a", SubscriptionOptions(0, True))]), 4),
        lambda: encode(Subscribe(1, [("a", SubscriptionOptions(0, False, False, 3))]), 5),
        lambda: encode(Subscribe(1, [("$share/g/a", SubscriptionOptions(0, True))]), 5),
        lambda: encode(Subscribe(1, [("a", SubscriptionOptions())],
                                 {"subscription_identifier": [1, 2]}), 5),
        lambda: encode(Suback(1, []), 4),
        lambda: encode(Suback(1, [0x97]), 4),
        lambda: encode(Unsubscribe(1, []), 4),
        lambda: encode(Unsubscribe(1, ["#/a"]), 4),
        lambda: encode(Unsuback(1, []), 5),
        lambda: encode(Connack(False, 6), 4),
        lambda: encode(Connack(True, 5), 4),
        lambda: encode(Connack(False, 0x01), 5),
        lambda: encode(Connect("c", 4), 5),  # level mismatch
        lambda: encode(Connect("c", 4, "MQIsdp"), 4),
        lambda: encode(Connect("c", 4, password=b"p"), 4),
        lambda: encode(Connect("c", 4, keepalive=70000), 4),
        lambda: encode(Connect("c", 4, will=Will("a/#")), 4),
        lambda: encode(Connect("c", 4, will=Will("a", qos=3)), 4),
        lambda: encode(Connect("c", 4, properties={"receive_maximum": 1}), 4),
        lambda: encode(Connect("c", 5, properties={"receive_maximum": 0}), 5),
        lambda: encode(Connect("c\x00", 4), 4),
        lambda: encode(Disconnect(0x8E), 4),
        lambda: encode(Disconnect(0x03), 5),
        lambda: encode(Auth(), 4),
        lambda: encode(Auth(0x80), 5),
        lambda: encode(Pingreq(), 2),
    ],
)
def test_encoder_validates(call: object) -> None:
    with pytest.raises(ValueError):
        call()  # type: ignore[operator]


def test_encode_rejects_non_packets() -> None:
    with pytest.raises(TypeError):
        encode("PUBLISH", 4)  # type: ignore[arg-type]


# --- PUBLISH fast path and template ---------------------------------------------------------


@pytest.mark.parametrize("version", [3, 4, 5])
def test_encode_publish_matches_encode(version: int) -> None:
    for qos, pid in ((0, None), (1, 1), (2, 65535)):
        for size in (0, 64, 200, 20000):
            p = Publish("home/bath/temp", bytes(size), qos, True, qos > 0, pid)
            wire = encode_publish(p.topic, p.payload, qos, True, qos > 0, pid, version)
            assert wire == encode(p, version)
            assert one(server(version), wire) == p


@pytest.mark.parametrize("version", [3, 4, 5])
def test_publish_template(version: int) -> None:
    props = {"message_expiry_interval": 5, "user_property": [("a", "b")]}
    tpl = PublishTemplate("a/b", b"payload", 2, True, props)
    expect_props = props if version == 5 else None
    for qos in (0, 1, 2):
        for retain in (False, True):
            for dup in (False, True):
                pid = None if qos == 0 else 1234
                if qos == 0 and dup:
                    continue
                got = tpl.for_subscriber(pid, dup, version=version, qos=qos, retain=retain)
                assert got == encode_publish("a/b", b"payload", qos, retain, dup, pid, version,
                                             expect_props)
    # defaults are the message's own QoS and retain flag
    assert tpl.for_subscriber(9, version=version) == encode_publish(
        "a/b", b"payload", 2, True, False, 9, version, expect_props)
    # the QoS 0 variant is cached whole
    assert tpl.for_subscriber(version=version, qos=0) is tpl.for_subscriber(version=version,
                                                                              qos=0)
    got = tpl.for_subscriber(7, version=version, subscription_ids=[3, 4])
    sub_props = {**props, "subscription_identifier": [3, 4]} if version == 5 else None
    assert got == encode_publish("a/b", b"payload", 2, True, False, 7, version, sub_props)
    with pytest.raises(ValueError):
        tpl.for_subscriber(None, version=version)
    with pytest.raises(ValueError):
        tpl.for_subscriber(1, version=version, qos=0)


def test_publish_template_validates() -> None:
    with pytest.raises(ValueError):
        PublishTemplate("a/+", b"")
    with pytest.raises(ValueError):
        PublishTemplate("a", b"", 3)
    with pytest.raises(ValueError):
        PublishTemplate("a", b"", properties={"topic_alias": 1})
    with pytest.raises(ValueError):
        PublishTemplate("a", b"", properties={"receive_maximum": 1})


# --- reason codes ------------------------------------------------------------------------------


def test_reason_codes() -> None:
    assert rc.SUCCESS == 0
    assert rc.NO_MATCHING_SUBSCRIBERS == 0x10
    assert rc.UNSPECIFIED_ERROR == 0x80
    assert rc.MALFORMED_PACKET == 0x81
    assert rc.PROTOCOL_ERROR == 0x82
    assert rc.SESSION_TAKEN_OVER == 0x8E
    assert rc.PACKET_TOO_LARGE == 0x95
    assert rc.QUOTA_EXCEEDED == 0x97
    assert rc.WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED == 0xA2
    assert rc.REASON_NAMES[0x8E] == "SESSION_TAKEN_OVER"
    assert connack_v5_to_v3(rc.SUCCESS) == rc.CONNACK_ACCEPTED
    assert connack_v5_to_v3(rc.UNSUPPORTED_PROTOCOL_VERSION) == 1
    assert connack_v5_to_v3(rc.CLIENT_IDENTIFIER_NOT_VALID) == 2
    assert connack_v5_to_v3(rc.SERVER_BUSY) == 3
    assert connack_v5_to_v3(rc.BAD_USER_NAME_OR_PASSWORD) == 4
    assert connack_v5_to_v3(rc.NOT_AUTHORIZED) == 5
    assert connack_v5_to_v3(rc.BANNED) == 5
    assert "PROTOCOL_ERROR" in str(ProtocolError(0x82, "x"))
    assert Connack(False, 3).return_code == 3
