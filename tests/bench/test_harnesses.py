"""The benchmarks besides the MQTT one keep working: a small run of each prints the JSON
its docs describe (results go to a temporary directory, not bench/results)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_bench(tmp_path: Path, *args: str, writes: bool = True, timeout: float = 180) -> Any:
    env = dict(os.environ, LIGHTGATE_BENCH_RESULTS=str(tmp_path / "results"))
    res = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-2000:]
    if writes:
        assert list((tmp_path / "results").iterdir()), "nothing written to the results"
    return json.loads(res.stdout)


def test_ha_bench_smoke_acknowledges_every_message(tmp_path: Path) -> None:
    """A single node, then a 3-node sync group (which needs its group secret). A smoke
    run keeps the last real figures (bench/results/ha.json) as they are."""
    rows = run_bench(tmp_path, "bench/ha_bench.py", "--smoke", writes=False)
    assert [r["store"] for r in rows] == ["single", "sync3"]
    for r in rows:
        assert r["errors"] == 0 and r["acked"] == r["messages"] > 0, r
        assert r["msgs_per_s"] > 0


def test_store_bench_quick(tmp_path: Path) -> None:
    out = run_bench(tmp_path, "bench/store_bench.py", "--quick", "--dir", str(tmp_path))
    for key in ("append_64b_async", "append_64b_sync"):
        assert out[key]["msgs_per_s"] > 0
    assert out["dispatch_entries_per_s"] > 0 and out["recovery_s_per_gb"] > 0


def test_native_bench_small(tmp_path: Path) -> None:
    out = run_bench(tmp_path, "bench/native_bench.py", "--messages", "2000", "--seconds", "20")
    assert out["produce_single_msgs_per_s"] > 0 and out["produce_batch_msgs_per_s"] > 0
    assert out["consumed"] >= out["messages"]


def test_replay_bench_quick(tmp_path: Path) -> None:
    out = run_bench(tmp_path, "bench/replay_bench.py", "--quick")
    assert out["messages"] == 100_000 and out["reader_msgs_per_s"] > 0
    assert 0 < out["seek_ms"]["median"] <= out["seek_ms"]["max"]
