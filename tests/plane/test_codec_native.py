"""The native MQTT codec against gateway/mqtt/codec.py, the specification: whatever a
client sends after its CONNACK (valid packets, and the same mangled: truncated, bits
flipped, bad remaining lengths, bad UTF-8, bad properties), cut into any chunks, both
decode the same packets and stop at the same point with the same reason code; both
encode a PUBLISH or PUBACK to the same bytes, or both refuse it.

The native decoder leaves SUBSCRIBE, UNSUBSCRIBE, AUTH and CONNECT to Python as frames:
here Python decodes those frames, as the connection will."""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.mqtt import (
    MAX_PACKET_SIZE,
    Puback,
    encode,
    encode_publish,
)
from gateway.mqtt import properties as P
from gateway.mqtt import reason as R
from gateway.mqtt.properties import encode_properties, encode_varint
from serving import plane
from tests.gateway.test_codec_fuzz import chunks, client_packet, props, text, topic_name
from tests.plane.codec_outcomes import native_outcome, python_outcome

if plane.NATIVE is None or not hasattr(plane.NATIVE, "MqttDecoder"):
    if os.environ.get("LIGHTGATE_NATIVE") == "1":
        pytest.fail("LIGHTGATE_NATIVE=1 but the native MQTT codec is not installed")
    pytest.skip("the native MQTT codec is not installed", allow_module_level=True)

native: Any = plane.NATIVE
SETTINGS = settings(max_examples=300, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
VERSION = st.sampled_from([4, 5])
BUDGET = st.sampled_from([16, 64, 300, MAX_PACKET_SIZE])
CUTS = st.lists(st.integers(0, 10_000), max_size=6)

def assert_same(parts: list[bytes], version: int, budget: int) -> None:
    assert native_outcome(native, parts, version, budget) == python_outcome(parts, version, budget)


# --- what to feed ------------------------------------------------------------------------

_PUBLISH_IDS = sorted(P.PROPERTY_IDS[name] for name in P.ALLOWED[P.PUBLISH])


@st.composite
def raw_property(draw: st.DrawFn) -> bytes:
    """One property with a well-chosen or hostile id and a value of any shape."""
    pid = draw(st.one_of(st.sampled_from(_PUBLISH_IDS), st.integers(0, 0x30),
                         st.integers(0, 255)))
    value = draw(st.one_of(
        st.binary(max_size=6),
        st.sampled_from([b"\x00", b"\x01", b"\x02", b"\x00\x00", b"\x00\x01", b"\x80\x00",
                         b"\xff\xff\xff\xff\x7f", b"\x00\x01#", b"\x00\x01+", b"\x00\x02\xc3",
                         b"\x00\x01\x00", b"\x00\x03a/b", b"\x00\x02\xed\xa0"]),
    ))
    return bytes((pid,)) + value


@st.composite
def property_block(draw: st.DrawFn) -> bytes:
    if draw(st.booleans()):
        return encode_properties(draw(props(P.PUBLISH)), P.PUBLISH)
    body = b"".join(draw(st.lists(raw_property(), max_size=4)))
    length = draw(st.one_of(st.just(len(body)), st.integers(0, 300)))
    return encode_varint(length) + body


@st.composite
def raw_publish(draw: st.DrawFn, version: int) -> bytes:
    """A PUBLISH put together by hand: any flags, topic bytes, packet id, properties."""
    flags = draw(st.integers(0, 15))
    topic = draw(st.one_of(
        topic_name.map(str.encode),
        st.sampled_from([b"", b"a/+", b"#", b"a\x00b", b"\xff", b"\xc3", b"\xed\xa0\x80",
                         b"\xf4\x90\x80\x80", b"\xc0\xaf"]),
        st.binary(max_size=8),
    ))
    body = len(topic).to_bytes(2, "big") + topic
    if (flags >> 1) & 3:
        body += draw(st.sampled_from([b"\x00\x00", b"\x00\x01", b"\xff\xff", b"\x12"]))
    if version == 5:
        body += draw(property_block())
    body += draw(st.binary(max_size=70))
    return bytes((0x30 | flags,)) + encode_varint(len(body)) + body


@st.composite
def valid_stream(draw: st.DrawFn, version: int) -> bytes:
    packets = draw(st.lists(client_packet(version), min_size=1, max_size=5))
    return b"".join(encode(p, version) for p in packets)


@st.composite
def mangled(draw: st.DrawFn, wire: bytes) -> bytes:
    """Truncate, flip bits, insert or delete bytes, or break the remaining length."""
    data = bytearray(wire)
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.integers(0, 4))
        i = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == 0:
            del data[i:]
        elif op == 1 and data:
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == 2:
            data[i:i] = draw(st.binary(min_size=1, max_size=4))
        elif op == 3:
            del data[i:i + draw(st.integers(1, 4))]
        else:
            data[i:i] = draw(st.sampled_from([b"\x30\xff\xff\xff\xff\x01", b"\x30\x80\x00",
                                              b"\x30\xff\xff\xff\x7f", b"\x32\x80\x80\x01",
                                              b"\x00\x00", b"\x20\x02\x00\x00", b"\xf0\x00"]))
    return bytes(data)


@st.composite
def client_bytes(draw: st.DrawFn) -> tuple[int, bytes]:
    version = draw(VERSION)
    wire = draw(st.one_of(valid_stream(version), raw_publish(version),
                          st.lists(raw_publish(version), min_size=2, max_size=4).map(b"".join)))
    return version, draw(mangled(wire))


# --- decoding --------------------------------------------------------------------------------


