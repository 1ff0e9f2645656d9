"""The benchmark harness itself keeps working: a tiny run against Lightgate only, plus the
frame splitter its receive path counts with."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from bench.mqtt.brokers import Broker
from bench.mqtt.runner import Meter
from bench.mqtt.wire import publish_fields, split_frames
from gateway import mqtt

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {"scenario", "broker", "msgs_per_s", "p50_ms", "p99_ms", "kb_per_conn",
          "connects_per_s", "ratio_vs_mosquitto"}


def test_split_frames_counts_publishes_across_chunk_boundaries() -> None:
    stream = b"".join([mqtt.encode_publish("a/b", b"p" * 200, 1, False, False, 7, 4),
                       mqtt.encode(mqtt.Puback(3), 4),
                       mqtt.encode_publish("a", b"q" * 20, 0, False, False, None, 4)] * 50)
    publishes, bodies, rest = 0, [], b""
    for i in range(0, len(stream), 33):  # arbitrary cuts, even inside a length varint
        buf = rest + stream[i:i + 33]
        n, frames, used = split_frames(buf, True)
        publishes += n
        bodies += frames
        rest = buf[used:]
    assert rest == b"" and publishes == 100 and len(bodies) == 150
    pid, payload = publish_fields(*bodies[0])
    assert pid == b"\x00\x07" and payload == b"p" * 200
    assert publish_fields(*bodies[2]) == (b"", b"q" * 20)


def test_meter_counts_only_the_window_a_scenario_opens() -> None:
    """A scenario that opens its own window (device_fleet, after thousands of CONNECTs)
    is charged only the broker's CPU inside it, even though the runner ends the meter
    again after the scenario returns."""
    # A stand-in broker: 0.6 s of its own CPU (however busy the machine), then idle.
    burn = ("import sys, time\nwhile time.process_time() < 0.6: pass\n"
            "print('idle', flush=True)\ntime.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE)
    stand_in = Broker("stand-in", procs=[proc])
    try:
        meter = Meter(stand_in, None)
        meter.begin()  # as the runner does before the scenario
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"idle\n"  # the set-up: it burned its CPU
        time.sleep(0.05)  # /proc's counters catch up with its last tick
        assert meter.before is not None
        setup_cpu = meter.before
        meter.begin()  # the scenario's window opens
        time.sleep(0.3)
        meter.end()  # ... and closes
        meter.end()  # the runner's, after the scenario: keeps the scenario's window
        assert meter.before is not None and meter.after is not None
        assert meter.before.cpu - setup_cpu.cpu >= 0.4
        assert meter.after.cpu - meter.before.cpu < 0.1
        assert 0.25 <= meter.after.at - meter.before.at < 1.0
    finally:
        proc.kill()
        proc.wait()
        stand_in.tmp.rmdir()


def test_tiny_run_prints_rows_in_the_documented_shape(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "bench/mqtt_bench.py", "--tiny", "--brokers", "lightgate-async",
         "--scenarios", "qos0_1to1,qos1_1to1,latency_fixed_rate,idle_conns,cpu_at_rate_qos1,"
         "device_fleet",
         "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(res.stdout)  # stdout is exactly one JSON list
    assert [r["scenario"] for r in rows] == ["qos0_1to1", "qos1_1to1", "latency_fixed_rate",
                                             "idle_conns", "cpu_at_rate_qos1", "device_fleet"]
    for r in rows:
        assert set(r) >= FIELDS, r
        assert "error" not in r, r
        assert r["broker"] == "lightgate-async"
        assert r["ratio_vs_mosquitto"] is None  # no Mosquitto row to compare with
        assert isinstance(r["higher_is_better"], bool)
    by = {r["scenario"]: r for r in rows}
    assert by["qos0_1to1"]["msgs_per_s"] > 0 and by["qos1_1to1"]["msgs_per_s"] > 0
    assert by["qos0_1to1"]["received"] == by["qos0_1to1"]["expected"]
    assert 0 < by["latency_fixed_rate"]["p50_ms"] <= by["latency_fixed_rate"]["p99_ms"]
    assert by["idle_conns"]["kb_per_conn"] is not None
    assert by["idle_conns"]["connects_per_s"] > 0
    at_rate = by["cpu_at_rate_qos1"]
    assert at_rate["received"] == at_rate["expected"] and at_rate["acked"] == at_rate["sent"]
    assert at_rate["cpu_us_per_msg"] > 0
    # Per thread (by name): CPU and context switches; the event loop's thread is busiest.
    busiest = max(at_rate["threads"].values(), key=lambda t: t["cpu_us_per_msg"] or 0)
    assert busiest["cpu_us_per_msg"] > 0
    assert busiest["voluntary_switches_per_s"] > 0
    assert "involuntary_switches_per_s" in busiest
    # The fleet: every device's every message sent, acknowledged and delivered once; the
    # figures cover the rounds after the first (tiny: 300 devices, one message a second,
    # one untimed round, then 2 s).
    fleet = by["device_fleet"]
    assert fleet["main_figure"] == "cpu_us_per_msg" and fleet["higher_is_better"] is False
    assert fleet["expected"] == 300 * 3 and fleet["window_msgs"] == 300 * 2
    assert fleet["received"] == fleet["sent"] == fleet["acked"] == fleet["expected"]
    assert fleet["cpu_us_per_msg"] > 0 and fleet["msgs_per_s"] == 300
    assert fleet["first_round_cpu_us_per_msg"] >= 0
    assert 0 < fleet["p50_ms"] <= fleet["p99_ms"] <= fleet["max_ms"]
    assert fleet["notes"].startswith("300 QoS 1 devices x 3 messages"), fleet["notes"]
    assert json.loads((tmp_path / "latest.json").read_text()) == rows
    assert (tmp_path / "qos0_1to1.png").stat().st_size > 1000
