"""Runs the coverage-guided fuzzer of the connection state machine for a bounded number
of inputs (tests/fuzz/fuzz_connection.py: a real Connection, Broker and store per input).

`make test` runs a short burst; `make soak` runs it for 1,000,000 inputs
(LIGHTGATE_FUZZ_RUNS, shared with the codec fuzzer). A crash leaves its reproducer in the
test's tmp dir: `python tests/fuzz/fuzz_connection.py CRASH_FILE` replays it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris", reason="atheris is not installed (test extra)")

FUZZER = Path(__file__).with_name("fuzz_connection.py")
RUNS = int(os.environ.get("LIGHTGATE_FUZZ_RUNS", "20000"))


def test_connection_survives_coverage_guided_fuzzing(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, str(FUZZER), f"-runs={RUNS}", "-max_len=2048", "-seed=1",
         f"-artifact_prefix={tmp_path}/", "-print_final_stats=1", str(tmp_path / "corpus")],
        capture_output=True, text=True, timeout=7200,
    )
    tail = res.stderr[-6000:]
    assert res.returncode == 0, tail
    assert f"Done {RUNS} runs" in res.stderr, tail
    stats = [ln for ln in res.stderr.splitlines() if ln.startswith("stat::")]
    print("\n".join(stats))
    assert len(list((tmp_path / "corpus").iterdir())) > 20  # it went past the seeds
