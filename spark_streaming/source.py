"""The `lightgate` PySpark data source: read a first-level topic (streaming or batch) and
write rows to one, over the native protocol.

    spark.dataSource.register(LightgateDataSource)
    df = (spark.readStream.format("lightgate").option("server", "127.0.0.1:10911")
          .option("topic", "devices").load())
    df.writeStream.format("lightgate").option("server", ...).option("topic", "alerts")...

Spark partitions are the topic's partition queues `topic#0..n-1`; an offset is a JSON
object `{"topic#0": next_offset, ...}`. `read()` pulls exactly [start, end) of one queue,
so a query restarted from its checkpoint reads exactly the same records again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import accumulate
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

from serving.values import NATIVE_ADDR
from spark_streaming import json_fields as jf
from spark_streaming.native import SEND_BATCH, StoreClient
from spark_streaming.raw_rows import arrow_from_records, json_keys, topic_level, topic_levels
from spark_streaming.worker_heap import freeze_imports
from store.protocol import ProtocolError, RemoteError
from store.record import Message, format_msg_id

try:  # admission control (maxOffsetsPerTrigger) is Spark 4.2+
    from pyspark.sql.streaming.datasource import (
        ReadAllAvailable,
        ReadLimit,
        ReadMaxRows,
        SupportsTriggerAvailableNow,
    )
except ImportError:  # pragma: no cover - Spark 4.0/4.1
    ReadLimit = ReadMaxRows = ReadAllAvailable = None  # type: ignore[assignment,misc]
    SupportsTriggerAvailableNow = object  # type: ignore[assignment,misc]

SCHEMA = ("mqtt_topic string, client_id string, qos int, properties string, payload binary, "
          "store_time timestamp, born_time timestamp, queue string, offset long, msg_id string")
DEFAULT_SERVER = NATIVE_ADDR
EARLIEST, LATEST = -2, -1  # as in Spark's Kafka source JSON offsets

Offsets = dict[str, int]

freeze_imports()  # in a reused Spark Python worker: what is imported by now, see worker_heap


@dataclass
class QueueRange(InputPartition):
    """One Spark partition: [start, end) of one partition queue."""

    queue: str
    start: int
    end: int


class _Commit(WriterCommitMessage):
    def __init__(self, count: int) -> None:
        self.count = count


def _lower(options: Any) -> dict[str, str]:
    # Spark hands options over case-insensitively (lower-cased keys): look them up so.
    return {str(k).lower(): str(v) for k, v in options.items()}


def _client(options: dict[str, str]) -> StoreClient:
    return StoreClient(options.get("server", DEFAULT_SERVER),
                       timeout=float(options.get("timeout", "30")),
                       username=options.get("username"), password=options.get("password"))


# An executor's Python worker runs task after task (spark.python.worker.reuse): its
# connection to the store, and the producer ids it was given, are kept for the next
# task rather than made again (a connection and a HELLO, a PRODUCER_INIT: round trips
# in every micro-batch's read and write).
_IDLE: dict[tuple, StoreClient] = {}
_PRODUCERS: dict[tuple, str] = {}


def _key(options: dict[str, str]) -> tuple:
    return (options.get("server", DEFAULT_SERVER), options.get("timeout", "30"),
            options.get("username"), options.get("password"))


@contextmanager
def _kept_client(options: dict[str, str]) -> Iterator[StoreClient]:
    """A connection to the store kept between this worker's tasks; closed instead when
    the task's use of it failed (it may be in the middle of an answer)."""
    key = _key(options)
    client = _IDLE.pop(key, None) or _client(options)
    try:
        yield client
    except BaseException:
        client.close()
        raise
    old = _IDLE.pop(key, None)
    if old is not None:
        old.close()
    _IDLE[key] = client


def _producer(c: StoreClient, options: dict[str, str], name: str, fresh: bool = False
              ) -> str:
    """The id of the named producer (kept by this worker; `fresh`: ask again)."""
    key = (*_key(options), name)
    if fresh or key not in _PRODUCERS:
        if len(_PRODUCERS) >= 10_000:
            _PRODUCERS.clear()
        _PRODUCERS[key] = c.init_producer(name)
    return _PRODUCERS[key]


