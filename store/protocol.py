"""The native protocol's frames (sans-IO): what the store server and its clients send.

    length u32 | version u8 | kind u8 | code u16 | request_id u32 | header_len u32 |
    header (JSON, orjson) | body (raw bytes)

`length` counts everything after itself. Message bodies travel raw in `body`,
concatenated, each described in the header by its size: no base64 for payloads.
Properties inside the header may hold bytes (JSON-wrapped, see store.record.dumps_json).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass, field
from typing import Any

from store.record import Message, dumps_json, loads_json

VERSION = 1
HEAD = struct.Struct(">IBBHII")
MAX_FRAME = 64 * 1024 * 1024

REQUEST, RESPONSE, ERROR = 0, 1, 2

# Request codes.
HELLO = 1
SEND = 10  # server app -> first-level topic (optionally to MQTT topics)
PUBLISH = 11  # MQTT publish, routed by topic (the gateway)
PRODUCER_INIT = 12  # an idempotent producer's id (store.producer_ids)
PULL = 20
QUEUE_RANGE = 21
QUEUE_ENDS = 22
QUEUE_TAIL = 23  # where a reader resumes that may lag a number of bytes
HISTORY = 24  # a topic filter's stored messages from a start, in batches (store.history)
QUEUE_SEEK = 25  # the first offset of a queue stored at or after a time
HEARTBEAT = 30  # consumer group membership -> assignment
COMMIT = 31
FETCH_OFFSETS = 32
NACK = 33  # processing failed: redeliver later, or dead-letter
GET_MESSAGE = 40
FIND_KEY = 41
TOPIC_CREATE = 50
TOPIC_LIST = 51
TOPIC_DESCRIBE = 52
META_GET = 60
META_PUT = 61
META_DELETE = 62
META_ITEMS = 63
META_WRITE = 64
WILDCARD_ADD = 70
STATS = 80
CLUSTER = 81  # the store group's view: nodes, roles, epochs, lag (the dashboard)
GATEWAY_HEARTBEAT = 90
GATEWAY_LIST = 91
SHARED_LEASE = 92  # which gateway hands out a shared group's messages (store.leases)
USER_ADD = 100  # users and policies: Super users only
USER_UPDATE = 101
USER_DELETE = 102
USER_LIST = 103
ACL_ADD = 110
ACL_DELETE = 111
ACL_LIST = 112
REPL_FETCH = 120  # a replica copies the master's CommitLog and metadata (nodes only)

CODE_NAMES = {v: k for k, v in globals().items() if k.isupper() and isinstance(v, int)
              and k not in ("VERSION", "MAX_FRAME", "REQUEST", "RESPONSE", "ERROR")}


class ProtocolError(Exception):
    """A frame that breaks the protocol: the connection is closed after an error frame."""


class RemoteError(Exception):
    """The other side answered with an error frame."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


@dataclass
class Frame:
    kind: int
    code: int
    request_id: int
    header: dict[str, Any] = field(default_factory=dict)
    body: bytes = b""


def encode_frame(frame: Frame) -> bytes:
    header = dumps_json(frame.header) if frame.header else b""
    rest = len(header) + len(frame.body) + HEAD.size - 4
    if rest + 4 > MAX_FRAME:
        raise ValueError(f"frame of {rest + 4} bytes exceeds {MAX_FRAME}")
    return b"".join((
        HEAD.pack(rest, VERSION, frame.kind, frame.code, frame.request_id, len(header)),
        header, frame.body,
    ))


def encode_error(code: int, request_id: int, status: int, message: str) -> bytes:
    """The ERROR frame that answers request `request_id` (of `code`)."""
    return encode_frame(Frame(ERROR, code, request_id, {"status": status, "error": message}))


class FrameDecoder:
    """Bytes in, frames out, across any chunk boundaries."""

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()

    @property
    def buffered(self) -> int:
        """Bytes of an incomplete frame held until the rest arrives."""
        return len(self._buf)

    def take(self) -> bytes:
        """What is held (an incomplete frame's bytes), given up: another reader takes
        the connection over."""
        out = bytes(self._buf)
        self._buf.clear()
        return out

    def feed(self, data: bytes) -> list[Frame]:
        self._buf += data
        out = []
        buf = self._buf
        pos = 0
        while len(buf) - pos >= HEAD.size:
            length, version, kind, code, rid, hlen = HEAD.unpack_from(buf, pos)
            if version != VERSION:
                raise ProtocolError(f"unsupported protocol version {version}")
            if length + 4 > self.max_frame:
                raise ProtocolError(f"frame of {length + 4} bytes exceeds {self.max_frame}")
            if hlen > length - (HEAD.size - 4) or kind not in (REQUEST, RESPONSE, ERROR):
                raise ProtocolError("malformed frame header")
            end = pos + 4 + length
            if len(buf) < end:
                break
            hstart = pos + HEAD.size
            try:
                header = loads_json(bytes(buf[hstart : hstart + hlen])) if hlen else {}
            except (ValueError, TypeError) as exc:  # TypeError: defence in depth
                raise ProtocolError(f"bad header JSON: {exc}") from exc
            if not isinstance(header, dict):
                raise ProtocolError("header must be a JSON object")
            out.append(Frame(kind, code, rid, header, bytes(buf[hstart + hlen : end])))
            pos = end
        del buf[:pos]
        return out


# -- messages in frames -------------------------------------------------------------------
def pack_messages(msgs: list[Message]) -> tuple[list[dict[str, Any]], bytes]:
    """Headers (everything but the body) and the bodies concatenated."""
    metas = []
    for m in msgs:
        meta: dict[str, Any] = {"topic": m.topic, "size": len(m.body)}
        if m.qos:
            meta["qos"] = m.qos
        if m.retain:
            meta["retain"] = True
        if m.client_id:
            meta["client_id"] = m.client_id
        if m.properties:
            meta["props"] = m.properties
        if m.key:
            meta["key"] = m.key
        if m.born_ts:
            meta["born_ts"] = m.born_ts
        if m.phys_offset >= 0:
            meta["phys"] = m.phys_offset
            meta["store_ts"] = m.store_ts
            meta["rsize"] = m.size
            meta["queues"] = m.queues
        metas.append(meta)
    return metas, b"".join(m.body for m in msgs)


def unpack_messages(metas: list[dict[str, Any]], body: bytes) -> list[Message]:
    out = []
    pos = 0
    try:
        for meta in metas:
            size = int(meta["size"])
            if size < 0 or pos + size > len(body):
                raise ProtocolError("message sizes do not match the body")
            out.append(Message(
                topic=str(meta["topic"]), body=body[pos : pos + size],
                qos=meta.get("qos", 0), retain=meta.get("retain", False),  # checked later
                client_id=str(meta.get("client_id", "")), properties=meta.get("props") or {},
                born_ts=int(meta.get("born_ts", 0)), key=str(meta.get("key", "")),
                store_ts=int(meta.get("store_ts", 0)), phys_offset=int(meta.get("phys", -1)),
                size=int(meta.get("rsize", 0)),
                queues=[(str(q), int(o)) for q, o in meta.get("queues", [])],
            ))
            pos += size
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"bad message description: {exc}") from exc
    if pos != len(body):
        raise ProtocolError("message sizes do not match the body")
    return out


def node_proof(secret: bytes, challenge: str, node: str) -> str:
    """What a store node sends to prove it holds the group secret: the HMAC-SHA256 of the
    server's one-time challenge (its HELLO answer's) and the node's own name, so that a
    proof fits no other connection and no other node."""
    msg = b"lightgate store node\0" + challenge.encode() + b"\0" + node.encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()
