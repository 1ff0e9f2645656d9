"""Spark analytics benchmark: events/s through the aggregates job, and publish -> alert
latency through the alerts job, both on local[2] against a real `lightgate serve`.

    .venv/bin/python bench/spark_bench.py [--events 200000] [--runs 2] [--seconds 20]

Prints one JSON object and writes it to bench/results/spark_latest.json.

What is measured, and what is kept apart:
- session_start_s: JVM start and SparkSession creation (paid once per job, not per event).
- aggregates: the real job (`aggregates.start`, foreachBatch sink to the store) over a
  topic preloaded with --events readings, --runs times on one session, each run with a
  fresh checkpoint from the earliest offsets. Run 1 is cold (JIT, Python worker start,
  first imports), later runs are warm. events_per_s of a run = rows / (end of the last
  micro-batch with data - start of the first), from Spark's progress reports (trigger
  start timestamps and triggerExecution), so query start-up outside the batches is not
  counted; the durationMs breakdown (addBatch, queryPlanning, walCommit, commitOffsets,
  latestOffset) of those batches is summed beside it. `events_per_s` (the headline) is
  the best warm run; `events_per_s_cold` is run 1.
- store_cpu_us_per_event: CPU time of the `lightgate serve` process per event during a
  run (it serves the PULLs): the store's share, which bounds the job's rate on a small
  machine; spark_cpu_us_per_event is the JVM and its Python workers (Linux /proc).
- source_read_events_per_s: the data source alone (batch read of the whole topic into
  Spark's `noop` sink), warm.
- alert latency: a device publishes hot readings over MQTT (QoS 1) at --rate per second;
  latency = the MQTT subscriber's receive time minus the reading's `ts` (publish time):
  gateway + store + Spark trigger (--trigger) + rules + sink + MQTT delivery. Readings of
  the first --warmup seconds (first batches of a new query: Python workers and code paths
  starting) are published but not counted. The alerts query's own batch durations are
  reported beside it (its latestOffset includes the wait for a reading, see the source's
  waitMs), and alert_stages_ms splits each alert's time at the store's records: publish
  -> reading stored (MQTT, gateway) -> alert stored (Spark) -> subscriber (delivery).
- load_avg: the 1-minute load average before and after each phase (the machine may be
  shared: compare figures taken under similar load).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightgate import Producer  # noqa: E402


def progress(text: str) -> None:
    print(f"spark_bench: {text}", file=sys.stderr, flush=True)


def load_avg() -> float:
    return round(os.getloadavg()[0], 2)


# -- CPU accounting (Linux /proc; None elsewhere) -----------------------------------------
def _proc_cpu(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def tree_cpu(pid: int) -> float | None:
    """CPU seconds of `pid` and its live descendants (exited ones are not counted)."""
    own = _proc_cpu(pid)
    if own is None:
        return None
    return own + sum(tree_cpu(c) or 0.0 for c in _children(pid))


def spark_pid(other: int) -> int | None:
    """The JVM this process started (SparkSession's gateway; the Python workers are its
    descendants): our child that is not `other` (the store)."""
    kids = [k for k in _children(os.getpid()) if k != other] if Path("/proc").is_dir() else []
    return kids[0] if len(kids) == 1 else None


def _us_per_event(cpu0: float | None, cpu1: float | None, events: int) -> float | None:
    if cpu0 is None or cpu1 is None or not events:
        return None
    return round((cpu1 - cpu0) / events * 1e6, 1)


# -- the store ----------------------------------------------------------------------------
def start_serve(data: Path) -> tuple[subprocess.Popen, dict[str, str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "lightgate", "--log-level", "WARNING", "serve", "--data-dir",
         str(data), "--ws", "off", "--mqtt", "127.0.0.1:0", "--native", "127.0.0.1:0", "--http",
         "127.0.0.1:0"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("ready "):
        proc.kill()
        raise RuntimeError(f"lightgate serve did not start: {line!r}")
    return proc, dict(part.split("=", 1) for part in line.split()[1:])


def preload(addr: str, events: int, devices: int) -> float:
    """Readings for `devices` devices, sent in batches; returns events/s of the load."""
    start = time.monotonic()
    now = int(time.time() * 1000)
    with Producer(addr) as p:
        batch = 500
        for base in range(0, events, batch):
            n = min(batch, events - base)
            dev = f"dev-{(base // batch) % devices}"
            bodies = [json.dumps({"temperature": 20 + (base + i) % 10, "ts": now + base + i})
                      .encode() for i in range(n)]
            p.send_batch("devices", bodies, mqtt_topic=f"devices/{dev}/temp", qos=1)
    return events / (time.monotonic() - start)


# -- throughput -----------------------------------------------------------------------------
def _started(report: dict[str, Any]) -> float:
    return dt.datetime.fromisoformat(report["timestamp"].replace("Z", "+00:00")).timestamp()


def batch_span(reports: list[dict[str, Any]]) -> float:
    """Seconds from the start of the first of these micro-batches to the end of the last."""
    first = min(_started(p) for p in reports)
    last = max(_started(p) + p["durationMs"]["triggerExecution"] / 1000 for p in reports)
    return last - first


def bench_aggregates(spark: Any, addr: str, checkpoint: str, serve_pid: int) -> dict:
    from spark_streaming.jobs import aggregates
    from spark_streaming.jobs.common import JobConfig

    cfg = JobConfig(server=addr, checkpoint=checkpoint, starting_offsets="earliest",
                    trigger="0 seconds", watermark="1 hour")
    jvm = spark_pid(serve_pid)
    store0, spark0, load0 = _proc_cpu(serve_pid), tree_cpu(jvm) if jvm else None, load_avg()
    start = time.monotonic()
    [q] = aggregates.start(spark, cfg, window="10 seconds")
    q.processAllAvailable()
    wall = time.monotonic() - start
    store1, spark1 = _proc_cpu(serve_pid), tree_cpu(jvm) if jvm else None
    reports = [p for p in q.recentProgress if p["numInputRows"]]
    q.stop()
    rows = sum(p["numInputRows"] for p in reports)
    span = batch_span(reports) if reports else 0.0
    parts = ("addBatch", "queryPlanning", "walCommit", "commitOffsets", "latestOffset",
             "getBatch")
    return {"events": rows, "events_per_s": round(rows / span, 1) if span else None,
            "batches": len(reports), "batch_span_s": round(span, 2),
            "wall_s_incl_query_start": round(wall, 2),
            "duration_ms": {k: sum(p["durationMs"].get(k, 0) for p in reports)
                            for k in parts},
            "store_cpu_us_per_event": _us_per_event(store0, store1, rows),
            "spark_cpu_us_per_event": _us_per_event(spark0, spark1, rows),
            "load_avg": [load0, load_avg()]}


def bench_source_read(spark: Any, addr: str) -> dict:
    """The data source alone: the whole topic into the `noop` sink (second read timed)."""
    def read() -> float:
        start = time.monotonic()
        (spark.read.format("lightgate").option("server", addr).option("topic", "devices")
         .load().write.format("noop").mode("overwrite").save())
        return time.monotonic() - start

    read()
    seconds = read()
    rows = spark.read.format("lightgate").option("server", addr).option("topic", "devices") \
        .load().count()
    return {"source_read_events_per_s": round(rows / seconds, 1),
            "source_read_s": round(seconds, 2)}


# -- latency ----------------------------------------------------------------------------
HOT_TOPIC = "devices/hot-1/temp"  # where the latency run's device publishes


def _pct(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return round(sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q))], 1)


def bench_alerts(spark: Any, addr: str, mqtt: str, seconds: float, rate: float,
                 trigger: str, checkpoint: str, warmup: float = 3.0) -> dict:
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion

    from spark_streaming.jobs import alerts
    from spark_streaming.jobs.common import JobConfig
    from spark_streaming.jobs.rules import parse_rules

    host, _, port = mqtt.rpartition(":")
    received: queue.Queue = queue.Queue()

    def on_message(client: object, userdata: object, msg: paho.MQTTMessage) -> None:
        received.put((time.time() * 1000, msg.payload))

    sub = paho.Client(CallbackAPIVersion.VERSION2, client_id="bench-alerts")
    sub.on_message = on_message
    sub.connect(host, int(port))
    sub.loop_start()
    sub.subscribe("alerts/#", 1)
    rules = parse_rules({"rule": [{"name": "overheat", "field": "temperature", "op": ">",
                                   "threshold": 80}]})
    cfg = JobConfig(server=addr, checkpoint=checkpoint, starting_offsets="latest",
                    trigger=trigger)
    queries = alerts.start(spark, cfg, rules)
    dev = paho.Client(CallbackAPIVersion.VERSION2, client_id="bench-device")
    dev.connect(host, int(port))
    dev.loop_start()
    load0 = load_avg()
    sent = counted = 0
    start = time.monotonic()
    measure_from_ms = (time.time() + warmup) * 1000
    while time.monotonic() - start < warmup + seconds:
        now_ms = time.time() * 1000
        body = json.dumps({"temperature": 90.0, "ts": int(now_ms)})
        dev.publish(HOT_TOPIC, body, 1)
        sent += 1
        counted += now_ms >= measure_from_ms
        time.sleep(max(0.0, start + sent / rate - time.monotonic()))
    latencies = []
    arrived: dict[int, float] = {}  # reading ts -> when its alert reached the subscriber
    got = 0
    deadline = time.monotonic() + 30
    while got < sent and time.monotonic() < deadline:
        try:
            at, payload = received.get(timeout=1)
        except queue.Empty:
            continue
        got += 1
        ts = json.loads(payload)["ts"]
        if ts >= int(measure_from_ms):
            latencies.append(at - ts)
            arrived[ts] = at
    load1 = load_avg()
    batches = [p for q in queries for p in q.recentProgress if p["numInputRows"]]
    for q in queries:
        q.stop()
    dev.loop_stop()
    sub.loop_stop()
    first = [round(x, 1) for x in latencies[:5]]  # in arrival order: the query warming up?
    in_order = [round(x) for x in latencies]  # arrival order: where the slow ones are
    latencies.sort()
    trig = sorted(p["durationMs"]["triggerExecution"] for p in batches)
    parts = ("addBatch", "walCommit", "commitOffsets", "queryPlanning", "latestOffset")
    return {"alerts_sent": counted, "alerts_received": len(latencies),
            "alert_p50_ms": _pct(latencies, 0.5), "alert_p95_ms": _pct(latencies, 0.95),
            "alert_p99_ms": _pct(latencies, 0.99),
            "alert_max_ms": round(latencies[-1], 1) if latencies else None,
            "alert_first_ms": first,
            "alert_ms_in_order": in_order,
            "alert_warmup_s": warmup,
            "alert_batch_ms_p50": _pct(trig, 0.5), "alert_batch_ms_p95": _pct(trig, 0.95),
            "alert_batch_ms_p50_parts": {
                k: statistics.median(p["durationMs"].get(k, 0) for p in batches)
                for k in parts} if batches else None,
            "alert_stages_ms": alert_stages(addr, arrived),
            "trigger": trigger, "publish_rate_per_s": rate, "alert_load_avg": [load0, load1]}


def _store_times(addr: str, topic: str, mqtt_topic: str | None = None) -> dict[int, float]:
    """The store time (ms) of each message of `topic` (sent to `mqtt_topic`, when given),
    by its JSON body's `ts`."""
    from spark_streaming.native import StoreClient

    out = {}
    with StoreClient(addr) as c:
        for q in c.describe(topic):
            for _, m in c.read_range(q["queue"], int(q["min_offset"]), int(q["max_offset"])):
                if mqtt_topic is None or m.topic == mqtt_topic:
                    out[json.loads(m.body)["ts"]] = float(m.store_ts)
    return out


