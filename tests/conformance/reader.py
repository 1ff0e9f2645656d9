"""What the Server sends, read with a decoder of the conformance tests' own.

Written from the MQTT 3.1.1 (OASIS Standard, 29 October 2014) and MQTT 5.0 (OASIS
Standard, 7 March 2019) specifications for these tests alone, it shares no code with
`gateway.mqtt`, so a bug in the project's codec cannot hide on both sides of a test: the
tests may encode what they send with that codec, but everything they assert about the
Server's answers comes from here.

It reads one direction, Server to Client, and it is strict: bytes that the specifications
make a Malformed Packet or a Protocol Error when the Server sends them raise `Violation`
(an AssertionError, so the test that met them fails), naming the rule. It does not judge
what a packet means (whether a reason code fits the situation, whether a message should
have been sent): the tests do that.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any


class Violation(AssertionError):
    """The Server sent bytes the specification does not allow."""


# ---------------------------------------------------------------------------------------
# Packets as read. `raw` is the packet's bytes on the wire, fixed header included.
# ---------------------------------------------------------------------------------------


@dataclass
class Received:
    raw: bytes = field(default=b"", kw_only=True, repr=False, compare=False)

    @property
    def size(self) -> int:
        """The packet size as §2.1.4 defines it: fixed header plus Remaining Length."""
        return len(self.raw)


@dataclass
class Connack(Received):
    session_present: bool
    reason_code: int
    properties: dict[str, Any] = field(default_factory=dict)

    @property
    def return_code(self) -> int:
        """The 3.1.1 name of the same byte."""
        return self.reason_code


@dataclass
class Publish(Received):
    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int | None = None
    properties: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Ack(Received):
    packet_id: int
    reason_code: int = 0
    properties: dict[str, Any] = field(default_factory=dict)


@dataclass
class Puback(_Ack):
    pass


@dataclass
class Pubrec(_Ack):
    pass


@dataclass
class Pubrel(_Ack):
    pass


@dataclass
class Pubcomp(_Ack):
    pass


@dataclass
class Suback(Received):
    packet_id: int
    reason_codes: list[int]
    properties: dict[str, Any] = field(default_factory=dict)


@dataclass
class Unsuback(Received):
    packet_id: int
    reason_codes: list[int] = field(default_factory=list)  # none in 3.1.1
    properties: dict[str, Any] = field(default_factory=dict)


@dataclass
class Pingresp(Received):
    pass


@dataclass
class Disconnect(Received):
    reason_code: int = 0
    properties: dict[str, Any] = field(default_factory=dict)


@dataclass
class Auth(Received):
    reason_code: int = 0
    properties: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------
# The specifications' tables
# ---------------------------------------------------------------------------------------

# Table 2-1 (both versions): the packet type in bits 7-4 of the first byte.
NAMES = {1: "CONNECT", 2: "CONNACK", 3: "PUBLISH", 4: "PUBACK", 5: "PUBREC", 6: "PUBREL",
         7: "PUBCOMP", 8: "SUBSCRIBE", 9: "SUBACK", 10: "UNSUBSCRIBE", 11: "UNSUBACK",
         12: "PINGREQ", 13: "PINGRESP", 14: "DISCONNECT", 15: "AUTH"}
# What flows from Server to Client: 3.1.1 has neither DISCONNECT that way nor AUTH.
FROM_SERVER = {4: {2, 3, 4, 5, 6, 7, 9, 11, 13}, 5: {2, 3, 4, 5, 6, 7, 9, 11, 13, 14, 15}}
# Table 2-2 (5.0) / 2.2 (3.1.1): the fixed flags; PUBLISH's are DUP, QoS, RETAIN.
FLAGS = {2: 0, 4: 0, 5: 0, 6: 0b0010, 7: 0, 9: 0, 11: 0, 13: 0, 14: 0, 15: 0}

# 5.0 reason codes a Server may send, per packet (§3.2.2.2, 3.4.2.1, 3.5.2.1, 3.6.2.1,
# 3.7.2.1, 3.9.3, 3.11.3, 3.14.2.1, 3.15.2.1; the codes marked "Client" are left out).
CONNACK_CODES = frozenset({0x00, 0x80, 0x81, 0x82, 0x83, 0x84, 0x85, 0x86, 0x87, 0x88, 0x89,
                           0x8A, 0x8C, 0x90, 0x95, 0x97, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9F})
PUBACK_CODES = frozenset({0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99})
PUBREL_CODES = frozenset({0x00, 0x92})
SUBACK_CODES = frozenset({0x00, 0x01, 0x02, 0x80, 0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1,
                          0xA2})
UNSUBACK_CODES = frozenset({0x00, 0x11, 0x80, 0x83, 0x87, 0x8F, 0x91})
DISCONNECT_CODES = frozenset({0x00, 0x80, 0x81, 0x82, 0x83, 0x87, 0x89, 0x8B, 0x8D, 0x8E,
                              0x8F, 0x90, 0x93, 0x94, 0x95, 0x96, 0x97, 0x98, 0x99, 0x9A,
                              0x9B, 0x9C, 0x9D, 0x9E, 0x9F, 0xA0, 0xA1, 0xA2})
AUTH_CODES = frozenset({0x00, 0x18})
# 3.1.1: CONNACK return codes 0-5 (Table 3.1), SUBACK return codes (§3.9.3).
CONNACK_RETURN_CODES = frozenset(range(6))
SUBACK_RETURN_CODES = frozenset({0x00, 0x01, 0x02, 0x80})

BYTE, TWO, FOUR, VARINT, STRING, BINARY, PAIR = ("Byte", "Two Byte Integer",
                                                 "Four Byte Integer", "Variable Byte Integer",
                                                 "UTF-8 Encoded String", "Binary Data",
                                                 "UTF-8 String Pair")
ACKS = ("PUBACK", "PUBREC", "PUBREL", "PUBCOMP")
# Table 2-4: identifier -> (name, data type, the packets a Server may put it on).
PROPERTIES: dict[int, tuple[str, str, tuple[str, ...]]] = {
    0x01: ("payload_format_indicator", BYTE, ("PUBLISH",)),
    0x02: ("message_expiry_interval", FOUR, ("PUBLISH",)),
    0x03: ("content_type", STRING, ("PUBLISH",)),
    0x08: ("response_topic", STRING, ("PUBLISH",)),
    0x09: ("correlation_data", BINARY, ("PUBLISH",)),
    0x0B: ("subscription_identifier", VARINT, ("PUBLISH",)),
    0x11: ("session_expiry_interval", FOUR, ("CONNACK", "DISCONNECT")),
    0x12: ("assigned_client_identifier", STRING, ("CONNACK",)),
    0x13: ("server_keep_alive", TWO, ("CONNACK",)),
    0x15: ("authentication_method", STRING, ("CONNACK", "AUTH")),
    0x16: ("authentication_data", BINARY, ("CONNACK", "AUTH")),
    0x17: ("request_problem_information", BYTE, ()),  # CONNECT only
    0x18: ("will_delay_interval", FOUR, ()),  # Will Properties only
    0x19: ("request_response_information", BYTE, ()),  # CONNECT only
    0x1A: ("response_information", STRING, ("CONNACK",)),
    0x1C: ("server_reference", STRING, ("CONNACK", "DISCONNECT")),
    0x1F: ("reason_string", STRING, ("CONNACK", *ACKS, "SUBACK", "UNSUBACK", "DISCONNECT",
                                     "AUTH")),
    0x21: ("receive_maximum", TWO, ("CONNACK",)),
    0x22: ("topic_alias_maximum", TWO, ("CONNACK",)),
    0x23: ("topic_alias", TWO, ("PUBLISH",)),
    0x24: ("maximum_qos", BYTE, ("CONNACK",)),
    0x25: ("retain_available", BYTE, ("CONNACK",)),
    0x26: ("user_property", PAIR, ("CONNACK", "PUBLISH", *ACKS, "SUBACK", "UNSUBACK",
                                   "DISCONNECT", "AUTH")),
    0x27: ("maximum_packet_size", FOUR, ("CONNACK",)),
    0x28: ("wildcard_subscription_available", BYTE, ("CONNACK",)),
    0x29: ("subscription_identifier_available", BYTE, ("CONNACK",)),
    0x2A: ("shared_subscription_available", BYTE, ("CONNACK",)),
}
# Values the text of chapter 3 forbids (a Protocol Error): only 0 or 1, or never 0.
ZERO_OR_ONE = {"payload_format_indicator", "maximum_qos", "retain_available",
               "wildcard_subscription_available", "subscription_identifier_available",
               "shared_subscription_available"}
NOT_ZERO = {"receive_maximum", "maximum_packet_size", "topic_alias",
            "subscription_identifier"}
# Only these may appear more than once; Subscription Identifier only in PUBLISH (§3.3.4).
REPEATABLE = {"user_property", "subscription_identifier"}


# ---------------------------------------------------------------------------------------
# Data representation (5.0 §1.5, 3.1.1 §1.5)
# ---------------------------------------------------------------------------------------


def utf8_problem(data: bytes) -> str | None:
    """Why `data` is not a valid MQTT UTF-8 Encoded String body, or None.

    Well-formed UTF-8 is Table 3-7 of the Unicode Standard (RFC 3629 §4): each code point
    in the fewest bytes, no surrogates (U+D800..U+DFFF), nothing above U+10FFFF
    [MQTT-1.5.4-1]; and MQTT forbids U+0000 [MQTT-1.5.4-2]. Non-characters such as U+FFFF
    are well-formed (a receiver MAY refuse them; this one does not), and so is U+FEFF."""
    i, n = 0, len(data)
    while i < n:
        b = data[i]
        if b == 0x00:
            return f"U+0000 at byte {i}"
        if b < 0x80:
            i += 1
            continue
        if 0xC2 <= b <= 0xDF:
            ranges = [(0x80, 0xBF)]
        elif b == 0xE0:
            ranges = [(0xA0, 0xBF), (0x80, 0xBF)]
        elif 0xE1 <= b <= 0xEC or 0xEE <= b <= 0xEF:
            ranges = [(0x80, 0xBF), (0x80, 0xBF)]
        elif b == 0xED:
            ranges = [(0x80, 0x9F), (0x80, 0xBF)]  # A0..BF would be a surrogate
        elif b == 0xF0:
            ranges = [(0x90, 0xBF), (0x80, 0xBF), (0x80, 0xBF)]
        elif 0xF1 <= b <= 0xF3:
            ranges = [(0x80, 0xBF)] * 3
        elif b == 0xF4:
            ranges = [(0x80, 0x8F), (0x80, 0xBF), (0x80, 0xBF)]
        else:
            return f"byte 0x{b:02X} at {i} starts no well-formed sequence"
        for k, (lo, hi) in enumerate(ranges, 1):
            if i + k >= n or not lo <= data[i + k] <= hi:
                return f"ill-formed sequence at byte {i}"
        i += 1 + len(ranges)
    return None


def varint_bytes(value: int) -> bytes:
    """§1.5.5's encoding (for tests that build packets by hand)."""
    out = bytearray()
    while True:
        value, digit = divmod(value, 128)
        out.append(digit | (0x80 if value else 0))
        if not value:
            return bytes(out)