def _topic(options: dict[str, str]) -> str:
    topic = options.get("topic")
    if not topic or "/" in topic or "#" in topic or "+" in topic:
        raise ValueError(f"option 'topic' must be a first-level topic, got {topic!r}")
    return topic


def _ranges(options: dict[str, str], topic: str) -> dict[str, tuple[int, int]]:
    with _client(options) as c:
        return {q["queue"]: (int(q["min_offset"]), int(q["max_offset"]))
                for q in c.describe(topic)}


def resolve_offsets(spec: str | None, ranges: dict[str, tuple[int, int]],
                    default: str) -> Offsets:
    """'earliest' | 'latest' | JSON {"topic#0": n | -2 (earliest) | -1 (latest)}: concrete
    offsets for every queue. Queues missing from the JSON take `default`."""
    spec = (spec or default).strip()
    if spec in ("earliest", "latest"):
        return {q: lo if spec == "earliest" else hi for q, (lo, hi) in ranges.items()}
    try:
        given = json.loads(spec)
    except ValueError as exc:
        raise ValueError(f"offsets must be earliest, latest or JSON, got {spec!r}") from exc
    if not isinstance(given, dict):
        raise ValueError(f"offsets JSON must be an object, got {spec!r}")
    unknown = set(given) - set(ranges)
    if unknown:
        raise ValueError(f"no such queues {sorted(unknown)}; the topic has {sorted(ranges)}")
    out = resolve_offsets(default, ranges, default)
    for q, off in given.items():
        lo, hi = ranges[q]
        out[q] = lo if off == EARLIEST else hi if off == LATEST else int(off)
    return out


def starting_timestamp(options: dict[str, str]) -> int | None:
    """The `startingTimestamp` option: ms since the epoch (None when not given)."""
    raw = options.get("startingtimestamp")
    if raw is None:
        return None
    if not raw.strip().isdigit():
        raise ValueError(f"option 'startingTimestamp' must be ms since the epoch, got {raw!r}")
    return int(raw)


def starting_offsets(options: dict[str, str], ranges: dict[str, tuple[int, int]],
                     default: str) -> Offsets:
    """Where each queue starts: at the first offset stored at or after startingTimestamp
    when it is given (it wins over startingOffsets; a queue with nothing that late
    starts at its end), else as startingOffsets says."""
    ms = starting_timestamp(options)
    if ms is None:
        return resolve_offsets(options.get("startingoffsets"), ranges, default)
    with _client(options) as c:
        return {q: c.seek_time(q, ms) for q in ranges}


def _ms(ms: int) -> datetime | None:
    return datetime.fromtimestamp(ms / 1000, tz=UTC) if ms else None


def message_row(m: Message, queue: str, offset: int) -> tuple:
    props = json.dumps(m.properties, default=str) if m.properties else None
    return (m.topic, m.client_id, m.qos, props, m.body, _ms(m.store_ts), _ms(m.born_ts),
            queue, offset, format_msg_id(m.phys_offset))


def read_queue(options: dict[str, str], part: QueueRange) -> Iterator[tuple]:
    """[start, end) of one queue as row tuples: the reference for `read_queue_arrow`."""
    with _client(options) as c:
        for off, m in c.read_range(part.queue, part.start, part.end):
            yield message_row(m, part.queue, off)


def arrow_schema() -> pa.Schema:
    """SCHEMA as Arrow, exactly as Spark expects a Python data source's batches
    (`to_arrow_schema(schema, timezone="UTC")`; a test checks they are equal)."""
    ts = pa.timestamp("us", tz="UTC")
    return pa.schema([("mqtt_topic", pa.string()), ("client_id", pa.string()),
                      ("qos", pa.int32()), ("properties", pa.string()),
                      ("payload", pa.binary()), ("store_time", ts), ("born_time", ts),
                      ("queue", pa.string()), ("offset", pa.int64()),
                      ("msg_id", pa.string())])


ARROW_SCHEMA = arrow_schema()
_US = pa.timestamp("us", tz="UTC")


def _offsets_in(metas: list[dict[str, Any]], queue: str) -> list[int]:
    out = []
    for meta in metas:
        for name, off in meta.get("queues", ()):
            if name == queue:
                out.append(off)
                break
        else:
            raise ProtocolError(f"a message pulled from {queue} is not in it: {meta}")
    return out


