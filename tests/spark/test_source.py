"""The `lightgate` data source: batch reads by offsets, streaming with a rate limit, the
batch sink."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from tests.spark.conftest import require_spark

require_spark()

from spark_streaming.native import StoreClient  # noqa: E402
from spark_streaming.source import cap_offsets, resolve_offsets  # noqa: E402
from store.sdk import Producer  # noqa: E402
from tests.conftest import Server  # noqa: E402
from tests.spark.conftest import progress_summary  # noqa: E402


def test_resolve_offsets() -> None:
    ranges = {"t#0": (2, 10), "t#1": (0, 5)}
    assert resolve_offsets("earliest", ranges, "latest") == {"t#0": 2, "t#1": 0}
    assert resolve_offsets(None, ranges, "latest") == {"t#0": 10, "t#1": 5}
    assert resolve_offsets('{"t#0": 4}', ranges, "latest") == {"t#0": 4, "t#1": 5}
    assert resolve_offsets('{"t#0": -2, "t#1": -1}', ranges, "earliest") == {"t#0": 2,
                                                                            "t#1": 5}
    with pytest.raises(ValueError, match="no such queues"):
        resolve_offsets('{"t#9": 1}', ranges, "latest")
    with pytest.raises(ValueError, match="earliest, latest or JSON"):
        resolve_offsets("newest", ranges, "latest")


def test_cap_offsets() -> None:
    start = {"a": 0, "b": 10}
    ends = {"a": 100, "b": 20}
    capped = cap_offsets(start, ends, 22)
    assert capped == {"a": 20, "b": 12}
    assert cap_offsets(start, ends, 1000) == ends
    assert sum(capped[q] - start[q] for q in capped) <= 22


def _publish(addr: str, n: int, devices: int = 3) -> None:
    with Producer(addr) as p:
        for i in range(n):
            d = i % devices
            p.send("devices", json.dumps({"temperature": i, "ts": 1_700_000_000_000 + i})
                   .encode(), mqtt_topic=f"devices/d{d}/temp", qos=1)


def test_batch_reader_offsets(spark: Any, server: Server) -> None:
    _publish(server.native, 40)
    with StoreClient(server.native) as c:
        queues = {q["queue"]: (q["min_offset"], q["max_offset"]) for q in c.describe("devices")}
        every = {(q, off): m.body for q, (lo, hi) in queues.items()
                 for off, m in c.read_range(q, lo, hi)}
    assert len(every) == 40
    start = {q: min(1, hi) for q, (lo, hi) in queues.items()}
    end = {q: max(start[q], hi - 1) for q, (lo, hi) in queues.items()}
    df = (spark.read.format("lightgate").option("server", server.native).option("topic", "devices")
          .option("startingOffsets", json.dumps(start))
          .option("endingOffsets", json.dumps(end)).load())
    rows = df.collect()
    got = {(r.queue, r.offset): bytes(r.payload) for r in rows}
    want = {k: v for k, v in every.items() if start[k[0]] <= k[1] < end[k[0]]}
    assert got == want and len(rows) == len(want) > 0
    r = rows[0]
    assert r.mqtt_topic.startswith("devices/d") and r.qos == 1 and len(r.msg_id) == 16
    assert r.store_time is not None and r.born_time is not None
    # Defaults: earliest to latest, every record once.
    assert spark.read.format("lightgate").option("server", server.native) \
        .option("topic", "devices").load().count() == 40


def test_stream_rate_limit_and_batch_sink(spark: Any, server: Server, tmp_path: Any) -> None:
    _publish(server.native, 60)
    q = (spark.readStream.format("lightgate").option("server", server.native)
         .option("topic", "devices").option("startingOffsets", "earliest")
         .option("maxOffsetsPerTrigger", "25").load()
         .writeStream.format("memory").queryName("ratelimited")
         .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True).start())
    assert q.awaitTermination(120), progress_summary(q)
    assert q.exception() is None, progress_summary(q)
    sizes = [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]]
    assert sum(sizes) == 60 and max(sizes) <= 25 and len(sizes) >= 3, sizes
    assert spark.sql("select count(distinct msg_id) from ratelimited").first()[0] == 60

    # The sink: value as a string, per-row MQTT topic, key and properties.
    out = spark.createDataFrame(
        [("cmd/d1/set", "on", "k1", '{"reason": "test"}'), (None, "plain", None, None)],
        "mqtt_topic string, value string, key string, properties string")
    (out.withColumn("mqtt_topic", out.mqtt_topic)
     .selectExpr("case when mqtt_topic is null then null else mqtt_topic end as mqtt_topic",
                 "value", "key", "properties")
     .write.format("lightgate").option("server", server.native).option("topic", "cmd")
     .mode("append").save())
    back = (spark.read.format("lightgate").option("server", server.native).option("topic", "cmd")
            .load().collect())
    by_body = {bytes(r.payload): r for r in back}
    assert set(by_body) == {b"on", b"plain"}
    assert by_body[b"on"].mqtt_topic == "cmd/d1/set"
    assert json.loads(by_body[b"on"].properties) == {"reason": "test"}
    assert by_body[b"plain"].mqtt_topic == "cmd"


def test_reader_and_writer_with_auth(spark: Any, tmp_path: Any) -> None:
    """A store with --auth: the source reads and the sink writes with a user's rights."""
    from tests.security.helpers import add_user, allow, auth_server

    srv = auth_server(tmp_path)
    try:
        add_user(srv, "spark", "spark-pw")
        # The first-level topic and the MQTT topics its messages carry: a reader gets
        # only the messages whose topic it may read, as an MQTT subscriber does.
        allow(srv, "spark", "Topic:devices", "SUB", match="prefixed")
        allow(srv, "spark", "Topic:results", "PUB,SUB")
        with Producer(srv.native, username="admin", password="admin-secret") as p:
            p.send_batch("devices", [b"%d" % i for i in range(5)], mqtt_topic="devices/d1")
        creds = {"username": "spark", "password": "spark-pw"}
        df = (spark.read.format("lightgate").option("server", srv.native)
              .option("topic", "devices").options(**creds).load())
        assert sorted(bytes(r.payload) for r in df.collect()) == [b"%d" % i for i in range(5)]
        df.select("payload").write.format("lightgate").option("server", srv.native) \
            .option("topic", "results").options(**creds).mode("append").save()
        back = spark.read.format("lightgate").option("server", srv.native) \
            .option("topic", "results").options(**creds).load().count()
        assert back == 5
        with pytest.raises(Exception, match="authentication failed|401"):
            spark.read.format("lightgate").option("server", srv.native) \
                .option("topic", "devices").load().count()
        with pytest.raises(Exception, match="403|denied"):  # no SUB on this topic
            spark.read.format("lightgate").option("server", srv.native) \
                .option("topic", "payroll").options(**creds).load().count()
    finally:
        assert srv.stop() == 0


