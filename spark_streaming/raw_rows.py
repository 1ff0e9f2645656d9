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
from collections.abc import Sequence

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
    source's columns, in any order)."""
    want = set(schema.names)
    need_client, need_props = "client_id" in want, "properties" in want
    fields = json_keys(schema)
    payloads: list[bytes] | None = [] if fields else None
    topics: list[bytes] = []
    clients: list[bytes] = []
    qos: list[int] = []
    props: list[str | None] = []
    stored: list[int] = []
    born: list[int] = []
    offsets: list[int] = []
    phys_at: list[int] = []
    payload = bytearray()
    ends = [0]
    unpack = _HEAD.unpack_from
    pos = 0
    for phys, _, first, count in runs:
        for off in range(first, first + count):
            (magic, total, _crc, sts, bts, q, flags, lc, lt, lk, lp, lb,
             _nq) = unpack(body, pos)
            if lo <= off < hi:
                if magic != record.MAGIC:  # the rare wide record: decoded whole
                    m = record.decode(body, pos, phys)
                    topic, client = m.topic.encode(), m.client_id.encode()
                    prop = _props_json(m.properties)
                    data = m.body
                else:
                    a = pos + _AT
                    client = body[a:a + lc] if need_client else b""
                    a += lc
                    topic = body[a:a + lt]
                    a += lt + lk
                    prop = None
                    if lp and need_props:
                        raw = record.decode_properties(body[a:a + lp])
                        if flags & record.MARK_FIRST:
                            raw.pop(record.PRODUCER_PROP, None)
                        prop = _props_json(raw)
                    a += lp
                    data = body[a:a + lb]
                topics.append(topic)
                clients.append(client)
                qos.append(q)
                props.append(prop)
                stored.append(sts)
                born.append(bts)
                offsets.append(off)
                phys_at.append(phys)
                payload += data
                ends.append(len(payload))
                if payloads is not None:
                    payloads.append(bytes(data))
            pos += total
            phys += total
    n = len(offsets)
    if not n:
        return None
    columns = {
        "mqtt_topic": lambda: pa.array(topics, pa.string()),
        "client_id": lambda: pa.array(clients, pa.string()),
        "qos": lambda: pa.array(qos, pa.int32()),
        "properties": lambda: pa.array(props, pa.string()),
        "payload": lambda: pa.Array.from_buffers(pa.binary(), n, [
            None, pa.array(ends, pa.int32()).buffers()[1], pa.py_buffer(payload)]),
        "store_time": lambda: _times(stored),
        "born_time": lambda: _times(born),
        "queue": lambda: pa.repeat(pa.scalar(queue, pa.string()), n),
        "offset": lambda: pa.array(offsets, pa.int64()),
        "msg_id": lambda: pa.array([f"{x:016X}" for x in phys_at], pa.string()),
    }
    for name, values in topic_levels(topics, schema).items():
        columns[name] = lambda v=values: pa.array(v, pa.string())
    if fields:
        parsed = jf.columns(payloads or [], fields)
        for (key, typ), values in zip(fields, parsed, strict=True):
            columns[jf.PREFIX + key] = lambda v=values, t=typ: pa.array(
                v, pa.float64() if t == "double" else pa.int64())
    return pa.RecordBatch.from_arrays([columns[name]() for name in schema.names],
                                      schema=schema)


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
