"""The CommitLog record: one message, self-describing and CRC-protected.

Layout (big-endian):

    magic u32 | total_len u32 | crc32 u32            <- 12-byte frame; crc covers the rest
    store_ts u64 | born_ts u64 | qos u8 | flags u8 | client_len u16 | topic_len u16 |
    key_len u16 | props_len u32 | body_len u32 | nqueues u16          <- 34-byte fixed part
    client_id | topic | key | properties (JSON) | body | nqueues x (name_len u16, name, offset u64)

Magic "LGM1"; "LGM2" is the same with nqueues u32 (36 bytes), for the rare message that
more than 65,535 queues take.

The light-queue offsets assigned inside the append are part of the record, so the index
is derived data: re-dispatching a record writes exactly the entries it had before.
"""

from __future__ import annotations

import base64
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from serving import plane

_native_encode = plane.NATIVE.encode_record if plane.NATIVE is not None else None

MAGIC = 0x4C47_4D31  # "LGM1"
# The same record with a u32 queue count, written only for a message that more than
# 65,535 queues take (that many registered wildcard filters match its topic).
MAGIC_WIDE = 0x4C47_4D32  # "LGM2"
BLANK_MAGIC = 0x4C47_4245  # "LGBE": the rest of this segment is empty, go to the next
FRAME = struct.Struct(">III")
FIXED = struct.Struct(">QQBBHHHIIH")
FIXED_WIDE = struct.Struct(">QQBBHHHIII")
QNAME_LEN = struct.Struct(">H")
QOFFSET = struct.Struct(">Q")
HEADER_SIZE = FRAME.size + FIXED.size
MAX_RECORD = 512 * 1024 * 1024
MAX_QUEUES = 0xFFFF  # nqueues is a u16 in an LGM1 record
FLAG_RETAIN = 0x01
# An idempotent producer's append (store.producers): its first record has MARK_FIRST and
# the producer's id, epoch and first sequence in its properties (PRODUCER_PROP), the rest
# of the append MARK_MORE, so the sequences can be rebuilt from the log alone. A reader
# that does not know these bits reads the record as before (it looks at FLAG_RETAIN only,
# and sees PRODUCER_PROP as a property); this one hands it out as Message.producer.
MARK_FIRST = 0x02
MARK_MORE = 0x04
MARKS = MARK_FIRST | MARK_MORE
PRODUCER_PROP = "lg_producer"


class CorruptRecord(ValueError):
    """Bytes at this position are not a whole, valid record."""


@dataclass(slots=True)
class Message:
    """A message as the store keeps it. The store fills the fields below `key`."""

    topic: str
    body: bytes
    qos: int = 0
    retain: bool = False
    client_id: str = ""
    properties: dict[str, Any] = field(default_factory=dict)
    born_ts: int = 0
    key: str = ""
    store_ts: int = 0
    phys_offset: int = -1
    size: int = 0
    queues: list[tuple[str, int]] = field(default_factory=list)
    mark: int = 0  # MARK_FIRST / MARK_MORE: a record of an idempotent producer's append
    producer: list[Any] | None = None  # MARK_FIRST: [producer id, epoch, first sequence]

    @property
    def msg_id(self) -> str:
        """Stable id: the physical offset, 16 hex digits (no precision lost, unlike RoP)."""
        return format_msg_id(self.phys_offset)

    def offset_in(self, queue: str) -> int:
        for name, offset in self.queues:
            if name == queue:
                return offset
        raise KeyError(queue)


def format_msg_id(phys_offset: int) -> str:
    return f"{phys_offset:016X}"


def parse_msg_id(msg_id: str) -> int:
    if len(msg_id) != 16:
        raise ValueError(f"message id must be 16 hex digits, got {msg_id!r}")
    return int(msg_id, 16)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, bytes | bytearray | memoryview):
        return {"$b64": base64.b64encode(bytes(obj)).decode()}
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"property value of type {type(obj).__name__} cannot be stored")