class _Fields:
    """Reads §1.5's data types from one packet body; never past its end."""

    def __init__(self, data: bytes, what: str) -> None:
        self.data, self.pos, self.what = data, 0, what

    def fail(self, why: str) -> Violation:
        return Violation(f"{self.what}: {why} (bytes {self.data.hex(' ')})")

    def left(self) -> int:
        return len(self.data) - self.pos

    def take(self, n: int, name: str) -> bytes:
        if self.left() < n:
            raise self.fail(f"{name} runs past the end of the packet")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def byte(self, name: str) -> int:
        return self.take(1, name)[0]

    def two(self, name: str) -> int:
        return struct.unpack("!H", self.take(2, name))[0]

    def four(self, name: str) -> int:
        return struct.unpack("!I", self.take(4, name))[0]

    def varint(self, name: str) -> int:
        value, raw = read_varint(self.data, self.pos)
        if value is None:
            raise self.fail(f"{name} runs past the end of the packet")
        self.pos += raw
        return value

    def binary(self, name: str) -> bytes:
        return self.take(self.two(f"{name} length"), name)

    def string(self, name: str) -> str:
        body = self.binary(name)
        problem = utf8_problem(body)
        if problem is not None:
            raise self.fail(f"{name} is not a valid UTF-8 Encoded String: {problem} "
                            "[MQTT-1.5.4-1, MQTT-1.5.4-2]")
        return body.decode("utf-8")

    def packet_id(self) -> int:
        pid = self.two("Packet Identifier")
        if pid == 0:
            raise self.fail("Packet Identifier 0 [MQTT-2.2.1-4, MQTT-2.2.1-5]")
        return pid

    def end(self) -> None:
        if self.left():
            raise self.fail(f"{self.left()} bytes left over after the packet's fields")

    def properties(self, packet: str) -> dict[str, Any]:
        """A property block (§2.2.2) on `packet`, by identifier and data type."""
        length = self.varint("Property Length")
        if length > self.left():
            raise self.fail("Property Length runs past the end of the packet")
        stop = self.pos + length
        props: dict[str, Any] = {}
        while self.pos < stop:
            ident = self.varint("Property Identifier")
            if ident not in PROPERTIES:
                raise self.fail(f"unknown property identifier 0x{ident:02X} (§2.2.2.2)")
            name, kind, packets = PROPERTIES[ident]
            if packet not in packets:
                raise self.fail(f"property {name} is not valid on {packet} (§2.2.2.2)")
            if name in props and name not in REPEATABLE:
                raise self.fail(f"property {name} more than once (a Protocol Error)")
            value: Any
            if kind == BYTE:
                value = self.byte(name)
            elif kind == TWO:
                value = self.two(name)
            elif kind == FOUR:
                value = self.four(name)
            elif kind == VARINT:
                value = self.varint(name)
            elif kind == STRING:
                value = self.string(name)
            elif kind == BINARY:
                value = self.binary(name)
            else:  # §1.5.7: both strings follow the rules of §1.5.4 [MQTT-1.5.7-1]
                value = (self.string(f"{name} name"), self.string(f"{name} value"))
            if self.pos > stop:
                raise self.fail(f"property {name} runs past the Property Length")
            if name in ZERO_OR_ONE and value not in (0, 1):
                raise self.fail(f"{name} is {value}: only 0 or 1 are allowed")
            if name in NOT_ZERO and value == 0:
                raise self.fail(f"{name} 0 is not allowed")
            if name in REPEATABLE:
                props.setdefault(name, []).append(value)
            else:
                props[name] = value
        return props


