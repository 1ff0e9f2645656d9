"""Device analytics jobs: `aggregates`, `alerts`, `offline` (see spark_streaming/README.md)."""

JOBS = ("aggregates", "alerts", "offline")
