"""The reader's Arrow path: the same rows as the tuple path it replaced (binary payloads,
properties with bytes in them, empty client ids, null born times, offsets), from the
records the store hands out as its log holds them (PULL `raw`) and from decoded
messages, pipelined pulls across chunk boundaries, partial answers and a dropped
connection, a query reading some of the columns, and the single-parse `readings` equal
to the get_json_object one."""

from __future__ import annotations

import datetime
import json
import socket
from typing import Any

import pytest

from tests.spark.conftest import require_spark

require_spark()

import pyarrow as pa  # noqa: E402

from spark_streaming.native import StoreClient  # noqa: E402
from spark_streaming.raw_rows import arrow_from_records  # noqa: E402
from spark_streaming.source import (  # noqa: E402
    ARROW_SCHEMA,
    SCHEMA,
    QueueRange,
    arrow_batch,
    read_queue,
    read_queue_arrow,
)
from store.record import Message  # noqa: E402
from store.sdk import Producer  # noqa: E402
from tests.conftest import Server  # noqa: E402


def _fill(addr: str) -> None:
    """Messages that exercise every column: binary and empty bodies, MQTT 5-style
    properties (bytes inside), no client id, no born time, QoS 0/1/2."""
    with Producer(addr) as p:
        p.send_batch("devices", [json.dumps({"temperature": i, "ts": i}).encode()
                                 for i in range(60)], mqtt_topic="devices/d1/temp", qos=1)
        p.send("devices", bytes(range(256)), mqtt_topic="devices/d2/raw", qos=2,
               properties={"content_type": "application/octet-stream",
                           "correlation_data": b"\x00\xff\x10", "user": [["k", "v"]]})
        p.send("devices", b"", mqtt_topic="devices/d3/empty")
    with StoreClient(addr) as c:  # no client id, no born time, no properties
        c.send("devices", [Message("devices/d4/x", b"\x80\x81 not utf-8", 0, False, "", {},
                                   born_ts=0) for _ in range(3)])


def _queues(addr: str) -> dict[str, tuple[int, int]]:
    with StoreClient(addr) as c:
        return {q["queue"]: (int(q["min_offset"]), int(q["max_offset"]))
                for q in c.describe("devices")}


def _as_rows(batches: list[pa.RecordBatch]) -> list[tuple]:
    out = []
    for b in batches:
        assert b.schema.equals(ARROW_SCHEMA)
        for r in b.to_pylist():
            out.append(tuple(r.values()))
    return out


def test_arrow_schema_is_what_spark_expects(spark: Any) -> None:
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import StructType, _parse_datatype_string

    schema = _parse_datatype_string(SCHEMA)
    assert isinstance(schema, StructType)
    assert to_arrow_schema(schema, timezone="UTC").equals(ARROW_SCHEMA)


def test_arrow_rows_equal_tuple_rows(server: Server) -> None:
    _fill(server.native)
    opts = {"server": server.native, "topic": "devices"}
    queues = _queues(server.native)
    total = 0
    for q, (lo, hi) in queues.items():
        for start, end in ((lo, hi), (lo + 1, hi - 1), (lo, lo + 1), (hi, hi)):
            part = QueueRange(q, start, end)
            want = list(read_queue(opts, part))
            assert _as_rows(list(read_queue_arrow(opts, part))) == want
        total += hi - lo
    assert total == 65
    rows = [r for q, (lo, hi) in queues.items()
            for r in read_queue(opts, QueueRange(q, lo, hi))]
    by_topic = {r[0]: r for r in rows}
    raw = by_topic["devices/d2/raw"]
    assert raw[4] == bytes(range(256)) and raw[2] == 2
    assert json.loads(raw[3])["content_type"] == "application/octet-stream"
    assert by_topic["devices/d3/empty"][4] == b""
    bare = by_topic["devices/d4/x"]
    assert bare[1] == "" and bare[3] is None and bare[6] is None and bare[5] is not None


def test_pipelined_pulls_chunks_partial_answers_and_reconnect(server: Server) -> None:
    with Producer(server.native) as p:  # one key: every message in one partition queue
        for i in range(0, 2600, 500):
            p.send_batch("devices", [b"%d" % j for j in range(i, min(i + 500, 2600))],
                         key="same")
    queues = _queues(server.native)
    q, (lo, hi) = max(queues.items(), key=lambda kv: kv[1][1] - kv[1][0])
    assert hi - lo == 2600
    with StoreClient(server.native) as c:
        want = [(off, m.body) for off, m in c.read_range(q, lo, hi)]

        def collect(drop: bool = False, **kw: Any) -> list[tuple[int, bytes]]:
            got = []
            for c_lo, c_hi, header, body in c.pull_ranges(q, lo + 3, hi - 2, **kw):
                batch = (arrow_from_records(q, c_lo, c_hi, header["runs"], body, ARROW_SCHEMA)
                         if header.get("raw") else
                         arrow_batch(q, c_lo, c_hi, header["messages"], body))
                if batch is not None:
                    got += zip(batch.column("offset").to_pylist(),
                               batch.column("payload").to_pylist(), strict=True)
                if drop and c._sock is not None:  # the connection breaks under the pipeline
                    c._sock.shutdown(socket.SHUT_RDWR)
                    drop = False
            return got

        assert collect(depth=3, chunk=7) == want[3:-2]
        # 2000 per chunk, but the store answers at most 1024: follow-up pulls.
        assert collect(depth=2, chunk=2000) == want[3:-2]
        assert collect(depth=1, chunk=100) == want[3:-2]
        assert collect(depth=4, chunk=300, drop=True) == want[3:-2]
        # Records as the log holds them, decoded here.
        assert collect(depth=3, chunk=7, raw=True) == want[3:-2]
        assert collect(depth=2, chunk=2000, raw=True) == want[3:-2]
        assert collect(depth=4, chunk=300, drop=True, raw=True) == want[3:-2]