def read_varint(data: bytes, pos: int) -> tuple[int | None, int]:
    """A Variable Byte Integer at `pos`: (value, bytes used), or (None, 0) when `data`
    ends first. At most four bytes, the fewest that hold the value [MQTT-1.5.5-1]."""
    value = 0
    for i in range(4):
        if pos + i >= len(data):
            return None, 0
        b = data[pos + i]
        value |= (b & 0x7F) << (7 * i)
        if not b & 0x80:
            if i and b == 0:
                raise Violation(f"Variable Byte Integer {data[pos:pos + i + 1].hex(' ')} is "
                                "not in the fewest bytes [MQTT-1.5.5-1]")
            return value, i + 1
    raise Violation(f"Variable Byte Integer {data[pos:pos + 4].hex(' ')}... is longer than "
                    "four bytes (§1.5.5)")


def _topic_name(f: _Fields, name: str, topic: str, empty_ok: bool = False) -> str:
    if "+" in topic or "#" in topic:
        raise f.fail(f"{name} {topic!r} has a wildcard [MQTT-3.3.2-2, MQTT-4.7.0-1]")
    if not topic and not empty_ok:
        raise f.fail(f"empty {name} [MQTT-4.7.3-1]")
    return topic


# ---------------------------------------------------------------------------------------
# Packets (chapter 3 of each version)
# ---------------------------------------------------------------------------------------


