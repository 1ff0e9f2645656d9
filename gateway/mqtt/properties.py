"""MQTT 5.0 properties (§2.2.2): the table of every property id, and its codec.

Properties are a plain ``dict`` keyed by the snake_case names below. Values:

===================================  =====  ===========  =======================================
name                                 id     type         packets
===================================  =====  ===========  =======================================
payload_format_indicator             0x01   byte (0/1)   PUBLISH, Will
message_expiry_interval              0x02   u32          PUBLISH, Will
content_type                         0x03   str          PUBLISH, Will
response_topic                       0x08   str (topic)  PUBLISH, Will
correlation_data                     0x09   bytes        PUBLISH, Will
subscription_identifier              0x0B   list[int]    PUBLISH (repeatable), SUBSCRIBE (one)
session_expiry_interval              0x11   u32          CONNECT, CONNACK, DISCONNECT
assigned_client_identifier           0x12   str          CONNACK
server_keep_alive                    0x13   u16          CONNACK
authentication_method                0x15   str          CONNECT, CONNACK, AUTH
authentication_data                  0x16   bytes        CONNECT, CONNACK, AUTH
request_problem_information          0x17   byte (0/1)   CONNECT
will_delay_interval                  0x18   u32          Will
request_response_information         0x19   byte (0/1)   CONNECT
response_information                 0x1A   str          CONNACK
server_reference                     0x1C   str          CONNACK, DISCONNECT
reason_string                        0x1F   str          CONNACK, PUBACK..PUBCOMP, SUBACK,
                                                         UNSUBACK, DISCONNECT, AUTH
receive_maximum                      0x21   u16 (>0)     CONNECT, CONNACK
topic_alias_maximum                  0x22   u16          CONNECT, CONNACK
topic_alias                          0x23   u16 (>0)     PUBLISH
maximum_qos                          0x24   byte (0/1)   CONNACK
retain_available                     0x25   byte (0/1)   CONNACK
user_property                        0x26   list of      every packet with properties and Will;
                                            (str, str)   repeatable, order kept, keys may repeat
maximum_packet_size                  0x27   u32 (>0)     CONNECT, CONNACK
wildcard_subscription_available      0x28   byte (0/1)   CONNACK
subscription_identifier_available    0x29   byte (0/1)   CONNACK
shared_subscription_available        0x2A   byte (0/1)   CONNACK
===================================  =====  ===========  =======================================

``subscription_identifier`` is always a list when decoded (it may repeat in PUBLISH);
encoding also accepts a bare int. ``user_property`` is always a list of 2-tuples.

Decoding errors follow the spec: an unknown id, an id not allowed on the packet type, or a
value of the wrong shape is a Malformed Packet (0x81); a repeated single-valued property or
a forbidden value (e.g. Receive Maximum 0) is a Protocol Error (0x82).
"""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

from lightqueue.topic import TopicError, validate_topic_name

from .reason import MALFORMED_PACKET, PROTOCOL_ERROR, TOPIC_ALIAS_INVALID, ProtocolError

Properties = dict[str, Any]

# Packet type numbers (fixed header high nibble). WILL is a pseudo type: the will
# properties inside CONNECT have their own allowed set.
CONNECT, CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP = 1, 2, 3, 4, 5, 6, 7
SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK, PINGREQ, PINGRESP, DISCONNECT, AUTH = range(8, 16)
WILL = 0

# Value kinds.
BYTE, U16, U32, VARINT, STR, BIN, PAIR = range(7)

_ACKS = (PUBACK, PUBREC, PUBREL, PUBCOMP)
_ALL = (CONNECT, CONNACK, PUBLISH, WILL, *_ACKS, SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK,
        DISCONNECT, AUTH)

