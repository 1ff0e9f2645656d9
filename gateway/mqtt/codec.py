"""Sans-IO MQTT codec for protocol levels 3 (3.1), 4 (3.1.1) and 5 (5.0).

Bytes in, packets out (`Decoder.feed`); packets in, bytes out (`encode`, `encode_publish`,
`PublishTemplate`). No sockets, no clock: the connection state machine owns those.

Decoding is strict: any violation raises `ProtocolError(reason_code, message)` and
nothing else, whatever the input (the fuzz tests hold us to that). Encoding validates
its input too and raises `ValueError`, so a broker bug cannot put a malformed packet on
the wire.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from typing import Any

from lightqueue.since import REPLAY_PREFIX
from lightqueue.topic import TopicError, validate_topic_filter, validate_topic_name

from .packets import (
    BRIDGE_BIT,
    PROTOCOL_NAMES,
    Auth,
    Connack,
    Connect,
    Disconnect,
    Packet,
    Pingreq,
    Pingresp,
    Properties,
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
)
from .properties import (
    AUTH,
    CONNACK,
    CONNECT,
    DISCONNECT,
    PINGREQ,
    PINGRESP,
    PUBACK,
    PUBCOMP,
    PUBLISH,
    PUBREC,
    PUBREL,
    SUBACK,
    SUBSCRIBE,
    UNSUBACK,
    UNSUBSCRIBE,
    WILL,
    decode_properties,
    encode_bin,
    encode_properties,
    encode_properties_body,
    encode_str,
    encode_varint,
    read_bin,
    read_str,
    varint_or_none,
)
from .reason import (
    AUTH_REASONS,
    CONNACK_REASONS,
    CONNACK_V3_RETURN_CODES,
    DISCONNECT_REASONS,
    MALFORMED_PACKET,
    PACKET_TOO_LARGE,
    PROTOCOL_ERROR,
    PUBACK_REASONS,
    PUBREL_REASONS,
    SUBACK_REASONS,
    SUBACK_V3_RETURN_CODES,
    TOPIC_FILTER_INVALID,
    TOPIC_NAME_INVALID,
    UNSUBACK_REASONS,
    ProtocolError,
    UnsupportedProtocolError,
)

__all__ = [
    "MAX_PACKET_SIZE",
    "Decoder",
    "ProtocolError",
    "PublishTemplate",
    "UnsupportedProtocolError",
    "encode",
    "encode_publish",
]

MAX_REMAINING_LENGTH = 268_435_455
# Default limit on a whole packet (fixed header included), as the v5 Maximum Packet Size.
MAX_PACKET_SIZE = 268_435_455
VERSIONS = (3, 4, 5)

_U16 = struct.Struct(">H")
_u16_pack = _U16.pack
_u16_from = _U16.unpack_from
_HEAD1 = struct.Struct(">BBH")  # fixed header with 1-byte remaining length + topic length
_HEAD2 = struct.Struct(">BBBH")  # ... with 2-byte remaining length
_ACK = struct.Struct(">BBH")  # short-form ack: type/flags, 2, packet id
_ACK_RC = struct.Struct(">BBHB")  # v5 ack with reason code and no properties

# Which packet types each side may receive (bit per type).
_CLIENT_TO_SERVER = sum(1 << t for t in (CONNECT, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP,
                                         SUBSCRIBE, UNSUBSCRIBE, PINGREQ, DISCONNECT))
_SERVER_TO_CLIENT = sum(1 << t for t in (CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP,
                                         SUBACK, UNSUBACK, PINGRESP))


def _accept_mask(server: bool, version: int | None) -> int:
    mask = _CLIENT_TO_SERVER if server else _SERVER_TO_CLIENT
    if version == 5:  # AUTH both ways; DISCONNECT from the server too
        mask |= (1 << AUTH) | (1 << DISCONNECT)
    return mask


def _malformed(msg: str) -> ProtocolError:
    return ProtocolError(MALFORMED_PACKET, msg)


def _protocol(msg: str) -> ProtocolError:
    return ProtocolError(PROTOCOL_ERROR, msg)


def _filter_problem(topic_filter: str) -> str | None:
    """Why `topic_filter` is not a valid filter (including `$share/<name>/<filter>`)."""
    try:
        if topic_filter.startswith(REPLAY_PREFIX):
            # Its <since> may hold a '+' (an RFC 3339 offset): the gateway judges it, and
            # answers a bad one in the SUBACK (0x8F) instead of closing the connection.
            since, sep, rest = topic_filter[len(REPLAY_PREFIX):].partition("/")
            topic_filter = REPLAY_PREFIX + "s" + sep + rest
        validate_topic_filter(topic_filter)
        if topic_filter.startswith("$share/"):
            parts = topic_filter.split("/", 2)
            if len(parts) < 3 or not parts[1] or "+" in parts[1] or "#" in parts[1]:
                return f"bad shared subscription {topic_filter!r}"
            validate_topic_filter(parts[2])
    except TopicError as exc:
        return str(exc)
    return None


def _check_filter(topic_filter: str) -> None:
    problem = _filter_problem(topic_filter)
    if problem is not None:
        raise ProtocolError(TOPIC_FILTER_INVALID, problem)


# ---------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------


class Decoder:
    """Streaming decoder for one connection: ``feed(bytes) -> list[packet]``.

    A server decoder (the default) learns the protocol version from the first packet,
    which must be CONNECT. A client decoder must be told the version it connected with.
    Packets may be split across any chunk boundaries and a chunk may hold many packets.
    Buffering is linear: a partial packet is appended to a bytearray and only re-parsed
    once enough bytes have arrived to complete it.

    After a ProtocolError the decoder is dead: every later `feed` re-raises it.
    """

    __slots__ = ("max_packet_size", "first_packet_max", "server", "version", "connect_level",
                 "_buf", "_need", "_error", "_topics")

    def __init__(
        self,
        max_packet_size: int = MAX_PACKET_SIZE,
        server: bool = True,
        version: int | None = None,
        first_packet_max: int | None = None,
    ) -> None:
        if version is not None and version not in VERSIONS:
            raise ValueError(f"unsupported protocol version {version}")
        if not server and version is None:
            raise ValueError("a client-side decoder needs the protocol version")
        self.max_packet_size = max_packet_size
        # A server's limit until CONNECT is decoded: before it, nobody is authenticated,
        # so a stranger may not make the server buffer a full-size packet.
        self.first_packet_max = min(first_packet_max or max_packet_size, max_packet_size)
        self.server = server
        # None until CONNECT is decoded (server side). Giving it to a server decoder means
        # the CONNECT was handled elsewhere.
        self.version = version
        # The protocol level of a CONNECT that failed to decode, once read: the server's
        # CONNACK with the reason code must be in that version (MQTT 5 §3.2.2.2).
        self.connect_level: int | None = None
        self._buf = bytearray()
        # Devices publish on a few topics again and again: the checked ones, by their
        # bytes (made on the first PUBLISH: an idle connection pays nothing).
        self._topics: dict[bytes, str] | None = None
        self._need = 0  # total buffered bytes needed before parsing is worth retrying
        self._error: ProtocolError | None = None

    @property
    def error(self) -> ProtocolError | None:
        """The violation that stopped this decoder, if one did (feed raises it again)."""
        return self._error

    @property
    def buffered(self) -> int:
        """Bytes of an incomplete packet held until the rest arrives."""
        return len(self._buf)

    def take_buffered(self) -> bytes:
        """The incomplete packet held, let go (for the native plane, which goes on
        parsing from it: gateway.handover)."""
        data = bytes(self._buf)
        self._buf.clear()
        self._need = 0
        return data

    def feed(self, data: bytes | bytearray | memoryview) -> list[Packet]:
        if self._error is not None:
            raise self._error
        if type(data) is not bytes:
            data = bytes(data)
        buf = self._buf
        if buf:
            buf += data
            if len(buf) < self._need:
                return []
            data = bytes(buf)
            buf.clear()
        out: list[Packet] = []
        try:
            self._parse(data, out)
        except ProtocolError as exc:
            exc.packets = list(out)
            self._error = exc
            raise
        return out

    def _parse(self, data: bytes, out: list[Packet]) -> None:
        n = len(data)
        pos = 0
        server = self.server
        version = self.version
        mask = _accept_mask(server, version)
        max_size = self.max_packet_size if version is not None else self.first_packet_max
        decoders = _DECODERS
        while pos < n:
            b0 = data[pos]
            p = pos + 1
            if p >= n:
                self._stash(data, pos, 2)
                return
            rl = data[p]
            p += 1
            if rl >= 0x80:
                got = varint_or_none(data, p - 1, n, "remaining length")
                if got is None:
                    self._stash(data, pos, n - pos + 1)
                    return
                rl, p = got
            ptype = b0 >> 4
            if not (mask >> ptype) & 1:
                if ptype == 0 or (ptype == AUTH and version != 5):
                    raise _malformed(f"reserved packet type {ptype}")
                if version is None and server:
                    raise _protocol("the first packet must be CONNECT")
                raise _protocol(f"packet type {ptype} not allowed in this direction")
            if version is None and server and ptype != CONNECT:
                raise _protocol("the first packet must be CONNECT")
            end = p + rl
            if end - pos > max_size:
                if version is None and server:
                    self.connect_level = _peek_level(data, p, n)
                raise ProtocolError(
                    PACKET_TOO_LARGE, f"packet of {end - pos} bytes exceeds {max_size}"
                )
            if end > n:
                self._stash(data, pos, end - pos)
                return
            out.append(decoders[ptype](self, b0 & 0x0F, data, p, end))
            if ptype == CONNECT:
                version = self.version
                mask = _accept_mask(server, version)
                max_size = self.max_packet_size
            pos = end

    def _check_topic(self, raw: bytes, topic: str) -> None:
        if "\x00" in topic:
            raise _malformed("topic contains U+0000")
        if not topic:
            raise _protocol("empty topic name without a topic alias")
        try:
            validate_topic_name(topic)
        except TopicError as exc:
            raise ProtocolError(TOPIC_NAME_INVALID, str(exc)) from None
        if self._topics is None:
            self._topics = {}
        if len(self._topics) < 64:
            self._topics[raw] = topic

    def _stash(self, data: bytes, pos: int, need: int) -> None:
        self._buf += memoryview(data)[pos:]
        self._need = need

    # -- per packet type; each gets the fixed-header flags and data[p:end] as the body --

    def _connect(self, flags: int, data: bytes, p: int, end: int) -> Connect:
        if flags:
            raise _malformed("CONNECT flags must be 0")
        if self.version is not None:
            raise _protocol("second CONNECT on one connection")
        name, p = read_str(data, p, end)
        if p >= end:
            raise _malformed("truncated CONNECT")
        level = data[p]
        bridge = level in _BRIDGE_LEVELS
        if bridge:
            level &= ~BRIDGE_BIT
        if PROTOCOL_NAMES.get(level) != name:
            raise UnsupportedProtocolError(name, data[p])
        self.connect_level = level
        if p + 4 > end:
            raise _malformed("truncated CONNECT")
        cflags = data[p + 1]
        keepalive = _u16_from(data, p + 2)[0]
        p += 4
        if cflags & 0x01:
            raise _malformed("reserved CONNECT flag set")
        will_flag = cflags & 0x04
        will_qos = (cflags >> 3) & 3
        will_retain = bool(cflags & 0x20)
        has_password = cflags & 0x40
        has_username = cflags & 0x80
        if will_qos == 3:
            raise _malformed("will QoS 3")
        if not will_flag and (will_qos or will_retain):
            raise _malformed("will QoS/retain set without will flag")
        if level < 5 and has_password and not has_username:
            raise _malformed("password without user name")
        props: Properties = {}
        if level == 5:
            props, p = decode_properties(data, p, end, CONNECT)
            if "authentication_data" in props and "authentication_method" not in props:
                raise _protocol("authentication_data without authentication_method")
        client_id, p = read_str(data, p, end)
        will = None
        if will_flag:
            will_props: Properties = {}
            if level == 5:
                will_props, p = decode_properties(data, p, end, WILL)
            try:
                will_topic, p = read_str(data, p, end)
            except ProtocolError as exc:
                # Ill-formed UTF-8 or U+0000 makes the packet malformed (MQTT 5 §1.5.4),
                # 0x81; 0x90 is for a will topic that is well-formed but not accepted.
                raise ProtocolError(exc.reason_code, f"will topic: {exc.message}") from None
            try:
                validate_topic_name(will_topic)
            except TopicError as exc:
                raise ProtocolError(TOPIC_NAME_INVALID, f"will topic: {exc}") from None
            will_payload, p = read_bin(data, p, end)
            will = Will(will_topic, will_payload, will_qos, will_retain, will_props)
        username = password = None
        if has_username:
            username, p = read_str(data, p, end)
        if has_password:
            password, p = read_bin(data, p, end)
        if p != end:
            raise _malformed("trailing bytes after CONNECT payload")
        self.version = level
        return Connect(client_id, level, name, bool(cflags & 0x02), keepalive, username,
                       password, will, props, bridge)

    def _connack(self, flags: int, data: bytes, p: int, end: int) -> Connack:
        if flags:
            raise _malformed("CONNACK flags must be 0")
        if p + 2 > end:
            raise _malformed("truncated CONNACK")
        ack_flags = data[p]
        code = data[p + 1]
        p += 2
        if ack_flags & 0xFE:
            raise _malformed("reserved CONNACK flags set")
        props: Properties = {}
        if self.version == 5:
            if code not in CONNACK_REASONS:
                raise _protocol(f"invalid CONNACK reason code 0x{code:02X}")
            props, p = decode_properties(data, p, end, CONNACK)
            if "authentication_data" in props and "authentication_method" not in props:
                raise _protocol("authentication_data without authentication_method")
        elif code not in CONNACK_V3_RETURN_CODES:
            raise _protocol(f"invalid CONNACK return code {code}")
        if p != end:
            raise _malformed("trailing bytes after CONNACK")
        if ack_flags and code:
            raise _protocol("session present with a failed CONNACK")
        return Connack(bool(ack_flags), code, props)

    def _publish(self, flags: int, data: bytes, p: int, end: int) -> Publish:
        qos = (flags >> 1) & 3
        if qos == 3:
            raise _malformed("PUBLISH with QoS 3")
        if p + 2 > end:
            raise _malformed("truncated PUBLISH topic")
        stop = p + 2 + ((data[p] << 8) | data[p + 1])
        if stop > end:
            raise _malformed("truncated PUBLISH topic")
        raw = data[p + 2 : stop]
        topics = self._topics
        topic = topics.get(raw) if topics is not None else None
        checked = topic is not None
        if not checked:
            try:
                topic = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise _malformed("topic is not valid UTF-8") from None
        p = stop
        if qos:
            if p + 2 > end:
                raise _malformed("truncated PUBLISH packet id")
            packet_id: int | None = (data[p] << 8) | data[p + 1]
            if not packet_id:
                raise _protocol("packet id 0")
            p += 2
        else:
            if flags & 0x08:
                raise _malformed("DUP set on a QoS 0 PUBLISH")
            packet_id = None
        if self.version == 5:
            props, p = decode_properties(data, p, end, PUBLISH)
            if props:
                if self.server and "subscription_identifier" in props:
                    raise _protocol("subscription_identifier in a PUBLISH from a client")
                if not topic and "topic_alias" in props:
                    return Publish(topic, data[p:end], qos, bool(flags & 1), bool(flags & 8),
                                   packet_id, props)
        else:
            props = {}
        if not checked:
            self._check_topic(raw, topic)
        return Publish(topic, data[p:end], qos, bool(flags & 1), bool(flags & 8), packet_id,
                       props)

    def _subscribe(self, flags: int, data: bytes, p: int, end: int) -> Subscribe:
        if flags != 0x02:
            raise _malformed("SUBSCRIBE flags must be 0b0010")
        packet_id, p = _packet_id(data, p, end)
        v5 = self.version == 5
        props: Properties = {}
        if v5:
            props, p = decode_properties(data, p, end, SUBSCRIBE)
        subs: list[tuple[str, SubscriptionOptions]] = []
        while p < end:
            topic_filter, p = read_str(data, p, end)
            if p >= end:
                raise _malformed("missing subscription options")
            opts = data[p]
            p += 1
            qos = opts & 3
            if qos == 3:
                raise _malformed("subscription QoS 3")
            if v5:
                if opts & 0xC0:
                    raise _malformed("reserved subscription option bits set")
                retain_handling = (opts >> 4) & 3
                if retain_handling == 3:
                    raise _protocol("retain handling 3")
                no_local = bool(opts & 0x04)
                if no_local and topic_filter.startswith("$share/"):
                    raise _protocol("no_local on a shared subscription")
                options = SubscriptionOptions(qos, no_local, bool(opts & 0x08), retain_handling)
            else:
                if opts & 0xFC:
                    raise _malformed("reserved subscription option bits set")
                options = _QOS_OPTIONS[qos]
            _check_filter(topic_filter)
            subs.append((topic_filter, options))
        if not subs:
            raise _protocol("SUBSCRIBE without subscriptions")
        return Subscribe(packet_id, subs, props)

    def _suback(self, flags: int, data: bytes, p: int, end: int) -> Suback:
        if flags:
            raise _malformed("SUBACK flags must be 0")
        packet_id, p = _packet_id(data, p, end)
        props: Properties = {}
        valid = SUBACK_V3_RETURN_CODES
        if self.version == 5:
            props, p = decode_properties(data, p, end, SUBACK)
            valid = SUBACK_REASONS
        codes = list(data[p:end])
        if not codes:
            raise _protocol("SUBACK without reason codes")
        for code in codes:
            if code not in valid:
                raise _protocol(f"invalid SUBACK reason code 0x{code:02X}")
        return Suback(packet_id, codes, props)

    def _unsubscribe(self, flags: int, data: bytes, p: int, end: int) -> Unsubscribe:
        if flags != 0x02:
            raise _malformed("UNSUBSCRIBE flags must be 0b0010")
        packet_id, p = _packet_id(data, p, end)
        props: Properties = {}
        if self.version == 5:
            props, p = decode_properties(data, p, end, UNSUBSCRIBE)
        filters: list[str] = []
        while p < end:
            topic_filter, p = read_str(data, p, end)
            _check_filter(topic_filter)
            filters.append(topic_filter)
        if not filters:
            raise _protocol("UNSUBSCRIBE without topic filters")
        return Unsubscribe(packet_id, filters, props)

    def _unsuback(self, flags: int, data: bytes, p: int, end: int) -> Unsuback:
        if flags:
            raise _malformed("UNSUBACK flags must be 0")
        packet_id, p = _packet_id(data, p, end)
        if self.version != 5:
            if p != end:
                raise _malformed("trailing bytes after UNSUBACK")
            return Unsuback(packet_id)
        props, p = decode_properties(data, p, end, UNSUBACK)
        codes = list(data[p:end])
        if not codes:
            raise _protocol("UNSUBACK without reason codes")
        for code in codes:
            if code not in UNSUBACK_REASONS:
                raise _protocol(f"invalid UNSUBACK reason code 0x{code:02X}")
        return Unsuback(packet_id, codes, props)

    def _pingreq(self, flags: int, data: bytes, p: int, end: int) -> Pingreq:
        if flags or p != end:
            raise _malformed("PINGREQ must be exactly c0 00")
        return Pingreq()

    def _pingresp(self, flags: int, data: bytes, p: int, end: int) -> Pingresp:
        if flags or p != end:
            raise _malformed("PINGRESP must be exactly d0 00")
        return Pingresp()

    def _disconnect(self, flags: int, data: bytes, p: int, end: int) -> Disconnect:
        if flags:
            raise _malformed("DISCONNECT flags must be 0")
        if p == end:
            return Disconnect()
        if self.version != 5:
            raise _malformed("DISCONNECT must have no body before MQTT 5")
        code = data[p]
        if code not in DISCONNECT_REASONS:
            raise _protocol(f"invalid DISCONNECT reason code 0x{code:02X}")
        props: Properties = {}
        if p + 1 < end:
            props, p = decode_properties(data, p + 1, end, DISCONNECT)
            if p != end:
                raise _malformed("trailing bytes after DISCONNECT")
            if not self.server and "session_expiry_interval" in props:
                raise _protocol("session_expiry_interval in a DISCONNECT from the server")
        return Disconnect(code, props)

    def _auth(self, flags: int, data: bytes, p: int, end: int) -> Auth:
        if flags:
            raise _malformed("AUTH flags must be 0")
        if p == end:
            return Auth()
        code = data[p]
        if code not in AUTH_REASONS:
            raise _protocol(f"invalid AUTH reason code 0x{code:02X}")
        props: Properties = {}
        if p + 1 < end:
            props, p = decode_properties(data, p + 1, end, AUTH)
            if p != end:
                raise _malformed("trailing bytes after AUTH")
            if "authentication_data" in props and "authentication_method" not in props:
                raise _protocol("authentication_data without authentication_method")
        return Auth(code, props)


# 3.1 and 3.1.1 with the bridge bit; a 5.0 CONNECT with it stays an unsupported level.
_BRIDGE_LEVELS = (BRIDGE_BIT | 3, BRIDGE_BIT | 4)
_QOS_OPTIONS = (SubscriptionOptions(0), SubscriptionOptions(1), SubscriptionOptions(2))


def _peek_level(data: bytes, p: int, n: int) -> int | None:
    """The protocol level of a CONNECT body at `p`, if its start is there and valid."""
    try:
        name, q = read_str(data, p, n)
    except ProtocolError:
        return None
    level = data[q] if q < n else None
    return level if level is not None and PROTOCOL_NAMES.get(level) == name else None


def _packet_id(data: bytes, p: int, end: int) -> tuple[int, int]:
    if p + 2 > end:
        raise _malformed("truncated packet id")
    packet_id = (data[p] << 8) | data[p + 1]
    if not packet_id:
        raise _protocol("packet id 0")
    return packet_id, p + 2


_Dec = Callable[[Decoder, int, bytes, int, int], Any]


def _ack_decoder(cls: type, ptype: int, want_flags: int, reasons: frozenset[int]) -> _Dec:
    """PUBACK/PUBREC/PUBREL/PUBCOMP: v5 may drop the reason code and/or properties."""

    def decode(self: Decoder, flags: int, data: bytes, p: int, end: int) -> Any:
        if flags != want_flags:
            raise _malformed(f"{cls.__name__.upper()} flags must be {want_flags:#06b}")
        size = end - p
        if size < 2:
            raise _malformed("truncated packet id")
        packet_id = (data[p] << 8) | data[p + 1]
        if not packet_id:
            raise _protocol("packet id 0")
        if size == 2:
            return cls(packet_id)
        if self.version != 5:
            raise _malformed(f"{cls.__name__.upper()} longer than 2 bytes before MQTT 5")
        code = data[p + 2]
        if code not in reasons:
            raise _protocol(f"invalid {cls.__name__.upper()} reason code 0x{code:02X}")
        if size == 3:
            return cls(packet_id, code)
        props, q = decode_properties(data, p + 3, end, ptype)
        if q != end:
            raise _malformed(f"trailing bytes after {cls.__name__.upper()}")
        return cls(packet_id, code, props)

    return decode


def _reserved(self: Decoder, flags: int, data: bytes, p: int, end: int) -> Any:
    raise _malformed("reserved packet type")  # unreachable: the accept mask rejects it first


_DECODERS: list[_Dec] = [
    _reserved,
    Decoder._connect,
    Decoder._connack,
    Decoder._publish,
    _ack_decoder(Puback, PUBACK, 0, PUBACK_REASONS),
    _ack_decoder(Pubrec, PUBREC, 0, PUBACK_REASONS),
    _ack_decoder(Pubrel, PUBREL, 2, PUBREL_REASONS),
    _ack_decoder(Pubcomp, PUBCOMP, 0, PUBREL_REASONS),
    Decoder._subscribe,
    Decoder._suback,
    Decoder._unsubscribe,
    Decoder._unsuback,
    Decoder._pingreq,
    Decoder._pingresp,
    Decoder._disconnect,
    Decoder._auth,
]


# ---------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------


def _frame(b0: int, body: bytes) -> bytes:
    size = len(body)
    if size > MAX_REMAINING_LENGTH:
        raise ValueError(f"packet body of {size} bytes is too large to encode")
    return bytes((b0,)) + encode_varint(size) + body


def _check_packet_id(packet_id: Any) -> int:
    if type(packet_id) is not int or not 0 < packet_id <= 0xFFFF:
        raise ValueError(f"packet id must be 1..65535, got {packet_id!r}")
    return packet_id


def _check_qos(qos: Any) -> int:
    if qos not in (0, 1, 2) or isinstance(qos, bool):
        raise ValueError(f"QoS must be 0, 1 or 2, got {qos!r}")
    return int(qos)


def _no_props(props: Properties | None, what: str) -> None:
    if props:
        raise ValueError(f"{what} properties need MQTT 5")


def _topic_name_bytes(topic: str, props: Properties | None, version: int) -> bytes:
    """Validated, length-prefixed topic name (empty only with a v5 topic alias)."""
    if not topic and version == 5 and props and "topic_alias" in props:
        return b"\x00\x00"
    try:
        validate_topic_name(topic)
    except TopicError as exc:
        raise ValueError(str(exc)) from None
    except TypeError:
        raise ValueError(f"topic must be a str, got {topic!r}") from None
    return encode_str(topic)


def encode_publish(
    topic: str,
    payload: bytes,
    qos: int = 0,
    retain: bool = False,
    dup: bool = False,
    packet_id: int | None = None,
    version: int = 4,
    properties: Properties | None = None,
) -> bytes:
    """Encode a PUBLISH; the hot path for a plain message allocates little more than the result.

    `packet_id` must be None for QoS 0 and 1..65535 otherwise.
    """
    if type(topic) is not str or not topic or "+" in topic or "#" in topic or "\x00" in topic:
        tbytes = _topic_name_bytes(topic, properties, version)[2:]  # raises unless alias
    else:
        try:
            tbytes = topic.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"topic {topic!r} is not encodable as UTF-8") from None
    tlen = len(tbytes)
    if tlen > 65535:
        raise ValueError("topic longer than 65535 bytes")
    if qos:
        if qos != 1 and qos != 2:
            _check_qos(qos)
        pid = _u16_pack(_check_packet_id(packet_id))
        b0 = 0x30 | (qos << 1)
        if dup:
            b0 |= 0x08
    else:
        if qos != 0 or dup or packet_id is not None:
            _check_qos(qos)
            raise ValueError("a QoS 0 PUBLISH has no packet id and no DUP flag")
        pid = b""
        b0 = 0x30
    if retain:
        b0 |= 0x01
    if version == 5:
        props = encode_properties(properties, PUBLISH)
    elif version == 3 or version == 4:
        _no_props(properties, "PUBLISH")
        props = b""
    else:
        raise ValueError(f"unsupported protocol version {version}")
    rl = 2 + tlen + len(pid) + len(props) + len(payload)
    if rl < 128:
        head = _HEAD1.pack(b0, rl, tlen)
    elif rl < 16384:
        head = _HEAD2.pack(b0, (rl & 0x7F) | 0x80, rl >> 7, tlen)
    elif rl <= MAX_REMAINING_LENGTH:
        head = bytes((b0,)) + encode_varint(rl) + _u16_pack(tlen)
    else:
        raise ValueError(f"PUBLISH of {rl} bytes is too large to encode")
    return b"".join((head, tbytes, pid, props, payload))


def _publish_head(b0: int, rl: int) -> bytes:
    if rl > MAX_REMAINING_LENGTH:
        raise ValueError(f"PUBLISH of {rl} bytes is too large to encode")
    return bytes((b0,)) + encode_varint(rl)


class PublishTemplate:
    """One message, encoded once, stamped out for many subscribers.

    The topic, payload and the message's own properties are validated and encoded in the
    constructor. Each subscriber then differs only in protocol version, granted QoS,
    retain flag, packet id, DUP, and (v5) subscription identifiers. For every
    (version, qos, retain) combination the template caches the bytes before the packet id
    (the fixed header, with and without DUP, plus the topic) and after it (properties and
    payload), so `for_subscriber` is a single join of three buffers; a QoS 0 variant is
    cached whole and returned as is. Subscription identifiers change the remaining length,
    so packets that carry them are built from the cached pieces instead.

    v3/v4 subscribers get the message without its properties (they cannot express them).
    Topic aliases are per connection: use `encode_publish` for those.
    """

    __slots__ = ("topic", "payload", "qos", "retain", "properties", "_topic", "_props",
                 "_variants")

    def __init__(
        self,
        topic: str,
        payload: bytes,
        qos: int = 0,
        retain: bool = False,
        properties: Properties | None = None,
    ) -> None:
        self.topic = topic
        self.payload = bytes(payload)
        self.qos = _check_qos(qos)
        self.retain = bool(retain)
        self.properties = dict(properties or {})
        if "topic_alias" in self.properties or "subscription_identifier" in self.properties:
            raise ValueError("topic_alias and subscription_identifier are per subscriber")
        self._topic = _topic_name_bytes(topic, None, 4)
        self._props = encode_properties_body(self.properties, PUBLISH)
        # (version, qos, retain) -> (prefix, prefix with DUP, suffix) or whole QoS 0 packet
        self._variants: dict[tuple[int, int, bool], Any] = {}

    def _variant(self, version: int, qos: int, retain: bool) -> Any:
        if version not in VERSIONS:
            raise ValueError(f"unsupported protocol version {version}")
        _check_qos(qos)
        props = encode_varint(len(self._props)) + self._props if version == 5 else b""
        suffix = props + self.payload
        b0 = 0x30 | (qos << 1) | (1 if retain else 0)
        rl = len(self._topic) + (2 if qos else 0) + len(suffix)
        if qos == 0:
            variant: Any = _publish_head(b0, rl) + self._topic + suffix
        else:
            variant = (_publish_head(b0, rl) + self._topic,
                       _publish_head(b0 | 0x08, rl) + self._topic, suffix)
        self._variants[(version, qos, retain)] = variant
        return variant

    def for_subscriber(
        self,
        packet_id: int | None = None,
        dup: bool = False,
        *,
        version: int = 4,
        qos: int | None = None,
        retain: bool | None = None,
        subscription_ids: Iterable[int] | None = None,
    ) -> bytes:
        """The PUBLISH for one subscriber; `qos`/`retain` default to the message's own."""
        if qos is None:
            qos = self.qos
        if retain is None:
            retain = self.retain
        if subscription_ids and version == 5:
            props = dict(self.properties)
            props["subscription_identifier"] = list(subscription_ids)
            return encode_publish(self.topic, self.payload, qos, retain, dup, packet_id,
                                  version, props)
        key = (version, qos, bool(retain))
        variant = self._variants.get(key)
        if variant is None:
            variant = self._variant(version, qos, bool(retain))
        if not qos:
            if dup or packet_id is not None:
                raise ValueError("a QoS 0 PUBLISH has no packet id and no DUP flag")
            return variant
        prefix, prefix_dup, suffix = variant
        return b"".join((prefix_dup if dup else prefix, _u16_pack(_check_packet_id(packet_id)),
                         suffix))


