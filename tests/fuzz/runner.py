"""Run one of the atheris fuzzers here for a bounded number of inputs, as a subprocess
(libFuzzer owns the process and exits it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def run_fuzzer(script: Path, runs: int, tmp_path: Path, *args: str) -> list[str]:
    """Fuzz `runs` inputs; a crash's input is left in `tmp_path`. The final stat lines."""
    res = subprocess.run(
        [sys.executable, str(script), f"-runs={runs}", f"-artifact_prefix={tmp_path}/",
         "-print_final_stats=1", *args],
        capture_output=True, text=True, timeout=7200,
    )
    tail = res.stderr[-6000:]
    assert res.returncode == 0, tail
    assert f"Done {runs} runs" in res.stderr, tail
    stats = [ln for ln in res.stderr.splitlines() if ln.startswith("stat::")]
    print("\n".join(stats))
    return stats