def test_arrow_batch_keeps_only_the_chunk() -> None:
    metas = [{"topic": "t/a", "size": 1, "queues": [["t#0", off]], "phys": off * 10,
              "store_ts": 5} for off in (4, 5, 6, 7)]
    batch = arrow_batch("t#0", 5, 7, metas, b"abcd")
    assert batch is not None
    assert batch.column("offset").to_pylist() == [5, 6]
    assert batch.column("payload").to_pylist() == [b"b", b"c"]
    assert batch.column("msg_id").to_pylist() == ["0000000000000032", "000000000000003C"]
    assert arrow_batch("t#0", 8, 9, metas, b"abcd") is None
    assert arrow_batch("t#0", 0, 9, [], b"") is None
    with pytest.raises(Exception, match="sizes"):
        arrow_batch("t#0", 0, 9, metas, b"abc")


def test_spark_reads_the_same_rows(spark: Any, server: Server) -> None:
    _fill(server.native)
    opts = {"server": server.native, "topic": "devices"}
    want = [r for q, (lo, hi) in _queues(server.native).items()
            for r in read_queue(opts, QueueRange(q, lo, hi))]
    rows = spark.read.format("lightgate").option("server", server.native) \
        .option("topic", "devices").load().orderBy("queue", "offset").collect()

    def plain(v: Any) -> Any:
        # collect() gives naive local datetimes, read_queue UTC ones: compare instants.
        if isinstance(v, datetime.datetime):
            return v.timestamp()
        return bytes(v) if isinstance(v, bytearray) else v

    got = [tuple(plain(v) for v in r) for r in rows]
    assert len(got) == 65
    assert got == sorted((tuple(plain(v) for v in r) for r in want), key=lambda r: (r[7], r[8]))


PAYLOADS = [
    b'{"temperature": 21.5, "ts": 1700000000000}',
    b'{"temperature": "22", "ts": "1700000000001"}',  # strings that cast
    b"23.5",  # a bare number counts as every field
    b'{"temperature": null}',  # no ts: the store time
    b'{"temperature": {"c": 1}, "ts": 5}',  # not a number
    b"not json",
    b"",
    b"[1, 2]",
    b'{"ts": 7, "nested": {"ts": 9}, "a.b": 3, "a": {"b": 4}, "dev": "x/y"}',
    b'{"temperature": 1e2, "ts": 1700000000002, "extra": [1, {"ts": 0}]}',
    b"\xff\xfe binary",
]


def test_readings_single_parse_equals_get_json_object(spark: Any) -> None:
    from pyspark.sql import functions as F  # noqa: N812

    from spark_streaming.jobs.common import device_column, field_value, readings

    def reference(df: Any, device_from: str, fields: list[str]) -> Any:
        """`readings` as it was (one get_json_object per key), with try_ casts."""
        text = F.col("payload").cast("string")
        ts = F.coalesce(F.get_json_object(text, "$.ts").try_cast("long"),
                        F.unix_millis(F.col("store_time")))
        cols = [device_column(device_from).alias("device"), F.col("mqtt_topic"),
                ts.alias("ts"), F.timestamp_millis(ts).alias("event_time"), F.col("msg_id")]
        cols += [field_value(f).alias(f) for f in dict.fromkeys(fields)]
        return df.select(*cols).where(F.col("device").isNotNull() & (F.col("device") != ""))

    rows = [(f"devices/d{i}/t", f"c{i}", 1, None, p, None, None, "devices#0", i, f"{i:016X}")
            for i, p in enumerate(PAYLOADS)]
    # Sent by a server app without an MQTT topic: no second level, so no device.
    rows.append(("devices", "", 0, None, b"42", None, None, "devices#1", 0, "F" * 16))
    df = spark.createDataFrame(rows, SCHEMA).withColumn(
        "store_time", F.timestamp_millis(F.lit(1_600_000_000_000) + F.col("offset")))
    # The same readings from the json_KEY columns the source parses (as the jobs read).
    from spark_streaming.json_fields import columns

    keys = [("ts", "long"), ("temperature", "double"), ("a", "double"), ("nested", "double")]
    parsed = columns([r[4] for r in rows], keys)
    from spark_streaming.raw_rows import topic_levels

    level = topic_levels([r[0].encode() for r in rows], pa.schema([("topic_1", pa.string())]))
    with_json = spark.createDataFrame(
        [(*r, *(col[i] for col in parsed), level["topic_1"][i] and level["topic_1"][i].decode())
         for i, r in enumerate(rows)],
        SCHEMA + ", json_ts long, json_temperature double, json_a double, json_nested double,"
        " topic_1 string"
    ).withColumn("store_time", F.timestamp_millis(F.lit(1_600_000_000_000) + F.col("offset")))
    for device_from, fields in (("topic:1", ["temperature"]),
                                ("client_id", ["temperature", "a.b", "ts", "nested"]),
                                ("json:dev", ["a", "temperature"]),
                                ("json:a.b", ["temperature"])):
        want = sorted(reference(df, device_from, fields).collect())
        got = sorted(readings(df, device_from, fields).collect())
        assert got == want, (device_from, fields)
        got = sorted(readings(with_json, device_from, fields).collect())
        assert got == want, ("json_ columns", device_from, fields)
    # Not a number: null, not a failed query (Spark 4 casts in ANSI mode).
    temps = {r.mqtt_topic: r.temperature for r in readings(df, "topic:1", ["temperature"])
             .collect()}
    assert "devices" not in temps and len(temps) == len(PAYLOADS)
    assert temps["devices/d5/t"] is None and temps["devices/d2/t"] == 23.5
    assert temps["devices/d1/t"] == 22.0 and temps["devices/d0/t"] == 21.5