# id: (name, kind, packet types allowed)
_TABLE: dict[int, tuple[str, int, tuple[int, ...]]] = {
    0x01: ("payload_format_indicator", BYTE, (PUBLISH, WILL)),
    0x02: ("message_expiry_interval", U32, (PUBLISH, WILL)),
    0x03: ("content_type", STR, (PUBLISH, WILL)),
    0x08: ("response_topic", STR, (PUBLISH, WILL)),
    0x09: ("correlation_data", BIN, (PUBLISH, WILL)),
    0x0B: ("subscription_identifier", VARINT, (PUBLISH, SUBSCRIBE)),
    0x11: ("session_expiry_interval", U32, (CONNECT, CONNACK, DISCONNECT)),
    0x12: ("assigned_client_identifier", STR, (CONNACK,)),
    0x13: ("server_keep_alive", U16, (CONNACK,)),
    0x15: ("authentication_method", STR, (CONNECT, CONNACK, AUTH)),
    0x16: ("authentication_data", BIN, (CONNECT, CONNACK, AUTH)),
    0x17: ("request_problem_information", BYTE, (CONNECT,)),
    0x18: ("will_delay_interval", U32, (WILL,)),
    0x19: ("request_response_information", BYTE, (CONNECT,)),
    0x1A: ("response_information", STR, (CONNACK,)),
    0x1C: ("server_reference", STR, (CONNACK, DISCONNECT)),
    0x1F: ("reason_string", STR, (CONNACK, *_ACKS, SUBACK, UNSUBACK, DISCONNECT, AUTH)),
    0x21: ("receive_maximum", U16, (CONNECT, CONNACK)),
    0x22: ("topic_alias_maximum", U16, (CONNECT, CONNACK)),
    0x23: ("topic_alias", U16, (PUBLISH,)),
    0x24: ("maximum_qos", BYTE, (CONNACK,)),
    0x25: ("retain_available", BYTE, (CONNACK,)),
    0x26: ("user_property", PAIR, _ALL),
    0x27: ("maximum_packet_size", U32, (CONNECT, CONNACK)),
    0x28: ("wildcard_subscription_available", BYTE, (CONNACK,)),
    0x29: ("subscription_identifier_available", BYTE, (CONNACK,)),
    0x2A: ("shared_subscription_available", BYTE, (CONNACK,)),
}

# Public views of the table.
PROPERTY_IDS: dict[str, int] = {name: pid for pid, (name, _, _) in _TABLE.items()}
PROPERTY_NAMES: dict[int, str] = {pid: name for pid, (name, _, _) in _TABLE.items()}
ALLOWED: dict[int, frozenset[str]] = {
    ptype: frozenset(name for name, _, types in _TABLE.values() if ptype in types)
    for ptype in _ALL
}

_BOOLEAN = frozenset(
    {"payload_format_indicator", "request_problem_information", "request_response_information",
     "maximum_qos", "retain_available", "wildcard_subscription_available",
     "subscription_identifier_available", "shared_subscription_available"}
)
_NONZERO = frozenset(
    {"receive_maximum", "maximum_packet_size", "topic_alias", "subscription_identifier"}
)
_LISTS = frozenset({"user_property", "subscription_identifier"})
_PER_CONNECTION = frozenset({"topic_alias", "subscription_identifier"})


def publish_properties(props: Properties) -> Properties:
    """A stored message's properties as a PUBLISH carries them. Server apps may attach
    their own (native SEND, the Spark sink): those reach MQTT 5 subscribers as user
    properties after the message's own (the value as is if a string, else as JSON). Topic
    alias and subscription identifiers belong to one connection and one subscriber."""
    allowed = ALLOWED[PUBLISH]
    if all(k in allowed and k not in _PER_CONNECTION for k in props):
        return props  # the common case: as an MQTT client sent it
    out: Properties = {}
    extra: list[tuple[str, str]] = []
    for name, value in props.items():
        if name in _PER_CONNECTION:
            continue
        if name in allowed:
            out[name] = value
        else:
            extra.append((name, value if isinstance(value, str)
                          else json.dumps(value, default=_json_bytes)))
    if extra:
        out["user_property"] = [*out.get("user_property", ()), *extra]
    return out


def _json_bytes(value: Any) -> str:
    if isinstance(value, bytes | bytearray):
        return base64.b64encode(value).decode()
    raise TypeError(f"{type(value).__name__} is not JSON")

# Per packet type: id -> (name, kind), a flat 256-slot list so decoding is one index.
_BY_TYPE: dict[int, list[tuple[str, int] | None]] = {}
for _ptype in _ALL:
    _slots: list[tuple[str, int] | None] = [None] * 256
    for _pid, (_name, _kind, _types) in _TABLE.items():
        if _ptype in _types:
            _slots[_pid] = (_name, _kind)
    _BY_TYPE[_ptype] = _slots

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_u16_from = _U16.unpack_from
_u32_from = _U32.unpack_from
_EMPTY = b"\x00"  # property length 0


def _malformed(msg: str) -> ProtocolError:
    return ProtocolError(MALFORMED_PACKET, msg)