@SETTINGS
@given(VERSION, st.data(), CUTS)
def test_valid_packets_decode_alike(version: int, data: st.DataObject,
                                    cuts: list[int]) -> None:
    wire = data.draw(valid_stream(version))
    native_got, error, held = native_outcome(native, chunks(wire, cuts), version,
                                             MAX_PACKET_SIZE)
    assert (error, held) == (None, 0)
    assert native_got == python_outcome([wire], version, MAX_PACKET_SIZE)[0]


@SETTINGS
@given(client_bytes(), BUDGET, CUTS)
def test_hostile_bytes_decode_alike(sample: tuple[int, bytes], budget: int,
                                    cuts: list[int]) -> None:
    version, wire = sample
    assert_same(chunks(wire, cuts), version, budget)


@SETTINGS
@given(VERSION, st.binary(max_size=200), BUDGET, CUTS)
def test_random_bytes_decode_alike(version: int, wire: bytes, budget: int,
                                   cuts: list[int]) -> None:
    assert_same(chunks(wire, cuts), version, budget)


@pytest.mark.parametrize(("version", "wire", "code"), [
    (4, b"\x30\x03\x00\x01+", R.TOPIC_NAME_INVALID),
    (4, b"\x30\x03\x00\x01\xff", R.MALFORMED_PACKET),
    (4, b"\x32\x05\x00\x01a\x00\x00", R.PROTOCOL_ERROR),
    (5, b"\x30\x06\x00\x00\x03\x23\x00\x00", R.TOPIC_ALIAS_INVALID),
    (5, b"\x30\x06\x00\x01a\x02\x01\x02", R.PROTOCOL_ERROR),
    (5, b"\x30\x06\x00\x01a\x02\x0b\x01", R.PROTOCOL_ERROR),
    (4, b"\x30\x80\x80\x80\x80\x01", R.MALFORMED_PACKET),
    (4, b"\x30\x7f", R.PACKET_TOO_LARGE),
    (4, b"\x20\x02\x00\x00", R.PROTOCOL_ERROR),
])
def test_known_violations(version: int, wire: bytes, code: int) -> None:
    assert python_outcome([wire], version, 64)[1] == code
    assert native_outcome(native, [wire], version, 64)[1] == code


def test_the_budget_counts_the_partial_tail() -> None:
    pub = encode_publish("a/b", b"x" * 40, 1, packet_id=1, version=4)
    dec = native.MqttDecoder(4, 100)
    assert dec.feed(pub + pub[:10]) == [(3, "a/b", b"x" * 40, 1, False, False, 1, {})]
    assert dec.buffered == 10
    packets, held = native.decode_frames(pub[:-1], 4, 100)
    assert (packets, held) == ([], len(pub) - 1)
    with pytest.raises(native.MqttError) as info:
        dec.feed(pub[10:] + b"\x30\x7f")  # the held packet completes, then 129 > 100
    assert info.value.args[0] == R.PACKET_TOO_LARGE
    assert len(info.value.args[2]) == 1


# --- encoding ----------------------------------------------------------------------------------

_BAD_PROPS = st.sampled_from([
    {"topic_alias": 0}, {"payload_format_indicator": 2}, {"response_topic": "a/#"},
    {"session_expiry_interval": 5}, {"no_such_property": 1}, {"content_type": "a\x00"},
    {"message_expiry_interval": 2**32}, {"user_property": [("k",)]}, {"topic_alias": True},
    {"correlation_data": "text"}, {"subscription_identifier": 0},
])


@st.composite
def publish_args(draw: st.DrawFn) -> dict[str, Any]:
    version = draw(st.sampled_from([3, 4, 5, 6]))
    properties = draw(st.one_of(props(P.PUBLISH), _BAD_PROPS, st.just({})))
    if properties and version != 5 and draw(st.booleans()):
        properties = {}
    qos = draw(st.sampled_from([0, 1, 2, 0, 1, 3]))
    return {
        "topic": draw(st.one_of(topic_name, text, st.sampled_from(["", "a/+", "#", "a\ud800"]))),
        "payload": draw(st.binary(max_size=100)),
        "qos": qos,
        "retain": draw(st.booleans()),
        "dup": draw(st.booleans()) and (qos > 0 or draw(st.booleans())),
        "packet_id": draw(st.one_of(st.integers(1, 0xFFFF), st.none(), st.just(0))) if qos
        else draw(st.one_of(st.none(), st.none(), st.just(7))),
        "version": version,
        "properties": properties,
    }


def outcome(fn: Any, **kwargs: Any) -> bytes | type:
    try:
        return fn(**kwargs)
    except ValueError:
        return ValueError


@SETTINGS
@given(publish_args())
def test_publish_encodes_alike(args: dict[str, Any]) -> None:
    assert outcome(native.encode_publish, **args) == outcome(encode_publish, **args)


@SETTINGS
@given(st.integers(1, 0xFFFF), st.sampled_from(sorted(R.PUBACK_REASONS | {0x05, 0x92})),
       st.sampled_from([4, 5]), st.one_of(st.just({}), props(P.PUBACK)))
def test_puback_encodes_alike(packet_id: int, code: int, version: int,
                              properties: dict[str, Any]) -> None:
    want = outcome(lambda: encode(Puback(packet_id, code, properties), version))
    got = outcome(native.encode_puback, packet_id=packet_id, reason_code=code,
                  version=version, properties=properties)
    assert got == want


def test_pingresp() -> None:
    assert native.encode_pingresp() == b"\xd0\x00"