def _enc_connect(p: Connect, version: int) -> bytes:
    if p.protocol_level != version or p.protocol_name != PROTOCOL_NAMES[version]:
        raise ValueError(
            f"CONNECT protocol {p.protocol_name!r}/{p.protocol_level} does not match {version}"
        )
    if type(p.keepalive) is not int or not 0 <= p.keepalive <= 0xFFFF:
        raise ValueError(f"keepalive must be 0..65535, got {p.keepalive!r}")
    flags = 0x02 if p.clean_start else 0
    v5 = version == 5
    if not v5:
        _no_props(p.properties, "CONNECT")
    parts = [encode_str(p.protocol_name), b"", b"", encode_properties(p.properties, CONNECT)
             if v5 else b"", encode_str(p.client_id)]
    will = p.will
    if will is not None:
        flags |= 0x04 | (_check_qos(will.qos) << 3) | (0x20 if will.retain else 0)
        if v5:
            parts.append(encode_properties(will.properties, WILL))
        else:
            _no_props(will.properties, "will")
        parts.append(_topic_name_bytes(will.topic, None, version))
        parts.append(encode_bin(will.payload))
    if p.username is not None:
        flags |= 0x80
        parts.append(encode_str(p.username))
    if p.password is not None:
        if not v5 and p.username is None:
            raise ValueError("a password needs a user name before MQTT 5")
        flags |= 0x40
        parts.append(encode_bin(p.password))
    if p.bridge and v5:
        raise ValueError("the bridge bit is for 3.1 and 3.1.1 CONNECTs only")
    parts[1] = bytes((version | (BRIDGE_BIT if p.bridge else 0), flags))
    parts[2] = _u16_pack(p.keepalive)
    return _frame(0x10, b"".join(parts))