def arrow_batch(queue: str, lo: int, hi: int, metas: list[dict[str, Any]],
                body: bytes) -> pa.RecordBatch | None:
    """One PULL response (message descriptions and the bodies concatenated, as
    store/protocol.py packs them) as a RecordBatch of SCHEMA, keeping the messages whose
    offset in `queue` is in [lo, hi). The same values as `message_row`, built a column at
    a time; payloads are one buffer, not a bytes object per row."""
    if not metas:
        return None
    offsets = _offsets_in(metas, queue)
    sizes = [meta["size"] for meta in metas]
    ends = list(accumulate(sizes, initial=0))
    if ends[-1] != len(body) or min(sizes) < 0:
        raise ProtocolError("message sizes do not match the body")
    n = len(metas)
    payload = pa.Array.from_buffers(pa.binary(), n, [
        None, pa.array(ends, pa.int32()).buffers()[1], pa.py_buffer(body)])
    get = dict.get
    batch = pa.RecordBatch.from_arrays([
        pa.array([meta["topic"] for meta in metas], pa.string()),
        pa.array([get(meta, "client_id", "") for meta in metas], pa.string()),
        pa.array([get(meta, "qos", 0) for meta in metas], pa.int32()),
        pa.array([json.dumps(meta["props"], default=str) if get(meta, "props") else None
                  for meta in metas], pa.string()),
        payload,
        pa.array([get(meta, "store_ts", 0) * 1000 or None for meta in metas], _US),
        pa.array([get(meta, "born_ts", 0) * 1000 or None for meta in metas], _US),
        pa.array([queue] * n, pa.string()),
        pa.array(offsets, pa.int64()),
        pa.array([format_msg_id(get(meta, "phys", -1)) for meta in metas], pa.string()),
    ], schema=ARROW_SCHEMA)
    if min(offsets) >= lo and max(offsets) < hi:
        return batch
    kept = batch.filter(pa.array([lo <= off < hi for off in offsets]))
    return kept if kept.num_rows else None


def read_queue_arrow(options: dict[str, str], part: QueueRange,
                     schema: pa.Schema = ARROW_SCHEMA) -> Iterator[pa.RecordBatch]:
    """[start, end) of one queue as Arrow RecordBatches of `schema` (the source's columns
    a query reads), pulled with requests in flight: the same rows as `read_queue`,
    without a Python tuple per row. The store hands out its records as its log holds
    them (PULL `raw`) and they are decoded here, only as far as the columns need."""
    freeze_imports()
    with _kept_client(options) as c:
        for lo, hi, header, body in c.pull_ranges(part.queue, part.start, part.end,
                                                  raw=True):
            if header.get("raw"):
                batch = arrow_from_records(part.queue, lo, hi, header["runs"], body, schema)
            else:  # a store that answers with decoded messages
                batch = arrow_batch(part.queue, lo, hi, header["messages"], body)
                batch = _select(batch, schema) if batch is not None else None
            if batch is not None:
                yield batch


