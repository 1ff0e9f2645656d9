"""What every job shares: reading device readings from the store, writing to it."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F  # noqa: N812
from pyspark.sql.streaming import StreamingQuery

from spark_streaming.json_fields import PREFIX
from spark_streaming.raw_rows import TOPIC_LEVEL
from spark_streaming.source import SCHEMA


@dataclass
class JobConfig:
    server: str
    checkpoint: str
    source_topic: str = "devices"
    device_from: str = "topic:1"
    starting_offsets: str = "latest"
    max_offsets_per_trigger: int | None = None
    trigger: str = "1 second"
    watermark: str = "30 seconds"
    username: str | None = None  # when the store runs with --auth
    password: str | None = None

    def auth_options(self) -> dict[str, str]:
        return {"username": self.username, "password": self.password or ""} \
            if self.username else {}


def source(spark: SparkSession, cfg: JobConfig, columns: Sequence[str] | None = None,
           wait: bool = False) -> DataFrame:
    """The source topic as a stream; `columns` ("name type"): only those of the
    source's (the others are neither decoded nor handed to Spark). `wait`: a trigger
    that finds no new reading waits for one for most of the trigger interval (see
    `trigger_wait_ms`), so that a reading starts its micro-batch as it lands."""
    reader = (spark.readStream.format("lightgate").option("server", cfg.server)
              .option("topic", cfg.source_topic)
              .option("startingOffsets", cfg.starting_offsets)
              .options(**cfg.auth_options()))
    if wait:
        reader = reader.option("waitMs", str(trigger_wait_ms(cfg.trigger)))
    if columns:
        reader = reader.schema(", ".join(columns))
    if cfg.max_offsets_per_trigger:
        reader = reader.option("maxOffsetsPerTrigger", str(cfg.max_offsets_per_trigger))
    return reader.load()


_UNIT_MS = {"ms": 1, "millisecond": 1, "milli": 1, "s": 1000, "sec": 1000,
            "second": 1000, "m": 60_000, "min": 60_000, "minute": 60_000}
IDLE_WAIT_MS = 500  # with a 0 s trigger (batches back to back): how long one poll waits
# A stopping query waits for its trigger's poll to end: at most this long.
MAX_TRIGGER_WAIT_MS = 1000


def interval_ms(text: str) -> int | None:
    """A trigger interval as Spark writes it ("1 second", "0.2 seconds", "500
    milliseconds", "interval 2 minutes") in ms; None when it is not one of those."""
    words = text.lower().removeprefix("interval").split()
    if len(words) != 2:
        return None
    number, unit = words
    unit = unit.removesuffix("s") if unit not in ("s", "ms") else unit
    try:
        value = float(number)
    except ValueError:
        return None
    factor = _UNIT_MS.get(unit)
    return None if factor is None or value < 0 else round(value * factor)


def trigger_wait_ms(trigger: str) -> int:
    """How long a trigger that finds nothing waits for the next reading: most of the
    interval, leaving a margin for the trigger's own work (a trigger that outlasts its
    interval makes Spark warn that the query falls behind) and at most
    MAX_TRIGGER_WAIT_MS; with a 0 s trigger, where Spark asks again 10 ms after an
    empty one, IDLE_WAIT_MS. 0 when the interval is not understood."""
    interval = interval_ms(trigger)
    if interval is None:
        return 0
    if interval == 0:
        return IDLE_WAIT_MS
    return min(MAX_TRIGGER_WAIT_MS, max(0, interval - max(20, interval // 10)))


def reading_columns(device_from: str, fields: Sequence[str], ids: bool = True) -> list[str]:
    """The source's columns `readings` reads ("name type"; `ids`: with each message's
    topic and id): the payload's `ts` and plain-named `fields`, and a `topic:N` device
    id, among them, parsed by the source (json_KEY and topic_N columns: the same values
    as json_tuple and a cast, or a split of the topic, give in the JVM, at a fraction of
    the cost, see spark_streaming.json_fields)."""
    types = dict(col.split(" ", 1) for col in SCHEMA.split(", "))
    kind, _, arg = device_from.partition(":")
    names = ["payload", "store_time", *(["client_id"] if device_from == "client_id" else []),
             *(["mqtt_topic", "msg_id"] if ids else [])]
    parsed = [f"{PREFIX}ts long"] + [f"{PREFIX}{f} double" for f in dict.fromkeys(fields)
                                    if _PLAIN_KEY.fullmatch(f) and f != "ts"]
    if kind == "topic":  # the device's level, cut out of the topic by the source
        parsed.append(f"{TOPIC_LEVEL}{int(arg)} string")
    return [f"{n} {types[n]}" for n in names] + parsed


def device_column(spec: str, json_field: Callable[[str], Column] | None = None,
                  columns: Sequence[str] | None = None) -> Column:
    """`topic:N` (N-th level of the MQTT topic, 0-based), `client_id` or `json:FIELD`;
    `columns`: the source's, a topic_N among them is taken as it is."""
    kind, _, arg = spec.partition(":")
    if kind == "topic" and columns is not None and f"{TOPIC_LEVEL}{int(arg)}" in columns:
        return F.col(f"{TOPIC_LEVEL}{int(arg)}")  # cut out of the topic by the source
    if kind == "topic":
        # The level between the N-th and N+1-th "/" (null when the topic has fewer
        # levels), cut out of the bytes: no array of levels (split), no regular
        # expression. A topic name holds no + or # (MQTT), and a level no /.
        n, topic = int(arg), F.col("mqtt_topic")
        level = F.substring_index(F.substring_index(topic, "/", n + 1), "/", -1)
        if n == 0:
            return level
        if n == 1:
            return F.when(F.instr(topic, "/") > 0, level)
        slashes = F.length(topic) - F.length(F.replace(topic, F.lit("/"), F.lit("")))
        return F.when(slashes >= n, level)
    dev = (json_field or _json_path)(arg) if kind == "json" else F.col("client_id")
    # An id becomes one MQTT topic level: no separators or wildcards in it.
    return F.translate(dev, "/+#", "___")


def _json_path(name: str) -> Column:
    return F.get_json_object(F.col("payload").cast("string"), f"$.{name}")


def field_value(name: str) -> Column:
    """A JSON number from the payload; a payload that is a bare number counts as it.
    Anything else is null (try_cast: under ANSI mode, Spark 4's default, a cast of
    "hello" fails the query)."""
    text = F.col("payload").cast("string")
    return F.coalesce(F.get_json_object(text, f"$.{name}"), text).try_cast("double")


# A key that `$.key` names as itself (no path syntax in it): json_tuple can fetch it.
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]+")


def readings(df: DataFrame, device_from: str, fields: list[str]) -> DataFrame:
    """device, mqtt_topic and msg_id (when `df` has them), ts (ms), event_time (the
    payload's `ts` in ms, else the store's time), and one double column per field (a
    payload that is a bare number counts as each field; a value that is not a number is
    null, as is a `ts` that is not one: the store time is used then).

    The payload is parsed once per row: one json_tuple for `ts`, the fields and a
    `json:` device id, rather than a get_json_object (a JSON parser and a UTF-8 decoder)
    per key, which was most of the job's CPU time. For such keys json_tuple returns what
    `get_json_object(payload, "$.key")` does (the value's text, strings unquoted; null for
    a payload that is not an object or not JSON), except that when a key appears twice in
    one object json_tuple takes the last and get_json_object the first. Keys with path
    syntax (`a.b`, `a[0]`) still go through get_json_object."""
    text = F.col("payload").cast("string")
    kind, _, arg = device_from.partition(":")
    # Keys the source parsed already (json_KEY columns, see reading_columns): the value
    # try_cast(json_tuple(...)) gives, as a long (ts) or a double (the fields).
    parsed = {c[len(PREFIX):] for c in df.columns if c.startswith(PREFIX)}
    wanted = [*(["ts"] if "ts" not in parsed else []),
              *(f for f in fields if f not in parsed), *([arg] if kind == "json" else [])]
    keys = [k for k in dict.fromkeys(wanted) if _PLAIN_KEY.fullmatch(k)]
    if keys:
        df = df.select("*", F.json_tuple(text, *keys).alias(*[f"__lg_json_{i}"
                                                               for i in range(len(keys))]))

    def json_field(name: str) -> Column:
        return F.col(f"__lg_json_{keys.index(name)}") if name in keys else _json_path(name)

    def number(name: str) -> Column:
        """The field as a double; a payload that is not an object counts as its own
        text (a bare number)."""
        if name in parsed:  # its cast is null exactly where the one below is
            return F.coalesce(F.col(PREFIX + name), text.try_cast("double"))
        return F.coalesce(json_field(name), text).try_cast("double")

    given = F.col(PREFIX + "ts") if "ts" in parsed else json_field("ts").try_cast("long")
    ts = F.coalesce(given, F.unix_millis(F.col("store_time")))
    cols = [device_column(device_from, json_field, df.columns).alias("device"),
            *([F.col("mqtt_topic")] if "mqtt_topic" in df.columns else []),
            ts.alias("ts"), F.timestamp_millis(ts).alias("event_time"),
            *([F.col("msg_id")] if "msg_id" in df.columns else [])]
    cols += [number(f).alias(f) for f in dict.fromkeys(fields)]
    return df.select(*cols).where(F.col("device").isNotNull() & (F.col("device") != ""))


def sink(df: DataFrame, cfg: JobConfig, topic: str, name: str,
         output_mode: str = "append") -> StreamingQuery:
    """`df` has mqtt_topic and payload; rows go to the store's first-level `topic`.

    Python streaming sinks take append mode only, so update mode (aggregates) writes
    each micro-batch with the batch writer of the same data source."""
    writer = (df.writeStream.queryName(name).outputMode(output_mode)
              .option("checkpointLocation", f"{cfg.checkpoint.rstrip('/')}/{name}")
              .trigger(processingTime=cfg.trigger))
    if output_mode == "append":
        writer = (writer.format("lightgate").option("server", cfg.server)
                  .option("topic", topic).options(**cfg.auth_options()))
    else:
        server, auth = cfg.server, cfg.auth_options()

        def write_batch(batch: DataFrame, batch_id: int) -> None:
            (batch.write.format("lightgate").option("server", server).option("topic", topic)
             .options(**auth).mode("append").save())

        writer = writer.foreachBatch(write_batch)
    query = writer.start()
    wait_started(query)
    return query


def wait_started(query: StreamingQuery, timeout: float = 120.0) -> None:
    """Until the first trigger ran (or failed). Starting queries one after the other keeps
    Spark's Python planner processes from starting all at once: each must connect back
    to the JVM within 10 s, which a small loaded machine may miss."""
    deadline = time.monotonic() + timeout
    while query.isActive and query.lastProgress is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if not query.isActive and query.exception() is not None:
        raise RuntimeError(f"query {query.name} failed: {query.exception()}")


def json_payload(**cols: Any) -> Column:
    return F.to_json(F.struct(*[c.alias(k) for k, c in cols.items()])).alias("payload")