def _enc_connack(p: Connack, version: int) -> bytes:
    code = p.reason_code
    if version == 5:
        if code not in CONNACK_REASONS:
            raise ValueError(f"invalid CONNACK reason code {code!r}")
    elif code not in CONNACK_V3_RETURN_CODES:
        raise ValueError(f"invalid CONNACK return code {code!r}")
    if p.session_present and code:
        raise ValueError("session_present must be False on a failed CONNACK")
    head = bytes((1 if p.session_present else 0, code))
    if version == 5:
        return _frame(0x20, head + encode_properties(p.properties, CONNACK))
    _no_props(p.properties, "CONNACK")
    return _frame(0x20, head)


def _enc_publish(p: Publish, version: int) -> bytes:
    return encode_publish(p.topic, p.payload, p.qos, p.retain, p.dup, p.packet_id, version,
                          p.properties)


Ack = Puback | Pubrec | Pubrel | Pubcomp


def _ack_encoder(ptype: int, b0: int, reasons: frozenset[int]) -> Callable[[Ack, int], bytes]:
    def encode_ack(p: Ack, version: int) -> bytes:
        packet_id = _check_packet_id(p.packet_id)
        code = p.reason_code
        if not p.properties:
            if not code:
                return _ACK.pack(b0, 2, packet_id)
            if version == 5 and code in reasons:
                return _ACK_RC.pack(b0, 3, packet_id, code)
        if version != 5:
            raise ValueError(f"reason codes and properties on {type(p).__name__} need MQTT 5")
        if code not in reasons:
            raise ValueError(f"invalid {type(p).__name__} reason code {code!r}")
        return _frame(b0, _u16_pack(packet_id) + bytes((code,))
                      + encode_properties(p.properties, ptype))

    return encode_ack


