"""Run one of the atheris fuzzers here for a bounded number of inputs, as a subprocess
(libFuzzer owns the process and exits it)."""

from __future__ import annotations

import subprocess
import sys
from collections import deque
from pathlib import Path


def run_fuzzer(script: Path, runs: int, tmp_path: Path, *args: str,
               seeds: list[bytes] | None = None) -> list[str]:
    """Fuzz `runs` inputs; a crash's input is left in `tmp_path`. The final stat lines.
    `seeds`: inputs that found bugs before, run first and mutated from (the corpus).

    libFuzzer's pulse lines (at each power of two of inputs run) are passed on to stderr
    as progress: a million inputs take most of an hour for the connection fuzzer."""
    corpus = []
    if seeds:
        (tmp_path / "corpus").mkdir(exist_ok=True)
        for i, seed in enumerate(seeds):
            (tmp_path / "corpus" / f"seed-{i}").write_bytes(seed)
        corpus = [str(tmp_path / "corpus")]
    with subprocess.Popen(
        [sys.executable, str(script), f"-runs={runs}", f"-artifact_prefix={tmp_path}/",
         "-print_final_stats=1", *args, *corpus],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    ) as proc:
        assert proc.stderr is not None
        tail: deque[str] = deque(maxlen=200)
        done = False
        for line in proc.stderr:
            tail.append(line)
            done = done or line.startswith(f"Done {runs} runs")
            if "\tpulse " in line or "\tDONE " in line:
                print(f"[{script.stem}] {line.rstrip()}", file=sys.stderr, flush=True)
        code = proc.wait(60)
    assert code == 0, "".join(tail)
    assert done, "".join(tail)
    stats = [ln.rstrip() for ln in tail if ln.startswith("stat::")]
    print("\n".join(stats))
    return stats
