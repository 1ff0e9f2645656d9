"""Alerts: threshold and rate-of-change rules from a TOML file.

Each alert goes to the store's first-level topic `alerts` addressed to the MQTT topic
`alerts/{device}`, so MQTT subscribers of `alerts/#` and server apps consuming `alerts`
see the same message. Body: {"rule", "device", "value", "threshold", "op", "field",
"ts" (ms, the reading's time), "topic" (the MQTT topic it fired on), "msg_id"}.

Queries (each with its own checkpoint directory under --checkpoint):
- `alerts-threshold`: every reading checked against the rules without a window
  (stateless, so an alert leaves within one trigger of its reading);
- `alerts-window-{rule}`: a rule with `window` compares the per-device window average
  (update mode: it fires when the average crosses, and again when it changes while above);
- `alerts-rate`: `rate>`-style rules compare consecutive readings of a device (the last
  reading is kept in state per device).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession
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
from spark_streaming.jobs.rules import Rule, Rules

ALERTS_TOPIC = "alerts"
OPS: dict[str, Callable[[Any, Any], Any]] = {
    ">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le,
    "==": operator.eq, "!=": operator.ne,
}
ALERT_SCHEMA = ("rule string, device string, value double, threshold double, op string, "
                "field string, ts long, topic string, msg_id string")


def _alert_rows(df: DataFrame) -> DataFrame:
    """Alert columns -> the sink's mqtt_topic and JSON payload."""
    return df.select(
        F.concat(F.lit(f"{ALERTS_TOPIC}/"), F.col("device")).alias("mqtt_topic"),
        json_payload(rule=F.col("rule"), device=F.col("device"), value=F.col("value"),
                     threshold=F.col("threshold"), op=F.col("op"), field=F.col("field"),
                     ts=F.col("ts"), topic=F.col("topic"), msg_id=F.col("msg_id")))


def _alert(rule: Rule, value: Column, ts: Column, topic: Column, msg_id: Column) -> list[Column]:
    return [F.lit(rule.name).alias("rule"), F.col("device"), value.alias("value"),
            F.lit(rule.threshold).alias("threshold"), F.lit(rule.op).alias("op"),
            F.lit(rule.field).alias("field"), ts.alias("ts"), topic.alias("topic"),
            msg_id.alias("msg_id")]


def threshold_alerts(data: DataFrame, rules: list[Rule]) -> DataFrame:
    branches = []
    for rule in rules:
        cond = OPS[rule.op](F.col(rule.field), F.lit(rule.threshold))
        branches.append(data.where(F.col(rule.field).isNotNull() & cond).select(
            *_alert(rule, F.col(rule.field), F.col("ts"), F.col("mqtt_topic"),
                    F.col("msg_id"))))
    out = branches[0]
    for b in branches[1:]:
        out = out.unionByName(b)
    return out


def window_alerts(data: DataFrame, rule: Rule, watermark: str) -> DataFrame:
    agg = (data.where(F.col(rule.field).isNotNull())
           .withWatermark("event_time", watermark)
           .groupBy(F.window("event_time", rule.window), F.col("device"))
           .agg(F.avg(rule.field).alias("avg"), F.max("ts").alias("ts"),
                F.max_by("mqtt_topic", "ts").alias("topic"),
                F.max_by("msg_id", "ts").alias("msg_id")))
    cond = OPS[rule.compare](F.col("avg"), F.lit(rule.threshold))
    return agg.where(cond).select(*_alert(rule, F.col("avg"), F.col("ts"), F.col("topic"),
                                          F.col("msg_id")))


def rate_alerts(data: DataFrame, rules: list[Rule]) -> DataFrame:
    """Change per second between consecutive readings of each device (state: the last)."""
    from pyspark.sql.streaming.state import GroupStateTimeout

    fields = sorted({r.field for r in rules})
    spec = [(r.name, r.field, r.op, r.compare, r.threshold) for r in rules]
    state_schema = "last_ts long, " + ", ".join(f"`v_{f}` double" for f in fields)

    def fire(key: tuple, pdfs: Iterator[Any], state: Any) -> Iterator[Any]:
        import pandas as pd

        (device,) = key
        last = list(state.get) if state.exists else [None] * (1 + len(fields))
        out = []
        for pdf in pdfs:
            for row in pdf.sort_values(["ts", "msg_id"]).itertuples(index=False):
                row = row._asdict()
                if last[0] is not None and row["ts"] <= last[0]:
                    continue  # late or repeated reading: no rate against the newer one
                for name, field, op, compare, threshold in spec:
                    value, prev = row[field], last[1 + fields.index(field)]
                    if last[0] is None or value is None or prev is None or pd.isna(value):
                        continue
                    rate = (value - prev) / ((row["ts"] - last[0]) / 1000)
                    if OPS[compare](rate, threshold):
                        out.append((name, device, float(rate), float(threshold), op, field,
                                    int(row["ts"]), row["mqtt_topic"], row["msg_id"]))
                last = [int(row["ts"])] + [
                    None if pd.isna(row[f]) else float(row[f]) for f in fields]
        state.update(tuple(last))
        if out:
            yield pd.DataFrame(out, columns=[c.split()[0] for c in ALERT_SCHEMA.split(", ")])

    cols = ["device", "mqtt_topic", "ts", "msg_id", *fields]
    return (data.select(*cols).groupBy("device")
            .applyInPandasWithState(fire, ALERT_SCHEMA, state_schema, "append",
                                    GroupStateTimeout.NoTimeout))


def start(spark: SparkSession, cfg: JobConfig, rules: Rules) -> list[StreamingQuery]:
    cfg.source_topic, cfg.device_from = rules.source_topic, rules.device_from
    fields = [r.field for r in rules.rules]
    # Alerts leave as their reading lands: a trigger with nothing to do waits for it.
    data = readings(source(spark, cfg, reading_columns(rules.device_from, fields), wait=True),
                    rules.device_from, fields)
    queries = []
    plain = [r for r in rules.rules if not r.is_rate and not r.window]
    if plain:
        queries.append(sink(_alert_rows(threshold_alerts(data, plain)), cfg, ALERTS_TOPIC,
                            "alerts-threshold"))
    for rule in rules.rules:
        if rule.window:
            queries.append(sink(_alert_rows(window_alerts(data, rule, cfg.watermark)), cfg,
                                ALERTS_TOPIC, f"alerts-window-{rule.name}", "update"))
    rate = [r for r in rules.rules if r.is_rate]
    if rate:
        queries.append(sink(_alert_rows(rate_alerts(data, rate)), cfg, ALERTS_TOPIC,
                            "alerts-rate", "append"))
    return queries