def test_device_column_equals_split_and_regexp(spark: Any) -> None:
    """The device id cut out of the topic's bytes equals the level split off it, and the
    translated json id the regexp-replaced one."""
    from pyspark.sql import functions as F  # noqa: N812

    from spark_streaming.jobs.common import device_column

    topics = ["a/b/c/d", "a", "a/", "/b", "a//c", "", "a/b", "ä/ö/ü/", "x/y/z"]
    df = spark.createDataFrame([(t, f'{{"dev": "{t}+#"}}'.encode()) for t in topics],
                               "mqtt_topic string, payload binary")
    from spark_streaming.raw_rows import topic_levels

    for n in range(4):
        split = F.try_element_at(F.split(F.col("mqtt_topic"), "/"), F.lit(n + 1))
        got = df.select(device_column(f"topic:{n}").alias("d"), split.alias("w")).collect()
        assert [r.d for r in got] == [r.w for r in got], n
        # The level as the source cuts it (a topic_N column).
        cut = topic_levels([t.encode() for t in topics], pa.schema([(f"topic_{n}", pa.string())]))
        assert [None if v is None else v.decode() for v in cut[f"topic_{n}"]] == \
            [r.w for r in got], n
    old = F.regexp_replace(F.get_json_object(F.col("payload").cast("string"), "$.dev"),
                           "[/+#]", "_")
    got = df.select(device_column("json:dev").alias("d"), old.alias("w")).collect()
    assert [r.d for r in got] == [r.w for r in got]


def test_a_query_reading_some_columns(spark: Any, server: Server) -> None:
    """A schema naming some of the source's columns: only those are built, with the same
    values; a column the source has not is refused."""
    _fill(server.native)
    full = spark.read.format("lightgate").option("server", server.native) \
        .option("topic", "devices").load().select("msg_id", "payload", "store_time")
    some = spark.read.format("lightgate").schema("msg_id string, payload binary, "
                                                 "store_time timestamp") \
        .option("server", server.native).option("topic", "devices").load()
    assert sorted(some.collect()) == sorted(full.collect())
    # json_KEY columns: a payload's top-level KEY, as json_tuple and try_cast give it.
    from pyspark.sql import functions as F  # noqa: N812

    text = F.col("payload").cast("string")
    jvm = spark.read.format("lightgate").option("server", server.native) \
        .option("topic", "devices").load().select(
            "msg_id", F.json_tuple(text, "temperature", "ts").alias("t", "s")).select(
            "msg_id", F.col("t").try_cast("double").alias("json_temperature"),
            F.col("s").try_cast("long").alias("json_ts"))
    parsed = spark.read.format("lightgate").schema(
        "msg_id string, json_temperature double, json_ts long") \
        .option("server", server.native).option("topic", "devices").load()
    assert sorted(parsed.collect()) == sorted(jvm.collect())
    levels = spark.read.format("lightgate").schema("mqtt_topic string, topic_1 string") \
        .option("server", server.native).option("topic", "devices").load().collect()
    assert {r.topic_1 for r in levels} == {"d1", "d2", "d3", "d4"}
    assert all(r.mqtt_topic.split("/")[1] == r.topic_1 for r in levels)
    assert parsed.where("json_temperature is not null").count() == 60
    with pytest.raises(Exception, match="no column temperature"):
        spark.read.format("lightgate").schema("temperature double") \
            .option("server", server.native).option("topic", "devices").load().collect()