# ---------------------------------------------------------------------------------------
# Shared primitive decoders (also used by codec.py). `data` is bytes; `end` bounds the
# current packet. Each returns (value, new position) and raises ProtocolError only.
# ---------------------------------------------------------------------------------------


def read_varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """A variable byte integer (at most 4 bytes, minimally encoded)."""
    got = varint_or_none(data, pos, end, "variable byte integer")
    if got is None:
        raise _malformed("truncated variable byte integer")
    return got


def varint_or_none(data: bytes, pos: int, end: int, what: str) -> tuple[int, int] | None:
    """`read_varint`, but None when `end` comes first: a stream decoder (codec.py, the
    remaining length) waits for more bytes instead. `what` names it in errors."""
    value = 0
    shift = 0
    for i in range(4):
        if pos >= end:
            return None
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            if b == 0 and i:
                raise _malformed(f"{what} not minimally encoded")
            return value, pos
        shift += 7
    raise _malformed(f"{what} longer than 4 bytes")


def read_str(data: bytes, pos: int, end: int) -> tuple[str, int]:
    """A UTF-8 string: valid UTF-8 (Python's strict codec rejects surrogates), no U+0000."""
    if pos + 2 > end:
        raise _malformed("truncated string length")
    stop = pos + 2 + ((data[pos] << 8) | data[pos + 1])
    if stop > end:
        raise _malformed("truncated string")
    try:
        text = data[pos + 2 : stop].decode("utf-8")
    except UnicodeDecodeError:
        raise _malformed("string is not valid UTF-8") from None
    if "\x00" in text:
        raise _malformed("string contains U+0000")
    return text, stop


def read_bin(data: bytes, pos: int, end: int) -> tuple[bytes, int]:
    if pos + 2 > end:
        raise _malformed("truncated binary data length")
    stop = pos + 2 + ((data[pos] << 8) | data[pos + 1])
    if stop > end:
        raise _malformed("truncated binary data")
    return data[pos + 2 : stop], stop


def decode_properties(data: bytes, pos: int, end: int, ptype: int) -> tuple[Properties, int]:
    """Decode a property block (length + properties) at `pos` for packet type `ptype`."""
    if pos < end and data[pos] == 0:  # the common case: no properties
        return {}, pos + 1
    length, pos = read_varint(data, pos, end)
    stop = pos + length
    if stop > end:
        raise _malformed("property length exceeds packet")
    slots = _BY_TYPE[ptype]
    props: Properties = {}
    while pos < stop:
        pid = data[pos]
        entry = slots[pid]
        if entry is None:
            what = PROPERTY_NAMES.get(pid)
            if what is None:
                raise _malformed(f"unknown property id 0x{pid:02X}")
            raise _malformed(f"property {what} not allowed on this packet type")
        name, kind = entry
        pos += 1
        value: Any
        if kind == BYTE:
            if pos >= stop:
                raise _malformed(f"truncated property {name}")
            value = data[pos]
            pos += 1
        elif kind == U16:
            if pos + 2 > stop:
                raise _malformed(f"truncated property {name}")
            value = _u16_from(data, pos)[0]
            pos += 2
        elif kind == U32:
            if pos + 4 > stop:
                raise _malformed(f"truncated property {name}")
            value = _u32_from(data, pos)[0]
            pos += 4
        elif kind == VARINT:
            value, pos = read_varint(data, pos, stop)
        elif kind == STR:
            value, pos = read_str(data, pos, stop)
        elif kind == BIN:
            value, pos = read_bin(data, pos, stop)
        else:  # PAIR
            key, pos = read_str(data, pos, stop)
            val, pos = read_str(data, pos, stop)
            value = (key, val)
        if name in _LISTS:
            if name in props:
                if ptype != PUBLISH and name == "subscription_identifier":
                    raise ProtocolError(PROTOCOL_ERROR, f"{name} repeated")
                props[name].append(value)
            else:
                props[name] = [value]
        elif name in props:
            raise ProtocolError(PROTOCOL_ERROR, f"{name} repeated")
        else:
            props[name] = value
        if name in _BOOLEAN:
            if value > 1:
                raise ProtocolError(PROTOCOL_ERROR, f"{name} must be 0 or 1")
        elif name in _NONZERO:
            if value == 0:
                # MQTT 5 §3.3.2.3.4: a Topic Alias of 0 is 0x94 Topic Alias invalid.
                code = TOPIC_ALIAS_INVALID if name == "topic_alias" else PROTOCOL_ERROR
                raise ProtocolError(code, f"{name} must not be 0")
        elif name == "response_topic":
            try:
                validate_topic_name(value)
            except TopicError as exc:
                raise ProtocolError(PROTOCOL_ERROR, f"response_topic: {exc}") from None
    if pos != stop:  # a field ran past the property block
        raise _malformed("property overruns property length")
    return props, stop


