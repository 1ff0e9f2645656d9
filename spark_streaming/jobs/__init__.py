"""Device analytics jobs: `aggregates`, `alerts`, `offline` (see docs/spark.md)."""

JOBS = ("aggregates", "alerts", "offline")