def _restore_bytes(obj: Any) -> Any:
    if isinstance(obj, dict):
        if len(obj) == 1 and "$b64" in obj:
            raw = obj["$b64"]
            if not isinstance(raw, str):  # JSON from a peer: anything may be there
                raise ValueError(f"$b64 value must be a base64 string, not {type(raw).__name__}")
            return base64.b64decode(raw, validate=True)  # binascii.Error is a ValueError
        return {k: _restore_bytes(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_restore_bytes(v) for v in obj]
    return obj


def dumps_json(value: Any) -> bytes:
    """JSON that may hold bytes (wrapped as {"$b64": ...})."""
    return orjson.dumps(value, default=_json_default)


def loads_json(raw: bytes) -> Any:
    """Raises ValueError (only) for anything that is not such JSON."""
    value = orjson.loads(raw)
    # Binary values (e.g. MQTT 5 correlation data) were wrapped; only walk when present
    # (or when escapes could spell the key another way: "\u0024b64").
    return _restore_bytes(value) if b"b64" in raw or b"\\u" in raw else value


def encode_properties(props: dict[str, Any]) -> bytes:
    return dumps_json(props) if props else b""


def decode_properties(raw: bytes) -> dict[str, Any]:
    props = loads_json(raw) if raw else {}
    if not isinstance(props, dict):
        raise ValueError("properties must be a JSON object")
    return props


# Queue name -> its length prefix and UTF-8 bytes, as records carry them: a device
# publishes to the same few queues again and again. Bounded; any thread may use it.
_QNAMES: dict[str, bytes] = {}
_QNAMES_MAX = 65536


def _qname(name: str) -> bytes:
    raw = _QNAMES.get(name)
    if raw is None:
        encoded = name.encode()
        raw = QNAME_LEN.pack(len(encoded)) + encoded
        if len(_QNAMES) < _QNAMES_MAX:
            _QNAMES[name] = raw
    return raw


def stored_properties(msg: Message) -> bytes:
    """The properties as the record stores them (JSON, the producer's stamp included),
    b"" when there are none."""
    stored = msg.properties
    if msg.mark & MARK_FIRST:
        stored = {**stored, PRODUCER_PROP: msg.producer}
    props = encode_properties(stored) if stored else b""
    if props and b'"$b64"' in props:
        # A property shaped like our bytes wrapper must come back as it went in: a record
        # that does not decode would stop every later start in recovery.
        decode_properties(props)
    return props


def encode(msg: Message) -> bytes:
    """Encode `msg` (its store_ts and queues must be set) into one record: by the native
    data plane when it runs (the same bytes, a fifth of the time), else `encode_python`."""
    if _native_encode is None:
        return encode_python(msg)
    try:
        props = stored_properties(msg)
        return _native_encode(msg.store_ts, msg.born_ts, msg.qos, msg.retain, msg.client_id,
                              msg.topic, msg.key, props, msg.body, msg.queues, msg.mark)
    except Exception:  # noqa: BLE001 - what either refuses, Python's error says why
        return encode_python(msg)


def encode_python(msg: Message) -> bytes:
    """The record's encoding, the specification the native encoder is held to."""
    client = msg.client_id.encode()
    topic = msg.topic.encode()
    key = msg.key.encode() if msg.key else b""
    props = stored_properties(msg)
    queues = msg.queues
    parts = [
        (FIXED_WIDE if len(queues) > MAX_QUEUES else FIXED).pack(
            msg.store_ts, msg.born_ts, msg.qos, (FLAG_RETAIN if msg.retain else 0) | msg.mark,
            len(client), len(topic), len(key), len(props), len(msg.body), len(queues),
        ),
        client, topic, key, props, msg.body,
    ]
    pack_offset = QOFFSET.pack
    for name, offset in queues:
        parts.append(_qname(name))
        parts.append(pack_offset(offset))
    rest = b"".join(parts)
    total = FRAME.size + len(rest)
    if total > MAX_RECORD:
        raise ValueError(f"record of {total} bytes exceeds the {MAX_RECORD}-byte limit")
    magic = MAGIC_WIDE if len(queues) > MAX_QUEUES else MAGIC
    return FRAME.pack(magic, total, zlib.crc32(rest)) + rest


_HEAD_FIXED = struct.Struct(">III" + FIXED.format[1:])  # FRAME and FIXED in one unpack


def decode_first(buf: bytes | memoryview, pos: int = 0, phys_offset: int = -1) -> Message:
    """`decode(buf, pos, phys_offset, max_queues=1)`, the history reader's hot path
    (a replay decodes a million records): the same checks in fewer steps, a quarter
    faster. Records of the wide kind, or that look wrong, take `decode` itself."""
    if len(buf) - pos < HEADER_SIZE:
        raise CorruptRecord("truncated header")
    (magic, total, crc, store_ts, born_ts, qos, flags, lc, lt, lk, lp, lb,
     nq) = _HEAD_FIXED.unpack_from(buf, pos)
    end = pos + total
    if magic != MAGIC or total < HEADER_SIZE or total > MAX_RECORD or end > len(buf):
        return decode(buf, pos, phys_offset, 1)  # raises what is wrong
    if zlib.crc32(buf[pos + FRAME.size:end]) != crc:
        raise CorruptRecord("CRC mismatch")
    p = pos + HEADER_SIZE
    try:
        client = str(buf[p : p + lc], "utf-8")
        p += lc
        topic = str(buf[p : p + lt], "utf-8")
        p += lt
        key = str(buf[p : p + lk], "utf-8") if lk else ""
        p += lk
        props = decode_properties(bytes(buf[p : p + lp])) if lp else {}
        p += lp
        body = bytes(buf[p : p + lb])
        p += lb
        queues = []
        if nq:
            ln = QNAME_LEN.unpack_from(buf, p)[0]
            p += 2
            queues.append((str(buf[p : p + ln], "utf-8"), QOFFSET.unpack_from(buf, p + ln)[0]))
            p += ln + 8
    except (ValueError, TypeError, struct.error) as exc:  # JSON, UTF-8, $b64 included
        raise CorruptRecord(f"undecodable fields: {exc}") from exc
    if p > end or (nq <= 1 and p != end):
        raise CorruptRecord("field lengths disagree with the record length")
    msg = Message(topic, body, qos, bool(flags & FLAG_RETAIN), client, props, born_ts, key,
                  store_ts, phys_offset, total, queues, flags & MARKS)
    if flags & MARK_FIRST:
        msg.producer = props.pop(PRODUCER_PROP, None)
    return msg


_PEEK = struct.Struct(">II22xHH")  # magic, total_len, client_len, topic_len


def peek_topic(buf: bytes | memoryview, pos: int = 0) -> tuple[str, int]:
    """The topic of the (whole, checked) record at `pos` and its length, without decoding
    the rest."""
    magic, total, lc, lt = _PEEK.unpack_from(buf, pos)
    at = pos + (HEADER_SIZE if magic == MAGIC else FRAME.size + FIXED_WIDE.size) + lc
    return str(buf[at:at + lt], "utf-8"), total


def frame_length(buf: bytes | memoryview, pos: int = 0) -> tuple[int, int]:
    """(magic, total_len) of the record starting at `pos`."""
    if len(buf) - pos < FRAME.size:
        raise CorruptRecord("truncated frame")
    magic, total, _ = FRAME.unpack_from(buf, pos)
    return magic, total


def decode(buf: bytes | memoryview, pos: int = 0, phys_offset: int = -1,
           max_queues: int | None = None) -> Message:
    """Decode and verify the record at `buf[pos:]`; raise CorruptRecord if it is not valid.
    `max_queues`: decode only the first that many of its queues (a history reader needs
    the exact-topic queue, which routing puts first; each further queue cost ~0.3 us of
    a ~2.5 us decode). The CRC still covers the whole record."""
    if len(buf) - pos < HEADER_SIZE:
        raise CorruptRecord("truncated header")
    magic, total, crc = FRAME.unpack_from(buf, pos)
    if magic == MAGIC:
        fixed = FIXED
    elif magic == MAGIC_WIDE:
        fixed = FIXED_WIDE
    else:
        raise CorruptRecord(f"bad magic {magic:#x}")
    if total < HEADER_SIZE or total > MAX_RECORD or pos + total > len(buf):
        raise CorruptRecord(f"bad length {total}")
    body_start = pos + FRAME.size
    end = pos + total
    if total < FRAME.size + fixed.size:
        raise CorruptRecord(f"bad length {total}")
    if zlib.crc32(memoryview(buf)[body_start:end]) != crc:
        raise CorruptRecord("CRC mismatch")
    (store_ts, born_ts, qos, flags, lc, lt, lk, lp, lb, nq) = fixed.unpack_from(buf, body_start)
    p = body_start + fixed.size
    # Readers that fell behind the ring of recent messages decode every message they
    # get: str(slice, "utf-8") decodes bytes and memoryviews without a copy in between,
    # and the usual empty key and properties cost nothing.
    try:
        client = str(buf[p : p + lc], "utf-8")
        p += lc
        topic = str(buf[p : p + lt], "utf-8")
        p += lt
        key = str(buf[p : p + lk], "utf-8") if lk else ""
        p += lk
        props = decode_properties(bytes(buf[p : p + lp])) if lp else {}
        p += lp
        body = bytes(buf[p : p + lb])
        p += lb
        queues = []
        unpack_len, unpack_offset = QNAME_LEN.unpack_from, QOFFSET.unpack_from
        count = nq if max_queues is None or max_queues >= nq else max_queues
        partial = count < nq
        for _ in range(count):
            ln = unpack_len(buf, p)[0]
            p += 2
            name = str(buf[p : p + ln], "utf-8")
            p += ln
            queues.append((name, unpack_offset(buf, p)[0]))
            p += 8
    except (ValueError, TypeError, struct.error) as exc:  # JSON, UTF-8, $b64 included
        raise CorruptRecord(f"undecodable fields: {exc}") from exc
    if (p > end) if partial else (p != end):
        raise CorruptRecord("field lengths disagree with the record length")
    msg = Message(topic, body, qos, bool(flags & FLAG_RETAIN), client, props, born_ts, key,
                  store_ts, phys_offset, total, queues, flags & MARKS)
    if flags & MARK_FIRST:
        msg.producer = props.pop(PRODUCER_PROP, None)
    return msg


# Records after a candidate that must check too when nothing else can vouch for it.
RESYNC_CHAIN = 8
_MAGIC_BYTES = (MAGIC.to_bytes(4, "big"), MAGIC_WIDE.to_bytes(4, "big"))


def next_start(buf: Any, pos: int, limit: int,
               trusted: Callable[[int, Message], bool | None]) -> int:
    """After bytes at `pos` that are not a record (a damaged one): the first position in
    (pos, limit) where a record starts that can be trusted, else `limit`. `buf` holds
    the bytes (a mapped segment, or a read of one) up to `limit` at least. Magic,
    length and CRC also hold for a record a client sent inside a message body, so a
    candidate is taken when `trusted(at, msg)` says so (the index knows it is a record:
    True; it knows it is not: False) or, where it cannot tell (None), when the records
    after it check too, up to `limit` or RESYNC_CHAIN of them."""
    at = pos + 1
    while at < limit:
        found = [i for i in (buf.find(m, at, limit) for m in _MAGIC_BYTES) if i >= 0]
        if not found:
            break
        at = min(found)
        try:
            msg = _whole(buf, at, limit)
        except CorruptRecord:
            at += 1
            continue
        verdict = trusted(at, msg)
        if verdict or (verdict is None and _chain_checks(buf, at + msg.size, limit)):
            return at
        at += 1
    return limit


def _chain_checks(buf: Any, at: int, limit: int) -> bool:
    """Whether records follow on from `at`: to `limit` exactly, or RESYNC_CHAIN of them."""
    for _ in range(RESYNC_CHAIN):
        if at == limit:
            return True
        try:
            at += _whole(buf, at, limit).size
        except CorruptRecord:
            return False
    return True


def _whole(buf: Any, at: int, limit: int) -> Message:
    """The record at `at`, if it checks and ends by `limit` (CorruptRecord if not)."""
    if limit - at < FRAME.size:
        raise CorruptRecord("truncated frame")
    total = FRAME.unpack_from(buf, at)[1]
    if not HEADER_SIZE <= total <= limit - at:
        raise CorruptRecord(f"bad length {total}")
    return decode(buf, at, at)
