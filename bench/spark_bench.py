"""Spark analytics benchmark: events/s through the aggregates job, and publish -> alert
latency through the alerts job, both on local[2] against a real `lightgate serve`.

    .venv/bin/python bench/spark_bench.py [--events 50000] [--seconds 20]

Prints one JSON object and writes it to bench/results/spark_latest.json.
- events_per_s: rows the aggregates job consumed per second of trigger execution (from
  Spark's progress reports), over a topic preloaded with --events readings;
- alert_p50_ms / alert_p95_ms: a device publishes hot readings over MQTT (QoS 1) at
  --rate per second; latency is the MQTT subscriber's receive time minus the reading's
  `ts` (publish time): gateway + store + Spark trigger (--trigger) + sink + delivery.
"""

from __future__ import annotations

import argparse
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightgate import Producer  # noqa: E402


def progress(text: str) -> None:
    print(f"spark_bench: {text}", file=sys.stderr, flush=True)


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


def bench_aggregates(spark: object, addr: str, events: int, checkpoint: str) -> dict:
    from spark_streaming.jobs import aggregates
    from spark_streaming.jobs.common import JobConfig

    cfg = JobConfig(server=addr, checkpoint=checkpoint, starting_offsets="earliest",
                    trigger="0 seconds", watermark="1 hour")
    start = time.monotonic()
    [q] = aggregates.start(spark, cfg, window="10 seconds")  # type: ignore[arg-type]
    q.processAllAvailable()
    wall = time.monotonic() - start
    reports = [p for p in q.recentProgress if p["numInputRows"]]
    q.stop()
    rows = sum(p["numInputRows"] for p in reports)
    busy_ms = sum(p["durationMs"]["triggerExecution"] for p in reports)
    return {"events": rows, "events_per_s": round(rows / (busy_ms / 1000), 1) if busy_ms else None,
            "batches": len(reports), "wall_s_incl_query_start": round(wall, 1)}


def bench_alerts(spark: object, addr: str, mqtt: str, seconds: float, rate: float,
                 trigger: str, checkpoint: str) -> dict:
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
    queries = alerts.start(spark, cfg, rules)  # type: ignore[arg-type]
    dev = paho.Client(CallbackAPIVersion.VERSION2, client_id="bench-device")
    dev.connect(host, int(port))
    dev.loop_start()
    time.sleep(2)  # past the first (empty) triggers
    sent = 0
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        body = json.dumps({"temperature": 90.0, "ts": int(time.time() * 1000)})
        dev.publish("devices/hot-1/temp", body, 1)
        sent += 1
        time.sleep(max(0.0, start + sent / rate - time.monotonic()))
    latencies = []
    deadline = time.monotonic() + 30
    while len(latencies) < sent and time.monotonic() < deadline:
        try:
            at, payload = received.get(timeout=1)
        except queue.Empty:
            continue
        latencies.append(at - json.loads(payload)["ts"])
    for q in queries:
        q.stop()
    dev.loop_stop()
    sub.loop_stop()
    latencies.sort()
    q95 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.95))] if latencies else None
    return {"alerts_sent": sent, "alerts_received": len(latencies),
            "alert_p50_ms": round(statistics.median(latencies), 1) if latencies else None,
            "alert_p95_ms": round(q95, 1) if q95 is not None else None,
            "trigger": trigger, "publish_rate_per_s": rate}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=50_000)
    ap.add_argument("--devices", type=int, default=100)
    ap.add_argument("--seconds", type=float, default=20.0, help="latency run length")
    ap.add_argument("--rate", type=float, default=5.0, help="hot readings per second")
    ap.add_argument("--trigger", default="0.2 seconds", help="alerts job trigger interval")
    ap.add_argument("--master", default="local[2]")
    args = ap.parse_args()

    from spark_streaming.session import get_spark

    tmp = Path(tempfile.mkdtemp(prefix="spark-bench-"))
    proc, addrs = start_serve(tmp / "data")
    try:
        progress(f"preloading {args.events} readings")
        load_rate = preload(addrs["native"], args.events, args.devices)
        progress("starting Spark")
        spark = get_spark(args.master, "lightgate-bench")
        progress("aggregates job")
        agg = bench_aggregates(spark, addrs["native"], args.events, str(tmp / "ck-agg"))
        progress("alerts job latency")
        lat = bench_alerts(spark, addrs["native"], addrs["mqtt"], args.seconds, args.rate,
                           args.trigger, str(tmp / "ck-alerts"))
        spark.stop()
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
    result = {"scenario": "spark_analytics", "master": args.master, "cpus": os.cpu_count(),
              "preload_events_per_s": round(load_rate, 1), **agg, **lat}
    out = ROOT / "bench" / "results" / "spark_latest.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
