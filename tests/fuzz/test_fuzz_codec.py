"""Runs the coverage-guided codec fuzzer for a bounded number of inputs.

`make test` runs a short burst; `make soak` runs it for 1,000,000 inputs
(LIGHTGATE_FUZZ_RUNS). A crash leaves its reproducer in the test's tmp dir."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.fuzz.runner import run_fuzzer

pytest.importorskip("atheris", reason="atheris is not installed (test extra)")

FUZZER = Path(__file__).with_name("fuzz_codec.py")
RUNS = int(os.environ.get("LIGHTGATE_FUZZ_RUNS", "200000"))


def test_codec_survives_coverage_guided_fuzzing(tmp_path: Path) -> None:
    run_fuzzer(FUZZER, RUNS, tmp_path, "-max_len=2048")
