"""The benchmark harness itself keeps working (a tiny run against Lightgate only)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {"scenario", "broker", "msgs_per_s", "p50_ms", "p99_ms", "kb_per_conn",
          "connects_per_s", "ratio_vs_mosquitto"}


def test_tiny_run_prints_rows_in_the_documented_shape(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "bench/mqtt_bench.py", "--tiny", "--brokers", "lightgate-async",
         "--scenarios", "qos0_1to1,qos1_1to1,latency_fixed_rate,idle_conns",
         "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(res.stdout.strip().splitlines()[-1])
    assert {r["scenario"] for r in rows} == {"qos0_1to1", "qos1_1to1", "latency_fixed_rate",
                                             "idle_conns"}
    for r in rows:
        assert set(r) >= FIELDS, r
        assert "error" not in r, r
    by = {r["scenario"]: r for r in rows}
    assert by["qos0_1to1"]["msgs_per_s"] > 0 and by["qos1_1to1"]["msgs_per_s"] > 0
    assert by["latency_fixed_rate"]["p99_ms"] > 0
    assert by["idle_conns"]["kb_per_conn"] is not None
    assert json.loads((tmp_path / "latest.json").read_text()) == rows
    assert (tmp_path / "qos0_1to1.png").stat().st_size > 1000
