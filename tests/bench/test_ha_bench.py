"""The store-group benchmark keeps working: a smoke run, one single node and one 3-node
sync group (which needs its group secret), every message acknowledged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_run_acknowledges_every_message() -> None:
    res = subprocess.run([sys.executable, "bench/ha_bench.py", "--smoke"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(res.stdout)
    assert [r["store"] for r in rows] == ["single", "sync3"]
    for r in rows:
        assert r["errors"] == 0 and r["acked"] == r["messages"] > 0, r
        assert r["msgs_per_s"] > 0
