"""Runs the coverage-guided native-protocol fuzzer for a bounded number of inputs, from
the inputs that found past defects (see fuzz_native.SEED_INPUTS).

`make test` runs a short burst; `make soak` runs 1,000,000 inputs (LIGHTGATE_FUZZ_RUNS)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.fuzz.native_seeds import SEED_INPUTS
from tests.fuzz.runner import run_fuzzer

pytest.importorskip("atheris", reason="atheris is not installed (test extra)")

FUZZER = Path(__file__).with_name("fuzz_native.py")
RUNS = int(os.environ.get("LIGHTGATE_FUZZ_RUNS", "100000"))


def test_native_frames_survive_coverage_guided_fuzzing(tmp_path: Path) -> None:
    run_fuzzer(FUZZER, RUNS, tmp_path, "-max_len=2048", seeds=SEED_INPUTS)