# ---------------------------------------------------------------------------------------
# Encoding (raises ValueError on anything the spec forbids).
# ---------------------------------------------------------------------------------------

_VARINT_SMALL = [bytes((i,)) for i in range(128)]


def encode_varint(value: int) -> bytes:
    if 0 <= value < 128:
        return _VARINT_SMALL[value]
    if value < 0 or value > 268_435_455:
        raise ValueError(f"variable byte integer out of range: {value}")
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def encode_str(text: str) -> bytes:
    """Length-prefixed UTF-8; rejects U+0000, surrogates and strings over 65535 bytes."""
    if not isinstance(text, str):
        raise ValueError(f"expected str, got {type(text).__name__}")
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"string {text!r} is not encodable as UTF-8 (surrogate?)") from None
    if len(raw) > 65535:
        raise ValueError("string longer than 65535 bytes")
    if "\x00" in text:
        raise ValueError(f"string {text!r} contains U+0000")
    return _U16.pack(len(raw)) + raw


def encode_bin(data: bytes) -> bytes:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ValueError(f"expected bytes, got {type(data).__name__}")
    if len(data) > 65535:
        raise ValueError("binary data longer than 65535 bytes")
    return _U16.pack(len(data)) + bytes(data)


def _int_in(name: str, value: Any, hi: int, lo: int = 0) -> int:
    if not isinstance(value, int) or (isinstance(value, bool) and hi > 1):
        raise ValueError(f"property {name} must be an int, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"property {name} out of range: {value}")
    return value


def _encode_one(pid: int, name: str, kind: int, value: Any) -> bytes:
    lo = 1 if name in _NONZERO else 0
    if kind == BYTE:
        return bytes((pid, _int_in(name, value, 1 if name in _BOOLEAN else 255)))
    if kind == U16:
        return bytes((pid,)) + _U16.pack(_int_in(name, value, 0xFFFF, lo))
    if kind == U32:
        return bytes((pid,)) + _U32.pack(_int_in(name, value, 0xFFFFFFFF, lo))
    if kind == VARINT:
        return bytes((pid,)) + encode_varint(_int_in(name, value, 268_435_455, lo))
    if kind == STR:
        if name == "response_topic":
            try:
                validate_topic_name(value)
            except TopicError as exc:
                raise ValueError(f"response_topic: {exc}") from None
        return bytes((pid,)) + encode_str(value)
    if kind == BIN:
        return bytes((pid,)) + encode_bin(value)
    if not isinstance(value, tuple | list) or len(value) != 2:
        raise ValueError(f"user_property entries must be (key, value) pairs: {value!r}")
    key, val = value
    return bytes((pid,)) + encode_str(key) + encode_str(val)


def encode_properties_body(props: Properties | None, ptype: int) -> bytes:
    """The properties without their length prefix (so callers can append more)."""
    if not props:
        return b""
    allowed = ALLOWED[ptype]
    parts: list[bytes] = []
    for name, value in props.items():
        if name not in allowed:
            if name not in PROPERTY_IDS:
                raise ValueError(f"unknown property {name!r}")
            raise ValueError(f"property {name!r} not allowed on this packet type")
        pid = PROPERTY_IDS[name]
        kind = _TABLE[pid][1]
        if name in _LISTS:
            values = [value] if isinstance(value, int) else list(value)
            if name == "subscription_identifier" and ptype != PUBLISH and len(values) != 1:
                raise ValueError("SUBSCRIBE carries exactly one subscription_identifier")
            parts.extend(_encode_one(pid, name, kind, v) for v in values)
        else:
            parts.append(_encode_one(pid, name, kind, value))
    return b"".join(parts)


def encode_properties(props: Properties | None, ptype: int) -> bytes:
    """A full property block: variable byte integer length, then the properties."""
    if not props:
        return _EMPTY
    body = encode_properties_body(props, ptype)
    return encode_varint(len(body)) + body
