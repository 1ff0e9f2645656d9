"""Per-device windowed aggregates of a JSON numeric field: count, min, avg, max.

Tumbling windows (`--window`), plus sliding windows when `--slide` is given, on event
time (the payload's `ts` in ms, else the store's time), with a watermark: readings later
than it are dropped and their window's state is freed. Output mode is update: each
trigger sends the windows that changed, so the last message for a (device, window) holds
its final figures. Rows go to the first-level topic `analytics`, MQTT topic
`analytics/{device}`; body: {"device", "field", "kind" (tumbling|sliding), "window_start",
"window_end" (ms), "count", "min", "avg", "max"}.
"""

from __future__ import annotations

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F  # noqa: N812
from pyspark.sql.streaming import StreamingQuery

from spark_streaming.jobs.common import (
    JobConfig,
    json_payload,
    reading_columns,
    readings,
    sink,
    source,
)

ANALYTICS_TOPIC = "analytics"


def aggregate(data: DataFrame, field: str, window: str, slide: str | None,
              watermark: str) -> DataFrame:
    win = F.window("event_time", window, slide) if slide else F.window("event_time", window)
    kind = "sliding" if slide else "tumbling"
    agg = (data.withWatermark("event_time", watermark)
           .groupBy(win.alias("w"), F.col("device"))
           .agg(F.count(F.lit(1)).alias("count"), F.min(field).alias("min"),
                F.avg(field).alias("avg"), F.max(field).alias("max")))
    return agg.select(
        F.concat(F.lit(f"{ANALYTICS_TOPIC}/"), F.col("device")).alias("mqtt_topic"),
        json_payload(device=F.col("device"), field=F.lit(field), kind=F.lit(kind),
                     window_start=F.unix_millis(F.col("w.start")),
                     window_end=F.unix_millis(F.col("w.end")), count=F.col("count"),
                     min=F.col("min"), avg=F.col("avg"), max=F.col("max")))


def start(spark: SparkSession, cfg: JobConfig, field: str = "temperature",
          window: str = "10 seconds", slide: str | None = None) -> list[StreamingQuery]:
    data = readings(source(spark, cfg, reading_columns(cfg.device_from, [field], ids=False)),
                    cfg.device_from, [field])
    queries = [sink(aggregate(data, field, window, None, cfg.watermark), cfg,
                    ANALYTICS_TOPIC, "aggregates-tumbling", "update")]
    if slide:
        queries.append(sink(aggregate(data, field, window, slide, cfg.watermark), cfg,
                            ANALYTICS_TOPIC, "aggregates-sliding", "update"))
    return queries