def _enc_subscribe(p: Subscribe, version: int) -> bytes:
    parts = [_u16_pack(_check_packet_id(p.packet_id))]
    if version == 5:
        parts.append(encode_properties(p.properties, SUBSCRIBE))
    else:
        _no_props(p.properties, "SUBSCRIBE")
    if not p.subscriptions:
        raise ValueError("SUBSCRIBE needs at least one topic filter")
    for topic_filter, opts in p.subscriptions:
        problem = _filter_problem(topic_filter) if isinstance(topic_filter, str) else "not a str"
        if problem is not None:
            raise ValueError(f"topic filter {topic_filter!r}: {problem}")
        bits = _check_qos(opts.qos)
        if version == 5:
            if opts.retain_handling not in (0, 1, 2):
                raise ValueError(f"retain_handling must be 0..2, got {opts.retain_handling!r}")
            if opts.no_local and topic_filter.startswith("$share/"):
                raise ValueError("no_local is not allowed on a shared subscription")
            bits |= (0x04 if opts.no_local else 0) | (0x08 if opts.retain_as_published else 0)
            bits |= opts.retain_handling << 4
        elif opts.no_local or opts.retain_as_published or opts.retain_handling:
            raise ValueError("subscription options other than QoS need MQTT 5")
        parts.append(encode_str(topic_filter))
        parts.append(bytes((bits,)))
    return _frame(0x82, b"".join(parts))


