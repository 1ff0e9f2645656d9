"""The `lightgate` sink writes each (query, batch, partition) once: a query restarted
from a checkpoint whose last batch's commit was lost (the driver died after the batch's
rows reached the store) replays that batch and stores nothing new, for the streaming
sink (the alerts job) and for a batch write in foreachBatch (the aggregates job)."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.spark.conftest import require_spark

require_spark()
pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(600)]

from spark_streaming.jobs import aggregates, alerts  # noqa: E402
from spark_streaming.jobs.common import JobConfig  # noqa: E402
from spark_streaming.jobs.rules import parse_rules  # noqa: E402
from store.sdk import Producer  # noqa: E402
from tests.conftest import Server  # noqa: E402
from tests.spark.conftest import read_topic, wait_caught_up  # noqa: E402

RULES = parse_rules({"rule": [{"name": "hot", "field": "temperature", "op": ">",
                               "threshold": 50}]})


def _publish(server: Server, n: int, start: int = 0) -> None:
    ts = int(time.time() * 1000)
    with Producer(server.native) as p:
        for i in range(start, start + n):
            p.send("devices", json.dumps({"temperature": 90 if i % 2 else 20,
                                          "ts": ts + i}).encode(),
                   mqtt_topic=f"devices/d{i % 3}/temp", qos=1)


def _forget_last_commit(checkpoint: Path) -> int:
    """What a driver killed between the batch's write and its commit leaves: the
    offsets of the batch, without its commit."""
    commits = sorted(int(p.name) for p in (checkpoint / "commits").glob("[0-9]*"))
    (checkpoint / "commits" / str(commits[-1])).unlink()
    return commits[-1]


def _run(start: Any, server: Server) -> None:
    queries = start()
    try:
        for q in queries:
            wait_caught_up(q, server.native, "devices")
    finally:
        for q in queries:
            q.stop()


def test_a_replayed_batch_stores_no_alert_twice(spark: Any, server: Server,
                                               tmp_path: Path) -> None:
    cfg = JobConfig(server=server.native, checkpoint=str(tmp_path / "ck"),
                    starting_offsets="earliest", trigger="0.2 seconds")
    _publish(server, 20)
    _run(lambda: alerts.start(spark, cfg, RULES), server)
    first = read_topic(server.native, "alerts")
    assert len(first) == 10
    _forget_last_commit(tmp_path / "ck" / "alerts-threshold")
    _publish(server, 6, start=20)
    _run(lambda: alerts.start(spark, cfg, RULES), server)  # replays, then the new ones
    got = Counter(body["ts"] for _, body in read_topic(server.native, "alerts"))
    assert len(got) == 13 and max(got.values()) == 1, got


def test_a_replayed_foreach_batch_stores_no_aggregate_twice(spark: Any, server: Server,
                                                            tmp_path: Path) -> None:
    cfg = JobConfig(server=server.native, checkpoint=str(tmp_path / "ck"),
                    starting_offsets="earliest", trigger="0.2 seconds", watermark="1 hour")
    _publish(server, 30)
    # The last batch is then the one with the data (not the watermark's batch after it).
    spark.conf.set("spark.sql.streaming.noDataMicroBatches.enabled", "false")
    try:
        _run(lambda: aggregates.start(spark, cfg, window="10 seconds"), server)
        first = [json.dumps(b, sort_keys=True) for _, b in read_topic(server.native,
                                                                      "analytics")]
        assert first
        _forget_last_commit(tmp_path / "ck" / "aggregates-tumbling")
        _run(lambda: aggregates.start(spark, cfg, window="10 seconds"), server)
    finally:
        spark.conf.unset("spark.sql.streaming.noDataMicroBatches.enabled")
    again = [json.dumps(b, sort_keys=True) for _, b in read_topic(server.native, "analytics")]
    assert sorted(again) == sorted(first)
