"""The aggregates job stopped mid-stream and restarted from its checkpoint: every
message counted exactly once."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark", reason="pyspark not installed: pip install 'lightgate[spark]'")
pytest.importorskip("pyarrow", reason="pyarrow not installed: pip install 'lightgate[spark]'")
# Minutes on a 2-core machine (JVM start, query start-up): tests/spark as a whole
# takes over 4 minutes, so these run with `make soak` / `pytest -m slow`.
pytestmark = pytest.mark.slow

from spark_streaming.jobs import aggregates  # noqa: E402
from spark_streaming.jobs.common import JobConfig  # noqa: E402
from store.sdk import Producer  # noqa: E402
from tests.conftest import Server  # noqa: E402

DEVICES = 3


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


def test_aggregates_restart_no_loss_no_duplicates(spark: Any, lg: Server,
                                                  tmp_path: Path) -> None:
    cfg = JobConfig(server=lg.native, checkpoint=str(tmp_path / "ck"),
                    starting_offsets="earliest", trigger="0.5 seconds", watermark="1 hour")
    ts = int(time.time() * 1000)
    with Producer(lg.native) as p:
        sent = _publish(p, 0, 30, ts)
        [q] = aggregates.start(spark, cfg, window="10 seconds")
        q.processAllAvailable()
        sent += _publish(p, 30, 45, ts)
        time.sleep(0.7)  # let a trigger start on part of it, then stop mid-stream
        q.stop()
        sent += _publish(p, 75, 30, ts)
        [q] = aggregates.start(spark, cfg, window="10 seconds")
        try:
            q.processAllAvailable()
        finally:
            q.stop()
    assert q.exception() is None
    counts = _final_counts(spark, lg.native)
    assert counts == sent and sum(counts.values()) == 105