def _select(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """The columns of `schema` from a batch of every column (json_KEY ones parsed from
    its payloads, topic_N ones cut from its topics)."""
    fields = json_keys(schema)
    parsed = dict(zip([jf.PREFIX + k for k, _ in fields],
                      jf.columns(batch.column("payload").to_pylist(), fields), strict=True))
    topics = [t.encode() for t in batch.column("mqtt_topic").to_pylist()]
    parsed.update(topic_levels(topics, schema))
    return pa.RecordBatch.from_arrays(
        [pa.array(parsed[f.name], f.type) if f.name in parsed else batch.column(f.name)
         for f in schema], schema=schema)


def columns_of(schema: StructType | None) -> pa.Schema:
    """The Arrow schema of the source's columns a user-given schema names (some of
    SCHEMA's, with their types, in any order; json_KEY columns of type double or long: a
    JSON payload's top-level KEY, parsed here as Spark's try_cast(json_tuple(payload,
    KEY)) would, see json_fields; topic_N string: the N-th level of the MQTT topic,
    0-based, null when it has fewer): a query that reads only some of them has only
    those built and sent to Spark, and what it would compute per row in the JVM is
    computed where each record is decoded."""
    if schema is None or not schema.fields:
        return ARROW_SCHEMA
    from pyspark.sql import types as t

    text, stamp = t.StringType(), t.TimestampType()
    known = {"mqtt_topic": text, "client_id": text, "qos": t.IntegerType(),
             "properties": text, "payload": t.BinaryType(), "store_time": stamp,
             "born_time": stamp, "queue": text, "offset": t.LongType(), "msg_id": text}
    out = []
    for f in schema.fields:
        if f.name.startswith(jf.PREFIX) and len(f.name) > len(jf.PREFIX) and \
                f.dataType in (t.DoubleType(), t.LongType()):
            out.append(pa.field(f.name, pa.float64() if f.dataType == t.DoubleType()
                                else pa.int64()))
            continue
        if topic_level(f.name) is not None and f.dataType == text:
            out.append(pa.field(f.name, pa.string()))
            continue
        if known.get(f.name) != f.dataType:
            raise ValueError(f"the lightgate source has no column {f.name} "
                             f"{f.dataType.simpleString()}: its columns are {SCHEMA}, "
                             "json_KEY double or long (a payload's top-level KEY) and "
                             "topic_N string (a level of the MQTT topic)")
        out.append(ARROW_SCHEMA.field(f.name))
    return pa.schema(out)


def plan(start: Offsets, end: Offsets) -> list[QueueRange]:
    # A queue missing from `start` appeared after the query began: read it from 0.
    return [QueueRange(q, start.get(q, 0), hi) for q, hi in sorted(end.items())
            if hi > start.get(q, 0)]


class LightgateDataSource(DataSource):
    """Options: server (native HOST:PORT), topic (first-level), startingOffsets,
    startingTimestamp (ms since the epoch; wins over startingOffsets), endingOffsets
    (batch), maxOffsetsPerTrigger, username, password, timeout; for writing also qos
    (default 1), idempotence (auto: exactly once in a streaming query; off) and writeId
    (tells apart two writes to one topic in one foreachBatch)."""

    @classmethod
    def name(cls) -> str:
        return "lightgate"

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return LightgateBatchReader(_lower(self.options), schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return LightgateStreamReader(_lower(self.options), schema)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        return LightgateWriter(_lower(self.options), schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        return LightgateStreamWriter(_lower(self.options), schema)


# -- reading -----------------------------------------------------------------------------
class LightgateBatchReader(DataSourceReader):
    """A backfill: startingOffsets (default earliest) to endingOffsets (default latest)."""

    def __init__(self, options: dict[str, str], schema: StructType | None = None) -> None:
        self.options = options
        self.topic = _topic(options)
        self.arrow = columns_of(schema)
        starting_timestamp(options)  # a bad value fails the query now, not at its start

    def partitions(self) -> Sequence[InputPartition]:
        ranges = _ranges(self.options, self.topic)
        start = starting_offsets(self.options, ranges, "earliest")
        end = resolve_offsets(self.options.get("endingoffsets"), ranges, "latest")
        return plan(start, end)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, QueueRange):
            return iter(())  # nothing to read: Spark runs one partition of its own
        return read_queue_arrow(self.options, partition, self.arrow)


class LightgateStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, options: dict[str, str], schema: StructType | None = None) -> None:
        self.options = options
        self.topic = _topic(options)
        self.arrow = columns_of(schema)
        starting_timestamp(options)  # a bad value fails the query now, not at its start
        limit = options.get("maxoffsetspertrigger")
        self.max_per_trigger = int(limit) if limit else None
        self.wait_ms = read_wait_ms(options)
        self._target: Offsets | None = None  # Trigger.AvailableNow stops here
        # The driver side asks for the queue ends every trigger: one connection, kept.
        self._store: StoreClient | None = None
        self._seen: tuple[float, Offsets] | None = None  # (when, ends) of the last ask

    def __getstate__(self) -> dict[str, Any]:
        # Spark pickles the reader to run read() on executors: no socket in it.
        return {**self.__dict__, "_store": None}

    def _ends(self) -> Offsets:
        if self._store is None:
            self._store = _client(self.options)
        ends = {q["queue"]: int(q["max_offset"]) for q in self._store.describe(self.topic)}
        self._seen = (time.monotonic(), ends)
        return ends

    def initialOffset(self) -> dict:
        ranges = _ranges(self.options, self.topic)
        return starting_offsets(self.options, ranges, "latest")

    def getDefaultReadLimit(self) -> Any:
        if self.max_per_trigger and ReadMaxRows is not None:
            return ReadMaxRows(self.max_per_trigger)
        return ReadAllAvailable() if ReadAllAvailable is not None else None

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._ends()

    # Spark 4.2+ passes (start, limit); older versions call latestOffset() alone.
    def latestOffset(self, start: dict | None = None, limit: Any = None) -> dict:
        ends = self._target if self._target is not None else self._ends()
        if start is None:
            return ends
        if self._target is None and self.wait_ms and not _has_new(start, ends):
            ends = self._waited(ends)
        ends = {**start, **ends}  # keep queues we know even if describe lost one
        max_rows = getattr(limit, "max_rows", None)
        if max_rows is None:
            return ends
        return cap_offsets(start, ends, int(max_rows))

    def _waited(self, ends: Offsets) -> Offsets:
        """The queue ends once a record landed past `ends`, or `ends` after `waitMs`: a
        trigger that finds nothing new waits in the store (a long poll on a connection
        of its own) rather than leaving the record that lands next for the next trigger,
        up to the trigger interval away."""
        with _client(self.options) as waiter:
            landed = waiter.wait_for_records(ends, self.wait_ms)
        return self._ends() if landed else ends

    def reportLatestOffset(self) -> dict | None:
        # Spark asks right after latestOffset, for the progress report: what that saw.
        if self._seen is not None and time.monotonic() - self._seen[0] < 1.0:
            return dict(self._seen[1])
        return self._ends()

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        return plan(start, end)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, QueueRange):
            return iter(())  # nothing to read: Spark runs one partition of its own
        return read_queue_arrow(self.options, partition, self.arrow)

    def commit(self, end: dict) -> None:
        pass  # the store keeps everything until retention; nothing to release

    def stop(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None


def read_wait_ms(options: dict[str, str]) -> int:
    """The `waitMs` option: how long a trigger that finds no new record waits for one
    (0, the default: it does not wait)."""
    raw = options.get("waitms", "0").strip()
    if not raw.isdigit():
        raise ValueError(f"option 'waitMs' must be a whole number of milliseconds, got {raw!r}")
    return int(raw)


def _has_new(start: Offsets, ends: Offsets) -> bool:
    return any(hi > start.get(q, 0) for q, hi in ends.items())


def cap_offsets(start: Offsets, ends: Offsets, max_rows: int) -> Offsets:
    """At most `max_rows` offsets in total, spread over the queues in proportion to their
    lag (as Spark's Kafka source does), at least one per lagging queue."""
    lag = {q: max(0, hi - start.get(q, 0)) for q, hi in ends.items()}
    total = sum(lag.values())
    if total <= max_rows:
        return ends
    out = {}
    for q, hi in ends.items():
        lo = start.get(q, 0)
        share = max(1, lag[q] * max_rows // total) if lag[q] else 0
        out[q] = min(hi, lo + share)
    return out


# -- writing -----------------------------------------------------------------------------
def exactly_once_key(options: dict[str, str]) -> tuple[str, int] | None:
    """For a write task of a streaming micro-batch (a streaming sink, or a batch write in
    `foreachBatch`): the name of its idempotent producer, one per (query, write,
    partition), and its epoch, the batch id; None elsewhere (a plain batch write) or
    with `idempotence` off. Spark gives every task of a micro-batch its query's id and
    the batch id as local properties, and a query restarted from its checkpoint keeps
    its id."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    if options.get("idempotence", "auto").lower() == "off" or ctx is None:
        return None
    query, batch = ctx.getLocalProperty(QUERY_ID), ctx.getLocalProperty(BATCH_ID)
    if not query or batch is None or not batch.isdigit():
        return None
    write = options.get("writeid", "")
    return f"spark/{query}/{write}/{ctx.partitionId()}", int(batch)


QUERY_ID, BATCH_ID = "sql.streaming.queryId", "streaming.sql.batchId"


def _content(m: Message) -> tuple:
    return (m.topic, m.key, m.body, json.dumps(m.properties, sort_keys=True, default=str))


class LightgateWriter(DataSourceWriter):
    """Rows to a first-level topic: body from `payload` or `value` (binary or string),
    optional `mqtt_topic` (delivered to MQTT subscribers), `key`, `properties` (JSON).

    Exactly once in a streaming query (see `exactly_once_key`): each task is an
    idempotent producer named by query, write id and partition, its epoch the batch id,
    its messages numbered from 0, so a task or batch run again (a retried task, a
    restarted query replaying its last batch) sends the same numbers and the store keeps
    the first copy. A partition's rows go in one request when they fit one (SEND_BATCH);
    more are put in content order first, so that a run whose rows come in another order
    numbers each row as the first run did. At least once elsewhere."""

    def __init__(self, options: dict[str, str], schema: StructType) -> None:
        self.options = options
        self.topic = _topic(options)
        self.qos = int(options.get("qos", "1"))
        names = [f.name for f in schema.fields]
        body = "payload" if "payload" in names else "value" if "value" in names else None
        if body is None:
            raise ValueError(f"the lightgate sink needs a 'payload' or 'value' column: {names}")
        self.cols = {c: names.index(c) if c in names else None
                     for c in ("mqtt_topic", "key", "properties", "qos")}
        self.cols["body"] = names.index(body)
        if options.get("idempotence", "auto").lower() not in ("auto", "off"):
            raise ValueError("option 'idempotence' is auto or off, not "
                             f"{options['idempotence']!r}")

    def _message(self, row: Any, now: int) -> Message:
        cols = self.cols
        body = row[cols["body"]]
        if body is None:
            body = b""
        elif isinstance(body, str):
            body = body.encode()
        else:
            body = bytes(body)
        topic = row[cols["mqtt_topic"]] if cols["mqtt_topic"] is not None else None
        key = row[cols["key"]] if cols["key"] is not None else None
        props_raw = row[cols["properties"]] if cols["properties"] is not None else None
        qos = row[cols["qos"]] if cols["qos"] is not None else None
        props = json.loads(props_raw) if props_raw else {}
        return Message(topic or self.topic, body, self.qos if qos is None else int(qos),
                       False, "spark", props, born_ts=now, key=str(key or ""))

    def write(self, iterator: Iterator[Any]) -> WriterCommitMessage:
        freeze_imports()
        once = exactly_once_key(self.options)
        if once is not None:
            return self._write_once(iterator, *once)
        count = 0
        batch: list[Message] = []
        with _client(self.options) as c:
            for row in iterator:
                batch.append(self._message(row, int(time.time() * 1000)))
                if len(batch) >= SEND_BATCH:
                    c.send(self.topic, batch)
                    count += len(batch)
                    batch = []
            if batch:
                c.send(self.topic, batch)
                count += len(batch)
        return _Commit(count)

    def _write_once(self, iterator: Iterator[Any], name: str, epoch: int) -> _Commit:
        now = int(time.time() * 1000)
        msgs = [self._message(row, now) for row in iterator]
        if not msgs:
            return _Commit(0)
        if len(msgs) > SEND_BATCH:
            msgs.sort(key=_content)
        with _kept_client(self.options) as c:
            producer = _producer(c, self.options, name)
            for first in range(0, len(msgs), SEND_BATCH):
                chunk = msgs[first:first + SEND_BATCH]
                try:
                    c.send(self.topic, chunk, (producer, epoch, first))
                except RemoteError as exc:
                    if exc.status != 410 or first:  # forgotten: only before anything went
                        raise
                    producer = _producer(c, self.options, name, fresh=True)
                    c.send(self.topic, chunk, (producer, epoch, first))
        return _Commit(len(msgs))

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        pass  # every write() already stored its rows

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        pass  # stored messages cannot be taken back; a run again sends them once more,
        # which the store recognises in a streaming query (exactly once)


class LightgateStreamWriter(LightgateWriter, DataSourceStreamWriter):
    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803
        pass

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803
        pass
