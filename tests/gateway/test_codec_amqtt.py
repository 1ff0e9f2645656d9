"""Cross-check our MQTT 3.1.1 codec against amqtt 0.12's packet classes, both directions."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

amqtt_packet = pytest.importorskip("amqtt.mqtt.packet")

from amqtt.adapters import BufferReader  # noqa: E402
from amqtt.mqtt import packet_dict  # noqa: E402
from amqtt.mqtt.connack import ConnackPacket  # noqa: E402
from amqtt.mqtt.connect import ConnectPacket, ConnectPayload, ConnectVariableHeader  # noqa: E402
from amqtt.mqtt.disconnect import DisconnectPacket  # noqa: E402
from amqtt.mqtt.pingreq import PingReqPacket  # noqa: E402
from amqtt.mqtt.pingresp import PingRespPacket  # noqa: E402
from amqtt.mqtt.puback import PubackPacket  # noqa: E402
from amqtt.mqtt.pubcomp import PubcompPacket  # noqa: E402
from amqtt.mqtt.publish import PublishPacket  # noqa: E402
from amqtt.mqtt.pubrec import PubrecPacket  # noqa: E402
from amqtt.mqtt.pubrel import PubrelPacket  # noqa: E402
from amqtt.mqtt.suback import SubackPacket  # noqa: E402
from amqtt.mqtt.subscribe import SubscribePacket  # noqa: E402
from amqtt.mqtt.unsuback import UnsubackPacket  # noqa: E402
from amqtt.mqtt.unsubscribe import UnsubscribePacket  # noqa: E402

from gateway.mqtt import (  # noqa: E402
    Connack,
    Connect,
    Decoder,
    Disconnect,
    Pingreq,
    Pingresp,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    SubscriptionOptions,
    Unsuback,
    Unsubscribe,
    Will,
    encode,
)

V = 4  # amqtt speaks 3.1.1


def amqtt_decode(data: bytes) -> Any:
    """Decode one packet with amqtt; assert it consumed exactly `data`."""

    async def run() -> tuple[Any, bytes]:
        reader = BufferReader(data)
        fixed = await amqtt_packet.MQTTFixedHeader.from_stream(reader)
        assert fixed is not None
        cls = packet_dict[fixed.packet_type]
        packet = await cls.from_stream(reader, fixed_header=fixed)
        return packet, await reader.read()

    packet, rest = asyncio.run(run())
    assert rest == b"", "amqtt left bytes unread"
    return packet


def ours_server(data: bytes, connect_first: bool = True) -> Any:
    d = Decoder()
    if connect_first:
        d.feed(encode(Connect("x", V), V))
    (packet,) = d.feed(data)
    return packet


def ours_client(data: bytes) -> Any:
    (packet,) = Decoder(server=False, version=V).feed(data)
    return packet


# --- CONNECT -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "packet",
    [
        Connect("client-1", V, keepalive=30),
        Connect("client-2", V, clean_start=False, keepalive=0, username="user",
                password=b"secret"),
        Connect("client-3", V, username="u", password=b"p",
                will=Will("last/will", b"gone", qos=2, retain=True)),
        Connect("client-4", V, will=Will("w", b"", qos=1)),
    ],
)
def test_connect_ours_to_amqtt(packet: Connect) -> None:
    theirs = amqtt_decode(encode(packet, V))
    assert isinstance(theirs, ConnectPacket)
    vh, pl = theirs.variable_header, theirs.payload
    assert (vh.proto_name, vh.proto_level, vh.keep_alive) == ("MQTT", 4, packet.keepalive)
    assert vh.clean_session_flag == packet.clean_start
    assert pl.client_id == packet.client_id
    assert pl.username == packet.username
    assert pl.password == (packet.password.decode() if packet.password is not None else None)
    if packet.will is None:
        assert not vh.will_flag
    else:
        assert vh.will_flag
        assert (pl.will_topic, pl.will_message) == (packet.will.topic, packet.will.payload)
        assert (vh.will_qos, vh.will_retain_flag) == (packet.will.qos, packet.will.retain)


def test_connect_amqtt_to_ours() -> None:
    vh = ConnectVariableHeader(keep_alive=45)
    vh.clean_session_flag = True
    vh.will_flag = True
    vh.will_qos = 1
    vh.will_retain_flag = True
    vh.username_flag = True
    vh.password_flag = True
    payload = ConnectPayload("amqtt-client", "will/topic", b"will-msg", "name", "pass")
    wire = ConnectPacket(variable_header=vh, payload=payload).to_bytes()
    assert ours_server(wire, connect_first=False) == Connect(
        "amqtt-client", V, keepalive=45, clean_start=True, username="name", password=b"pass",
        will=Will("will/topic", b"will-msg", 1, True),
    )


# --- PUBLISH ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "packet",
    [
        Publish("sensors/t1", b"21.5", 0),
        Publish("sensors/t1", b"", 0, retain=True),
        Publish("a/b/c", b"\x00\xff" * 100, 1, packet_id=17),
        Publish("ü/€", b"x" * 70000, 2, retain=True, dup=True, packet_id=65535),
    ],
)
def test_publish_both_ways(packet: Publish) -> None:
    theirs = amqtt_decode(encode(packet, V))
    assert isinstance(theirs, PublishPacket)
    assert (theirs.topic_name, theirs.data, theirs.qos) == (packet.topic, packet.payload,
                                                           packet.qos)
    assert (theirs.retain_flag, theirs.dup_flag) == (packet.retain, packet.dup)
    assert theirs.packet_id == packet.packet_id
    built = PublishPacket.build(packet.topic, packet.payload, packet.packet_id, packet.dup,
                                packet.qos, packet.retain)
    wire = built.to_bytes()
    assert wire == encode(packet, V)
    assert ours_server(wire) == packet
    assert ours_client(wire) == packet


# --- acks and the rest -----------------------------------------------------------------------

SIMPLE = [
    (Puback(1), PubackPacket.build(1), "server"),
    (Pubrec(2), PubrecPacket.build(2), "server"),
    (Pubrel(3), PubrelPacket.build(3), "server"),
    (Pubcomp(65535), PubcompPacket.build(65535), "server"),
    (Puback(9), PubackPacket.build(9), "client"),
    (Pubrel(10), PubrelPacket.build(10), "client"),
    (Pingreq(), PingReqPacket(), "server"),
    (Pingresp(), PingRespPacket.build(), "client"),
    (Disconnect(), DisconnectPacket(), "server"),
    (Connack(False, 0), ConnackPacket.build(0, 0), "client"),
    (Connack(True, 0), ConnackPacket.build(1, 0), "client"),
    (Connack(False, 5), ConnackPacket.build(0, 5), "client"),
    (Unsuback(44), UnsubackPacket.build(44), "client"),
    (Suback(7, [0, 1, 2, 0x80]), SubackPacket.build(7, [0, 1, 2, 0x80]), "client"),
    (Subscribe(8, [("a/+", SubscriptionOptions(1)), ("b/#", SubscriptionOptions(2))]),
     SubscribePacket.build([("a/+", 1), ("b/#", 2)], 8), "server"),
    (Unsubscribe(9, ["a/+", "b/#"]), UnsubscribePacket.build(["a/+", "b/#"], 9), "server"),
]


@pytest.mark.parametrize(("ours", "theirs", "side"), SIMPLE)
def test_same_bytes_and_amqtt_to_ours(ours: Any, theirs: Any, side: str) -> None:
    wire = theirs.to_bytes()
    assert encode(ours, V) == wire
    decoded = ours_server(wire) if side == "server" else ours_client(wire)
    assert decoded == ours


@pytest.mark.parametrize(("ours", "theirs", "side"), SIMPLE)
def test_ours_to_amqtt(ours: Any, theirs: Any, side: str) -> None:
    got = amqtt_decode(encode(ours, V))
    assert type(got) is type(theirs)
    assert got.fixed_header.packet_type == theirs.fixed_header.packet_type
    assert got.fixed_header.flags == theirs.fixed_header.flags
    if isinstance(ours, Puback | Pubrec | Pubrel | Pubcomp | Unsuback):
        assert got.variable_header.packet_id == ours.packet_id
    elif isinstance(ours, Connack):
        assert bool(got.variable_header.session_parent) == ours.session_present
        assert got.variable_header.return_code == ours.return_code
    elif isinstance(ours, Suback):
        assert got.variable_header.packet_id == ours.packet_id
        assert got.payload.return_codes == ours.reason_codes
    elif isinstance(ours, Subscribe):
        assert got.variable_header.packet_id == ours.packet_id
        assert got.payload.topics == [(f, o.qos) for f, o in ours.subscriptions]
    elif isinstance(ours, Unsubscribe):
        assert got.variable_header.packet_id == ours.packet_id
        assert got.payload.topics == ours.filters
