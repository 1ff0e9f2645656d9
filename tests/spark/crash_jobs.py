"""The alerts and aggregates jobs in one Spark driver, for the crash test to kill:

    python -m tests.spark.crash_jobs SERVER CHECKPOINT

Prints `running` on stderr once both queries ran their first trigger, then runs until
killed. Each query checkpoints under CHECKPOINT/<query name>, as `lightgate analytics
run` lays them out, so a restarted driver goes on from there."""

from __future__ import annotations

import sys
import time

from spark_streaming.jobs import aggregates, alerts
from spark_streaming.jobs.common import JobConfig
from spark_streaming.jobs.rules import parse_rules
from spark_streaming.session import get_spark

RULES = parse_rules({"rule": [{"name": "overheat", "field": "temperature", "op": ">",
                               "threshold": 80}]})
TRIGGER = "0.3 seconds"


def main(server: str, checkpoint: str) -> None:
    spark = get_spark("local[2]", "lightgate-crash-test",
                      {"spark.python.authenticate.socketTimeout": "60s"})
    cfg = JobConfig(server=server, checkpoint=checkpoint, starting_offsets="earliest",
                    trigger=TRIGGER, watermark="1 hour")
    queries = alerts.start(spark, cfg, RULES)
    queries += aggregates.start(spark, cfg, window="10 seconds")
    print("running: " + ", ".join(q.name for q in queries), file=sys.stderr, flush=True)
    while all(q.isActive for q in queries):
        time.sleep(0.2)
    for q in queries:
        if q.exception() is not None:
            print(f"query {q.name} failed: {q.exception()}", file=sys.stderr, flush=True)
    sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
