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
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

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

from spark_streaming.native import SEND_BATCH, StoreClient
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
DEFAULT_SERVER = "127.0.0.1:10911"
EARLIEST, LATEST = -2, -1  # as in Spark's Kafka source JSON offsets

Offsets = dict[str, int]


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


def _ms(ms: int) -> datetime | None:
    return datetime.fromtimestamp(ms / 1000, tz=UTC) if ms else None


def message_row(m: Message, queue: str, offset: int) -> tuple:
    props = json.dumps(m.properties, default=str) if m.properties else None
    return (m.topic, m.client_id, m.qos, props, m.body, _ms(m.store_ts), _ms(m.born_ts),
            queue, offset, format_msg_id(m.phys_offset))


def read_queue(options: dict[str, str], part: QueueRange) -> Iterator[tuple]:
    with _client(options) as c:
        for off, m in c.read_range(part.queue, part.start, part.end):
            yield message_row(m, part.queue, off)


def plan(start: Offsets, end: Offsets) -> list[QueueRange]:
    # A queue missing from `start` appeared after the query began: read it from 0.
    return [QueueRange(q, start.get(q, 0), hi) for q, hi in sorted(end.items())
            if hi > start.get(q, 0)]


class LightgateDataSource(DataSource):
    """Options: server (native HOST:PORT), topic (first-level), startingOffsets,
    endingOffsets (batch), maxOffsetsPerTrigger, username, password, timeout; for writing
    also qos (default 1)."""

    @classmethod
    def name(cls) -> str:
        return "lightgate"

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return LightgateBatchReader(_lower(self.options))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return LightgateStreamReader(_lower(self.options))

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        return LightgateWriter(_lower(self.options), schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        return LightgateStreamWriter(_lower(self.options), schema)


# -- reading -----------------------------------------------------------------------------
class LightgateBatchReader(DataSourceReader):
    """A backfill: startingOffsets (default earliest) to endingOffsets (default latest)."""

    def __init__(self, options: dict[str, str]) -> None:
        self.options = options
        self.topic = _topic(options)

    def partitions(self) -> Sequence[InputPartition]:
        ranges = _ranges(self.options, self.topic)
        start = resolve_offsets(self.options.get("startingoffsets"), ranges, "earliest")
        end = resolve_offsets(self.options.get("endingoffsets"), ranges, "latest")
        return plan(start, end)

    def read(self, partition: InputPartition) -> Iterator[tuple]:
        assert isinstance(partition, QueueRange)
        return read_queue(self.options, partition)


class LightgateStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, options: dict[str, str]) -> None:
        self.options = options
        self.topic = _topic(options)
        limit = options.get("maxoffsetspertrigger")
        self.max_per_trigger = int(limit) if limit else None
        self._target: Offsets | None = None  # Trigger.AvailableNow stops here

    def _ends(self) -> Offsets:
        return {q: hi for q, (_, hi) in _ranges(self.options, self.topic).items()}

    def initialOffset(self) -> dict:
        ranges = _ranges(self.options, self.topic)
        return resolve_offsets(self.options.get("startingoffsets"), ranges, "latest")

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
        ends = {**start, **ends}  # keep queues we know even if describe lost one
        max_rows = getattr(limit, "max_rows", None)
        if max_rows is None:
            return ends
        return cap_offsets(start, ends, int(max_rows))

    def reportLatestOffset(self) -> dict | None:
        return self._ends()

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        return plan(start, end)

    def read(self, partition: InputPartition) -> Iterator[tuple]:
        assert isinstance(partition, QueueRange)
        return read_queue(self.options, partition)

    def commit(self, end: dict) -> None:
        pass  # the store keeps everything until retention; nothing to release


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
class LightgateWriter(DataSourceWriter):
    """Rows to a first-level topic: body from `payload` or `value` (binary or string),
    optional `mqtt_topic` (delivered to MQTT subscribers), `key`, `properties` (JSON).
    At least once: a retried task may send its rows again."""

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

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        pass  # every write() already stored its rows

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        pass  # stored messages cannot be taken back; consumers see them (at least once)


class LightgateStreamWriter(LightgateWriter, DataSourceStreamWriter):
    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803
        pass

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803
        pass