def _connack(f: _Fields, flags: int, v: int) -> Connack:
    ack = f.byte("Connect Acknowledge Flags")
    if ack & 0xFE:
        raise f.fail("reserved Connect Acknowledge Flags bits set [MQTT-3.2.2-1]")
    code = f.byte("Connect Reason Code")
    if v == 5:
        if code not in CONNACK_CODES:
            raise f.fail(f"0x{code:02X} is not a CONNACK Reason Code [MQTT-3.2.2-8]")
        props = f.properties("CONNACK")
    else:
        if code not in CONNACK_RETURN_CODES:
            raise f.fail(f"{code} is not a CONNACK return code (3.1.1 Table 3.1)")
        props = {}
    f.end()
    if ack and code:
        raise f.fail("Session Present 1 on a refusing CONNACK "
                     "[MQTT-3.2.2-6; 3.1.1: MQTT-3.2.2-4]")
    return Connack(bool(ack), code, props)


def _publish(f: _Fields, flags: int, v: int) -> Publish:
    dup, qos, retain = bool(flags & 0x08), (flags >> 1) & 0x03, bool(flags & 0x01)
    if qos == 3:
        raise f.fail("PUBLISH with both QoS bits set [MQTT-3.3.1-4]")
    if dup and qos == 0:
        raise f.fail("DUP 1 on a QoS 0 PUBLISH [MQTT-3.3.1-2]")
    topic = _topic_name(f, "Topic Name", f.string("Topic Name"), empty_ok=v == 5)
    pid = f.packet_id() if qos else None
    props: dict[str, Any] = {}
    if v == 5:
        props = f.properties("PUBLISH")
        if not topic and "topic_alias" not in props:
            raise f.fail("empty Topic Name without a Topic Alias (§3.3.2.1)")
        if "response_topic" in props:  # a Topic Name too [MQTT-3.3.2-14]
            _topic_name(f, "Response Topic", props["response_topic"])
    return Publish(topic, f.take(f.left(), "payload"), qos, retain, dup, pid, props)


