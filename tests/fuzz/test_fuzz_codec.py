"""Runs the coverage-guided codec fuzzer for a bounded number of inputs.

`make test` runs a short burst; `make soak` runs it for 1,000,000 inputs
(LIGHTGATE_FUZZ_RUNS). A crash leaves its reproducer in the test's tmp dir."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris", reason="atheris is not installed (test extra)")

FUZZER = Path(__file__).with_name("fuzz_codec.py")
RUNS = int(os.environ.get("LIGHTGATE_FUZZ_RUNS", "200000"))


def test_codec_survives_coverage_guided_fuzzing(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, str(FUZZER), f"-runs={RUNS}", "-max_len=2048",
         f"-artifact_prefix={tmp_path}/", "-print_final_stats=1"],
        capture_output=True, text=True, timeout=3600,
    )
    tail = res.stderr[-3000:]
    assert res.returncode == 0, tail
    assert f"Done {RUNS} runs" in res.stderr, tail
    stats = [ln for ln in res.stderr.splitlines() if ln.startswith("stat::")]
    print("\n".join(stats))
