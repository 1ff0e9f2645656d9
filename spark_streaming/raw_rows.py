"""Records as the store's log holds them (a PULL answered `raw`) to one Arrow
RecordBatch: the executor decodes what the store no longer does, and only the columns
the query reads (json_KEY columns: top-level fields of JSON payloads, see json_fields).
The rows equal the ones `source.message_row` makes from decoded messages
(tests/spark/test_arrow.py compares them).

A record (store.record): frame (magic, length, crc) and fixed part (store_ts, born_ts,
qos, flags, the lengths), then client id, topic, key, properties (JSON), body, queues.
The store checked every record's CRC before handing it out.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Sequence
from itertools import accumulate

import pyarrow as pa
import pyarrow.compute as pc

from spark_streaming import json_fields as jf
from store import record

_HEAD = struct.Struct(">III" + record.FIXED.format[1:])  # FRAME and FIXED in one unpack
_AT = record.HEADER_SIZE
_US = pa.timestamp("us", tz="UTC")


def arrow_from_records(queue: str, lo: int, hi: int, runs: Sequence[Sequence[int]],
                       body: bytes, schema: pa.Schema) -> pa.RecordBatch | None:
    """The records of `runs` ([log offset, bytes, first queue offset, count] over
    `body`) whose offset in `queue` is in [lo, hi), as a batch of `schema` (some of the
    source's columns, in any order). One pass finds the records' fixed parts; each
    column the schema names is then cut out of the body by one list comprehension."""
    unpack = _HEAD.unpack_from
    kept: list[tuple[int, int, int, tuple]] = []  # (position, log offset, queue offset, head)
    pos = 0
    for phys, _, first, count in runs:
        for off in range(first, first + count):
            head = unpack(body, pos)
            if lo <= off < hi:
                kept.append((pos, phys, off, head))
            pos += head[1]
            phys += head[1]
    if not kept:
        return None
    if any(head[0] != record.MAGIC for _, _, _, head in kept):
        return _decoded(queue, kept, body, schema)  # a wide record: rare, decoded whole
    n = len(kept)
    at = _AT
    names = set(schema.names)
    topics: list[bytes] = []
    if names & {"mqtt_topic"} or any(topic_level(x) is not None for x in names):
        topics = [body[p + at + h[7]:p + at + h[7] + h[8]] for p, _, _, h in kept]
    payloads: list[bytes] = []
    fields = json_keys(schema)
    if "payload" in names or fields:
        payloads = [body[(s := p + at + h[7] + h[8] + h[9] + h[10]):s + h[11]]
                    for p, _, _, h in kept]
    columns: dict[str, Callable[[], pa.Array]] = {
        "mqtt_topic": lambda: pa.array(topics, pa.string()),
        "client_id": lambda: pa.array([body[p + at:p + at + h[7]] for p, _, _, h in kept],
                                      pa.string()),
        "qos": lambda: pa.array([h[5] for _, _, _, h in kept], pa.int32()),
        "properties": lambda: pa.array([_props_at(body, p, h) for p, _, _, h in kept],
                                       pa.string()),
        "payload": lambda: _binary(payloads),
        "store_time": lambda: _times([h[3] for _, _, _, h in kept]),
        "born_time": lambda: _times([h[4] for _, _, _, h in kept]),
        "queue": lambda: pa.repeat(pa.scalar(queue, pa.string()), n),
        "offset": lambda: pa.array([off for _, _, off, _ in kept], pa.int64()),
        "msg_id": lambda: pa.array([f"{phys:016X}" for _, phys, _, _ in kept], pa.string()),
    }
    _derived(columns, schema, topics, payloads, fields)
    return pa.RecordBatch.from_arrays([columns[name]() for name in schema.names],
                                      schema=schema)


def _derived(columns: dict[str, Callable[[], pa.Array]], schema: pa.Schema,
             topics: list[bytes], payloads: list[bytes], fields: list[tuple[str, str]]
             ) -> None:
    """The topic_N and json_KEY columns of `schema`, from the records' topics and
    payloads."""
    for name, values in topic_levels(topics, schema).items():
        columns[name] = lambda v=values: pa.array(v, pa.string())
    if fields:
        parsed = jf.columns(payloads, fields)
        for (key, typ), values in zip(fields, parsed, strict=True):
            columns[jf.PREFIX + key] = lambda v=values, t=typ: pa.array(
                v, pa.float64() if t == "double" else pa.int64())


def _decoded(queue: str, kept: list[tuple[int, int, int, tuple]], body: bytes,
             schema: pa.Schema) -> pa.RecordBatch:
    """`arrow_from_records` by decoding each record whole (store.record.decode)."""
    msgs = [(record.decode(body, p, phys), off) for p, phys, off, _ in kept]
    topics = [m.topic.encode() for m, _ in msgs]
    payloads = [m.body for m, _ in msgs]
    columns: dict[str, Callable[[], pa.Array]] = {
        "mqtt_topic": lambda: pa.array(topics, pa.string()),
        "client_id": lambda: pa.array([m.client_id for m, _ in msgs], pa.string()),
        "qos": lambda: pa.array([m.qos for m, _ in msgs], pa.int32()),
        "properties": lambda: pa.array([_props_json(m.properties) for m, _ in msgs],
                                       pa.string()),
        "payload": lambda: _binary(payloads),
        "store_time": lambda: _times([m.store_ts for m, _ in msgs]),
        "born_time": lambda: _times([m.born_ts for m, _ in msgs]),
        "queue": lambda: pa.repeat(pa.scalar(queue, pa.string()), len(msgs)),
        "offset": lambda: pa.array([off for _, off in msgs], pa.int64()),
        "msg_id": lambda: pa.array([m.msg_id for m, _ in msgs], pa.string()),
    }
    _derived(columns, schema, topics, payloads, json_keys(schema))
    return pa.RecordBatch.from_arrays([columns[name]() for name in schema.names],
                                      schema=schema)


def _binary(values: list[bytes]) -> pa.Array:
    """Byte strings as one Arrow binary array: one buffer of them all, and their ends."""
    ends = list(accumulate(map(len, values), initial=0))
    return pa.Array.from_buffers(pa.binary(), len(values), [
        None, pa.array(ends, pa.int32()).buffers()[1], pa.py_buffer(b"".join(values))])


def _props_at(body: bytes, p: int, h: tuple) -> str | None:
    """The properties of the record at `p` as the source shows them (JSON), without the
    store's own (an idempotent producer's stamp); None when it has none."""
    lp = h[10]
    if not lp:
        return None
    at = p + _AT + h[7] + h[8] + h[9]
    raw = record.decode_properties(body[at:at + lp])
    if h[6] & record.MARK_FIRST:
        raw.pop(record.PRODUCER_PROP, None)
    return _props_json(raw)


TOPIC_LEVEL = "topic_"  # a source column topic_N: the N-th level of the MQTT topic


def topic_level(name: str) -> int | None:
    """N of a topic_N column's name (None: not one)."""
    digits = name[len(TOPIC_LEVEL):]
    return int(digits) if name.startswith(TOPIC_LEVEL) and digits.isdigit() else None