def _ack(cls: type, codes: frozenset[int]) -> Any:
    name = cls.__name__.upper()

    def read(f: _Fields, flags: int, v: int) -> Any:
        pid = f.packet_id()
        if v != 5 or not f.left():  # 5.0: the code and properties may be left out
            f.end()
            return cls(pid)
        code = f.byte("Reason Code")
        if code not in codes:
            raise f.fail(f"0x{code:02X} is not a Reason Code of {name}")
        props = f.properties(name) if f.left() else {}  # §3.4.2.2.1: under 4 bytes, none
        f.end()
        return cls(pid, code, props)

    return read


def _suback(f: _Fields, flags: int, v: int) -> Suback:
    pid = f.packet_id()
    props = f.properties("SUBACK") if v == 5 else {}
    codes = list(f.take(f.left(), "Reason Codes"))
    if not codes:
        raise f.fail("SUBACK without a Reason Code [MQTT-3.8.4-6]")
    valid = SUBACK_CODES if v == 5 else SUBACK_RETURN_CODES
    for code in codes:
        if code not in valid:
            raise f.fail(f"0x{code:02X} is not a SUBACK code [MQTT-3.9.3-2]")
    return Suback(pid, codes, props)


def _unsuback(f: _Fields, flags: int, v: int) -> Unsuback:
    pid = f.packet_id()
    if v != 5:
        f.end()  # 3.1.1: the Packet Identifier alone
        return Unsuback(pid)
    props = f.properties("UNSUBACK")
    codes = list(f.take(f.left(), "Reason Codes"))
    if not codes:
        raise f.fail("UNSUBACK without a Reason Code (§3.11.3)")
    for code in codes:
        if code not in UNSUBACK_CODES:
            raise f.fail(f"0x{code:02X} is not an UNSUBACK Reason Code [MQTT-3.11.3-2]")
    return Unsuback(pid, codes, props)


