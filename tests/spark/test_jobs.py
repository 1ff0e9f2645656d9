"""The aggregates job stopped mid-stream and restarted from its checkpoint: every
message counted exactly once."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.spark.conftest import require_spark

require_spark()
# Tens of seconds of micro-batches on a 2-core machine: marked slow, and e2e so that
# `make test` (CI) runs it anyway.
pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(600)]

from spark_streaming.jobs import aggregates  # noqa: E402
from spark_streaming.jobs.common import JobConfig  # noqa: E402
from store.sdk import Producer  # noqa: E402
from tests.conftest import Server  # noqa: E402
from tests.spark.conftest import (  # noqa: E402
    processed_offsets,
    progress_summary,
    wait_caught_up,
    wait_until,
)

DEVICES = 3
LIMIT = 10  # maxOffsetsPerTrigger: the second lot takes several batches


def _publish(p: Producer, start: int, n: int, ts: int) -> Counter:
    sent: Counter = Counter()
    for i in range(start, start + n):
        dev = f"d{i % DEVICES}"
        p.send("devices", json.dumps({"temperature": 20 + i % 7, "ts": ts + i}).encode(),
               mqtt_topic=f"devices/{dev}/temp", qos=1)
        sent[dev] += 1
    return sent


def _final_counts(spark: Any, addr: str) -> Counter:
    """The last update of each (device, window) holds its count: sum them per device."""
    rows = (spark.read.format("lightgate").option("server", addr).option("topic", "analytics")
            .load().orderBy("queue", "offset").collect())
    latest: dict[tuple, dict] = {}
    for r in rows:
        body = json.loads(bytes(r.payload))
        assert r.mqtt_topic == f"analytics/{body['device']}"
        latest[(body["device"], body["kind"], body["window_start"])] = body
    out: Counter = Counter()
    for (dev, kind, _), body in latest.items():
        if kind == "tumbling":
            out[dev] += body["count"]
    return out


def test_aggregates_restart_no_loss_no_duplicates(spark: Any, server: Server,
                                                  tmp_path: Path) -> None:
    cfg = JobConfig(server=server.native, checkpoint=str(tmp_path / "ck"),
                    starting_offsets="earliest", trigger="0.5 seconds", watermark="1 hour",
                    max_offsets_per_trigger=LIMIT)
    ts = int(time.time() * 1000)
    with Producer(server.native) as p:
        sent = _publish(p, 0, 30, ts)
        [q] = aggregates.start(spark, cfg, window="10 seconds")
        try:
            wait_caught_up(q, server.native, "devices")
            before = sum(processed_offsets(q).values())
            assert before == 30, progress_summary(q)
            sent += _publish(p, 30, 45, ts)
            # Stop mid-stream: after a batch took some of the new readings (at most LIMIT
            # of 45 per batch, so most are still unread), while the next batch runs if one
            # starts within a second (trigger 0.5 s): its rows are then replayed from the
            # offset log on restart.
            wait_until(lambda: sum(processed_offsets(q).values()) > before, 120,
                       "a batch of the second lot", lambda: progress_summary(q))
            deadline = time.monotonic() + 1.0
            while not q.status["isTriggerActive"] and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            q.stop()
        assert q.exception() is None, progress_summary(q)
        taken = sum(processed_offsets(q).values())
        assert before < taken < 75, f"not stopped mid-stream: {progress_summary(q)}"
        sent += _publish(p, 75, 30, ts)
    # The restart replays the interrupted batch from the offset log (its range is logged,
    # whatever the limit), then reads the rest without a limit.
    cfg.max_offsets_per_trigger = None
    [q] = aggregates.start(spark, cfg, window="10 seconds")
    try:
        wait_caught_up(q, server.native, "devices", timeout=240)
    finally:
        q.stop()
    assert q.exception() is None, progress_summary(q)
    counts = _final_counts(spark, server.native)
    assert counts == sent and sum(counts.values()) == 105
