"""Device-offline detection: no message from a device for T seconds.

State per device: when it was last seen (processing time) and whether it is offline.
A processing-time timeout of T seconds fires in a micro-batch even when no data comes
(Spark runs no-data batches for timeouts), sending {"rule": "offline", ...}; the next
message from that device sends {"rule": "online", ...}. Both go to the first-level topic
`alerts`, MQTT topic `alerts/{device}` (value = seconds since last seen, threshold = T).

"Seen" and "now" are the micro-batch's processing time, the clock Spark times out on:
a timeout fires in the first batch at least T after the batch that saw the device, so
`value` is never below T (the wall clock inside a long batch would say less).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import StreamingQuery

from spark_streaming.jobs.alerts import ALERT_SCHEMA, ALERTS_TOPIC, _alert_rows
from spark_streaming.jobs.common import JobConfig, reading_columns, readings, sink, source

STATE_SCHEMA = "last_seen long, last_ts long, topic string, msg_id string, offline boolean"


def offline_events(data: DataFrame, after_s: float) -> DataFrame:
    from pyspark.sql.streaming.state import GroupStateTimeout

    timeout_ms = int(after_s * 1000)
    columns = [c.split()[0] for c in ALERT_SCHEMA.split(", ")]

    def track(key: tuple, pdfs: Iterator[Any], state: Any) -> Iterator[Any]:
        import pandas as pd

        (device,) = key
        now = state.getCurrentProcessingTimeMs()
        out = []
        if state.hasTimedOut:
            last_seen, last_ts, topic, msg_id, _ = state.get
            out.append(("offline", device, (now - last_seen) / 1000, after_s, ">", "",
                        now, topic, msg_id))
            state.update((last_seen, last_ts, topic, msg_id, True))
            # No timeout while offline: the next message brings it back.
        else:
            frames = [f for f in pdfs if len(f)]
            if not frames:
                return
            latest = pd.concat(frames).sort_values(["ts", "msg_id"]).iloc[-1]
            was_offline = state.exists and bool(state.get[4])
            if was_offline:
                out.append(("online", device, (now - state.get[0]) / 1000, after_s, "<", "",
                            int(latest["ts"]), latest["mqtt_topic"], latest["msg_id"]))
            state.update((now, int(latest["ts"]), latest["mqtt_topic"], latest["msg_id"],
                          False))
            state.setTimeoutDuration(timeout_ms)
        if out:
            yield pd.DataFrame(out, columns=columns)

    return (data.select("device", "mqtt_topic", "ts", "msg_id").groupBy("device")
            .applyInPandasWithState(track, ALERT_SCHEMA, STATE_SCHEMA, "append",
                                    GroupStateTimeout.ProcessingTimeTimeout))


def start(spark: SparkSession, cfg: JobConfig, after_s: float = 30.0) -> list[StreamingQuery]:
    data = readings(source(spark, cfg, reading_columns(cfg.device_from, [])), cfg.device_from, [])
    return [sink(_alert_rows(offline_events(data, after_s)), cfg, ALERTS_TOPIC,
                 "offline", "append")]