def _check_codes(codes: list[int], valid: frozenset[int], what: str) -> bytes:
    if not codes:
        raise ValueError(f"{what} needs at least one reason code")
    for code in codes:
        if code not in valid:
            raise ValueError(f"invalid {what} reason code {code!r}")
    return bytes(codes)


def _enc_suback(p: Suback, version: int) -> bytes:
    head = _u16_pack(_check_packet_id(p.packet_id))
    if version == 5:
        head += encode_properties(p.properties, SUBACK)
        return _frame(0x90, head + _check_codes(p.reason_codes, SUBACK_REASONS, "SUBACK"))
    _no_props(p.properties, "SUBACK")
    return _frame(0x90, head + _check_codes(p.reason_codes, SUBACK_V3_RETURN_CODES, "SUBACK"))


def _enc_unsubscribe(p: Unsubscribe, version: int) -> bytes:
    parts = [_u16_pack(_check_packet_id(p.packet_id))]
    if version == 5:
        parts.append(encode_properties(p.properties, UNSUBSCRIBE))
    else:
        _no_props(p.properties, "UNSUBSCRIBE")
    if not p.filters:
        raise ValueError("UNSUBSCRIBE needs at least one topic filter")
    for topic_filter in p.filters:
        problem = _filter_problem(topic_filter) if isinstance(topic_filter, str) else "not a str"
        if problem is not None:
            raise ValueError(f"topic filter {topic_filter!r}: {problem}")
        parts.append(encode_str(topic_filter))
    return _frame(0xA2, b"".join(parts))