def test_stream_reader_keeps_one_connection_and_pickles_without_it(server: Server) -> None:
    import pickle

    from spark_streaming.source import LightgateStreamReader

    _publish(server.native, 8)
    reader = LightgateStreamReader({"server": server.native, "topic": "devices",
                                    "startingoffsets": "earliest"})
    start = reader.initialOffset()
    ends = reader.latestOffset(start, None)
    assert sum(ends.values()) - sum(start.values()) == 8
    store = reader._store
    assert store is not None
    assert reader.reportLatestOffset() == ends  # what latestOffset just saw
    _publish(server.native, 2)
    assert sum(reader.latestOffset(ends, None).values()) == sum(ends.values()) + 2
    assert reader._store is store  # the same connection, trigger after trigger
    copy = pickle.loads(pickle.dumps(reader))  # as Spark ships it to executors
    assert copy._store is None and copy.topic == "devices"
    reader.stop()
    assert reader._store is None


def test_starting_timestamp(spark: Any, server: Server, tmp_path: Any) -> None:
    """Each queue starts at its first record stored at or after the time, batch and
    stream alike, and the option wins over startingOffsets."""
    import time

    _publish(server.native, 30)
    time.sleep(0.05)
    mark = int(time.time() * 1000)
    time.sleep(0.05)
    _publish(server.native, 12)

    def reader() -> Any:
        return (spark.read.format("lightgate").option("server", server.native)
                .option("topic", "devices").option("startingOffsets", "earliest"))

    rows = reader().option("startingTimestamp", str(mark)).load().collect()
    assert len(rows) == 12
    assert min(r.store_time.timestamp() * 1000 for r in rows) >= mark
    assert reader().option("startingTimestamp", "0").load().count() == 42
    assert reader().option("startingTimestamp", str(mark + 3_600_000)).load().count() == 0
    with pytest.raises(Exception, match="'startingTimestamp' must be ms since the epoch"):
        reader().option("startingTimestamp", "2025-01-01").load().count()

    q = (spark.readStream.format("lightgate").option("server", server.native)
         .option("topic", "devices").option("startingTimestamp", str(mark)).load()
         .writeStream.format("memory").queryName("since_mark")
         .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True).start())
    assert q.awaitTermination(120), progress_summary(q)
    assert q.exception() is None, progress_summary(q)
    assert spark.sql("select count(*) from since_mark").first()[0] == 12


