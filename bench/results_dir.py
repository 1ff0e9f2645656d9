"""Where the benchmarks write their JSON: bench/results/ (ignored by git), or the
directory LIGHTGATE_BENCH_RESULTS names (the harness tests, which must not overwrite
the figures of a real run)."""

from __future__ import annotations

import os
from pathlib import Path

RESULTS = Path(os.environ.get("LIGHTGATE_BENCH_RESULTS",
                              Path(__file__).resolve().parent / "results"))