def _enc_unsuback(p: Unsuback, version: int) -> bytes:
    packet_id = _check_packet_id(p.packet_id)
    if version != 5:  # 3.1.1 UNSUBACK has no reason codes: they are dropped
        _no_props(p.properties, "UNSUBACK")
        return _ACK.pack(0xB0, 2, packet_id)
    body = (_u16_pack(packet_id) + encode_properties(p.properties, UNSUBACK)
            + _check_codes(p.reason_codes, UNSUBACK_REASONS, "UNSUBACK"))
    return _frame(0xB0, body)


def _enc_pingreq(p: Pingreq, version: int) -> bytes:
    return b"\xc0\x00"


def _enc_pingresp(p: Pingresp, version: int) -> bytes:
    return b"\xd0\x00"


def _enc_disconnect(p: Disconnect, version: int) -> bytes:
    if version != 5:
        if p.reason_code or p.properties:
            raise ValueError("DISCONNECT reason codes and properties need MQTT 5")
        return b"\xe0\x00"
    if p.reason_code not in DISCONNECT_REASONS:
        raise ValueError(f"invalid DISCONNECT reason code {p.reason_code!r}")
    if not p.properties:
        return b"\xe0\x00" if not p.reason_code else bytes((0xE0, 1, p.reason_code))
    return _frame(0xE0, bytes((p.reason_code,)) + encode_properties(p.properties, DISCONNECT))