# -- a trigger that finds nothing waits for the next record (waitMs) -----------------------
def _send_later(addr: str, delay: float) -> threading.Thread:
    def send() -> None:
        time.sleep(delay)
        _publish(addr, 1)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def test_wait_for_records_answers_when_one_lands(server: Server) -> None:
    _publish(server.native, 4)
    with StoreClient(server.native) as c:
        ends = {q["queue"]: int(q["max_offset"]) for q in c.describe("devices")}
        start = time.monotonic()
        assert not c.wait_for_records(ends, 300)  # nothing lands: False after the wait
        assert 0.25 < time.monotonic() - start < 5
        sender = _send_later(server.native, 0.3)
        start = time.monotonic()
        assert c.wait_for_records(ends, 20_000)
        assert time.monotonic() - start < 5  # at the record, not at the end of the wait
        sender.join()
        assert c.describe("devices")  # the client connects again after the wait


def test_stream_reader_waits_for_the_next_record(server: Server) -> None:
    from spark_streaming.source import LightgateStreamReader

    _publish(server.native, 4)
    reader = LightgateStreamReader({"server": server.native, "topic": "devices",
                                    "waitms": "20000"})
    try:
        ends = reader.latestOffset(None)
        assert reader.latestOffset({q: 0 for q in ends}) == ends  # new records: no wait
        sender = _send_later(server.native, 0.3)
        start = time.monotonic()
        grown = reader.latestOffset(dict(ends))
        assert time.monotonic() - start < 5
        assert sum(grown.values()) == sum(ends.values()) + 1
        sender.join()
        reader.prepareForTriggerAvailableNow()  # a fixed end: never waits
        start = time.monotonic()
        assert reader.latestOffset(dict(grown)) == grown
        assert time.monotonic() - start < 5
    finally:
        reader.stop()


def test_wait_option_is_checked() -> None:
    from spark_streaming.source import LightgateStreamReader

    with pytest.raises(ValueError, match="waitMs"):
        LightgateStreamReader({"topic": "devices", "waitms": "soon"})


def test_trigger_wait_ms() -> None:
    from spark_streaming.jobs.common import interval_ms, trigger_wait_ms

    assert interval_ms("interval 2 minutes") == 120_000
    assert interval_ms("500 milliseconds") == 500
    assert interval_ms("1 fortnight") is None
    assert trigger_wait_ms("1 second") == 900  # most of the interval
    assert trigger_wait_ms("0.2 seconds") == 180
    assert trigger_wait_ms("0 seconds") == 500  # back to back: one poll at a time
    assert trigger_wait_ms("1 minute") == 1000  # a stopping query waits at most this
    assert trigger_wait_ms("whenever") == 0
