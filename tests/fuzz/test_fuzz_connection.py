"""Runs the coverage-guided fuzzer of the connection state machine for a bounded number
of inputs (tests/fuzz/fuzz_connection.py: the sans-IO rules of gateway.mqtt.protocol,
driven directly, no socket or store).

`make test` runs a short burst; `make soak` runs it for 1,000,000 inputs
(LIGHTGATE_FUZZ_RUNS, shared with the codec fuzzer). A crash leaves its reproducer in the
test's tmp dir: `python tests/fuzz/fuzz_connection.py CRASH_FILE` replays it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.fuzz.runner import run_fuzzer

pytest.importorskip("atheris", reason="atheris is not installed (test extra)")

FUZZER = Path(__file__).with_name("fuzz_connection.py")
RUNS = int(os.environ.get("LIGHTGATE_FUZZ_RUNS", "200000"))


def test_connection_survives_coverage_guided_fuzzing(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    run_fuzzer(FUZZER, RUNS, tmp_path, "-max_len=2048", "-seed=1", str(corpus))
    assert len(list(corpus.iterdir())) > 20  # it went past the seeds