def _pingresp(f: _Fields, flags: int, v: int) -> Pingresp:
    f.end()
    return Pingresp()


def _coded(cls: type, codes: frozenset[int]) -> Any:
    """DISCONNECT and AUTH: with Remaining Length 0 the code is 0x00 and there are no
    properties; with 1, a code alone (§3.14.2.2.1)."""
    name = cls.__name__.upper()

    def read(f: _Fields, flags: int, v: int) -> Any:
        if not f.left():
            return cls()
        code = f.byte("Reason Code")
        if code not in codes:
            raise f.fail(f"0x{code:02X} is not a Reason Code the Server may send on {name}")
        props = f.properties(name) if f.left() else {}
        f.end()
        return cls(code, props)

    return read


READERS = {2: _connack, 3: _publish, 4: _ack(Puback, PUBACK_CODES),
           5: _ack(Pubrec, PUBACK_CODES), 6: _ack(Pubrel, PUBREL_CODES),
           7: _ack(Pubcomp, PUBREL_CODES), 9: _suback, 11: _unsuback, 13: _pingresp,
           14: _coded(Disconnect, DISCONNECT_CODES), 15: _coded(Auth, AUTH_CODES)}


class Reader:
    """The packets in a byte stream from the Server to a Client of protocol level
    `version` (4: MQTT 3.1.1, 5: MQTT 5.0), however the stream is cut into pieces.
    After a Violation it reads nothing more: every later `feed` raises it again."""

    def __init__(self, version: int) -> None:
        if version not in (4, 5):
            raise ValueError("MQTT 3.1.1 (4) or 5.0 (5)")
        self.version = version
        self.buf = b""
        self.error: Violation | None = None

    def feed(self, data: bytes) -> list[Received]:
        if self.error is not None:
            raise self.error
        self.buf += data
        out: list[Received] = []
        try:
            while True:
                packet = self._next()
                if packet is None:
                    return out
                out.append(packet)
        except Violation as exc:
            self.error = exc
            exc.packets = out  # type: ignore[attr-defined]  # those read before it
            raise

    def _next(self) -> Received | None:
        buf, v = self.buf, self.version
        if len(buf) < 2:
            return None
        ptype, flags = buf[0] >> 4, buf[0] & 0x0F
        if ptype not in FROM_SERVER[v]:
            what = NAMES.get(ptype, "the reserved packet type 0")
            raise Violation(f"a Server does not send {what} (MQTT {'5.0' if v == 5 else '3.1.1'}"
                            f" §2.1.2): bytes {buf[:16].hex(' ')}")
        if ptype != 3 and flags != FLAGS[ptype]:
            raise Violation(f"{NAMES[ptype]} with fixed header flags {flags:04b}, not "
                            f"{FLAGS[ptype]:04b} [MQTT-2.1.3-1; 3.1.1: MQTT-2.2.2-1]")
        length, used = read_varint(buf, 1)
        if length is None or len(buf) < 1 + used + length:
            return None
        end = 1 + used + length
        raw, self.buf = buf[:end], buf[end:]
        fields = _Fields(raw[1 + used:], NAMES[ptype])
        packet = READERS[ptype](fields, flags, v)
        packet.raw = raw
        return packet