def alert_stages(addr: str, arrived: dict[int, float]) -> dict[str, Any]:
    """Where an alert's time goes, p50 and p95 of each stage (ms): the reading's publish
    to its record in the store's log (MQTT and the gateway), that record to the alert's
    record (Spark: the wait for a trigger and the micro-batch up to its sink's write),
    the alert's record to the MQTT subscriber (the store's notify and the gateway)."""
    readings = _store_times(addr, "devices", HOT_TOPIC)  # not the preloaded ones
    alerts = _store_times(addr, "alerts")
    stages: dict[str, list[float]] = {"publish_to_stored": [], "stored_to_alert_stored": [],
                                      "alert_stored_to_subscriber": []}
    for ts, at in arrived.items():
        if ts in readings and ts in alerts:
            stages["publish_to_stored"].append(readings[ts] - ts)
            stages["stored_to_alert_stored"].append(alerts[ts] - readings[ts])
            stages["alert_stored_to_subscriber"].append(at - alerts[ts])
    return {k: {"p50": _pct(sorted(v), 0.5), "p95": _pct(sorted(v), 0.95)}
            for k, v in stages.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--devices", type=int, default=100)
    ap.add_argument("--runs", type=int, default=2, help="aggregates runs (1 cold, then warm)")
    ap.add_argument("--seconds", type=float, default=20.0, help="latency run length")
    ap.add_argument("--warmup", type=float, default=3.0, help="latency warm-up, not counted")
    ap.add_argument("--rate", type=float, default=5.0, help="hot readings per second")
    ap.add_argument("--trigger", default="0 seconds",
                    help="alerts job trigger interval (the job's own default)")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--skip", choices=("aggregates", "alerts"), action="append", default=[],
                    help="leave a part out")
    args = ap.parse_args()

    from spark_streaming.session import get_spark

    tmp = Path(tempfile.mkdtemp(prefix="spark-bench-"))
    proc, addrs = start_serve(tmp / "data")
    result: dict[str, Any] = {"scenario": "spark_analytics", "master": args.master,
                              "cpus": os.cpu_count(), "load_avg_start": load_avg()}
    try:
        if "aggregates" not in args.skip:
            progress(f"preloading {args.events} readings")
            result["preload_events_per_s"] = round(
                preload(addrs["native"], args.events, args.devices), 1)
        progress("starting Spark")
        start = time.monotonic()
        spark = get_spark(args.master, "lightgate-bench")
        result["session_start_s"] = round(time.monotonic() - start, 1)
        if "aggregates" not in args.skip:
            runs = []
            for i in range(args.runs):
                progress(f"aggregates job, run {i + 1}/{args.runs}")
                runs.append(bench_aggregates(spark, addrs["native"], str(tmp / f"ck-agg{i}"),
                                             proc.pid))
            warm = [r["events_per_s"] for r in runs[1:] if r["events_per_s"]]
            result.update({"events": runs[0]["events"],
                           "events_per_s": max(warm) if warm else runs[0]["events_per_s"],
                           "events_per_s_cold": runs[0]["events_per_s"],
                           "store_cpu_us_per_event": runs[-1]["store_cpu_us_per_event"],
                           "aggregates_runs": runs})
            progress("data source read alone")
            result.update(bench_source_read(spark, addrs["native"]))
        if "alerts" not in args.skip:
            progress("alerts job latency")
            result.update(bench_alerts(spark, addrs["native"], addrs["mqtt"], args.seconds,
                                       args.rate, args.trigger, str(tmp / "ck-alerts"),
                                       args.warmup))
        spark.stop()
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
    result["load_avg_end"] = load_avg()
    out = ROOT / "bench" / "results" / "spark_latest.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