def _enc_auth(p: Auth, version: int) -> bytes:
    if version != 5:
        raise ValueError("AUTH needs MQTT 5")
    if p.reason_code not in AUTH_REASONS:
        raise ValueError(f"invalid AUTH reason code {p.reason_code!r}")
    if not p.reason_code and not p.properties:
        return b"\xf0\x00"
    return _frame(0xF0, bytes((p.reason_code,)) + encode_properties(p.properties, AUTH))


_ENCODERS: dict[type, Callable[[Any, int], bytes]] = {
    Connect: _enc_connect,
    Connack: _enc_connack,
    Publish: _enc_publish,
    Puback: _ack_encoder(PUBACK, 0x40, PUBACK_REASONS),
    Pubrec: _ack_encoder(PUBREC, 0x50, PUBACK_REASONS),
    Pubrel: _ack_encoder(PUBREL, 0x62, PUBREL_REASONS),
    Pubcomp: _ack_encoder(PUBCOMP, 0x70, PUBREL_REASONS),
    Subscribe: _enc_subscribe,
    Suback: _enc_suback,
    Unsubscribe: _enc_unsubscribe,
    Unsuback: _enc_unsuback,
    Pingreq: _enc_pingreq,
    Pingresp: _enc_pingresp,
    Disconnect: _enc_disconnect,
    Auth: _enc_auth,
}


def encode(packet: Packet, version: int) -> bytes:
    """Encode any packet (either direction) for protocol level `version` (3, 4 or 5)."""
    encoder = _ENCODERS.get(type(packet))
    if encoder is None:
        raise TypeError(f"not an MQTT packet: {packet!r}")
    if version not in VERSIONS:
        raise ValueError(f"unsupported protocol version {version!r}")
    return encoder(packet, version)