def topic_levels(topics: list[bytes], schema: pa.Schema) -> dict[str, list[bytes | None]]:
    """Each topic_N column of `schema`: the N-th level of each topic (UTF-8), None where
    the topic has fewer levels; what try_element_at(split(mqtt_topic, '/'), N + 1)
    gives in the JVM."""
    out = {}
    for f in schema:
        n = topic_level(f.name)
        if n is not None:
            out[f.name] = [(levels[n] if len(levels) > n else None)
                           for levels in (t.split(b"/", n + 1) for t in topics)]
    return out


def json_keys(schema: pa.Schema) -> list[tuple[str, str]]:
    """The (key, type) of each json_KEY column of `schema` (see json_fields)."""
    out = []
    for f in schema:
        if f.name.startswith(jf.PREFIX):
            out.append((f.name[len(jf.PREFIX):],
                        "double" if pa.types.is_floating(f.type) else "long"))
    return out


def _props_json(props: dict) -> str | None:
    return json.dumps(props, default=str) if props else None


def _times(ms: list[int]) -> pa.Array:
    """ms since the epoch as microsecond timestamps; 0 (not known) as null."""
    arr = pc.multiply(pa.array(ms, pa.int64()), 1000)
    if 0 in ms:
        arr = pc.if_else(pc.equal(arr, 0), pa.scalar(None, pa.int64()), arr)
    return arr.cast(_US)
