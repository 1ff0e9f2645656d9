"""`lightgate analytics run JOB …` and `lightgate simulate …`.

pyspark is imported only inside the commands, so `lightgate --help` works without it.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from typing import Any

from serving.startup import CommandError
from serving.values import NATIVE_ADDR, split_credentials
from spark_streaming.jobs import JOBS
from spark_streaming.session import INSTALL_EXTRA

TRIGGER = "1 second"
# Alerts run back to back: a trigger with nothing to do waits in the store for the next
# reading (waitMs), so a reading starts its micro-batch as it lands. With a fixed
# interval, one that landed while a batch ran waited for the next tick as well: at
# 0.2 s, publish->alert p95 went 122-282 ms with the phase of the devices' clock
# against Spark's, against 137-182 ms back to back (bench/spark_bench.py).
ALERTS_TRIGGER = "0 seconds"


def add_commands(sub: Any) -> None:
    analytics = sub.add_parser("analytics", help="device analytics jobs on Spark")
    asub = analytics.add_subparsers(dest="analytics_command", required=True)
    run = asub.add_parser("run", help="run a job until stopped (Ctrl-C / SIGTERM)",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    run.add_argument("job", choices=JOBS)
    run.add_argument("--server", default=NATIVE_ADDR, help="the store's native HOST:PORT")
    run.add_argument("--master", default="local[2]", help="local[N], spark://HOST:PORT, …")
    run.add_argument("--checkpoint", help="checkpoint directory (default ./checkpoints/JOB)")
    run.add_argument("--rules", help="alerts: the rules file (TOML)")
    run.add_argument("--topic", default="devices",
                     help="first-level topic to read (alerts: source_topic of the rules)")
    run.add_argument("--device-from", default="topic:1",
                     help="device id: topic:N, client_id or json:FIELD (alerts: from rules)")
    run.add_argument("--field", default="temperature", help="aggregates: JSON numeric field")
    run.add_argument("--window", default="10 seconds", help="aggregates: window length")
    run.add_argument("--slide", help="aggregates: also sliding windows with this slide")
    run.add_argument("--watermark", default="30 seconds", help="how late a reading may be")
    run.add_argument("--offline-after", type=float, default=30.0,
                     help="offline: seconds without a message")
    run.add_argument("--trigger", default=argparse.SUPPRESS,
                     help=f"micro-batch interval (default: alerts {ALERTS_TRIGGER!r}, the "
                     f"others {TRIGGER!r})")
    run.add_argument("--starting-offsets", default="latest",
                     help="earliest, latest or JSON {\"topic#0\": n} (new checkpoint only)")
    run.add_argument("--max-offsets-per-trigger", type=int)
    run.add_argument("--duration", type=float, help="stop after this many seconds")
    run.add_argument("--as", dest="as_user", metavar="NAME:PASSWORD",
                     help="credentials when the store runs with --auth (or env LIGHTGATE_AUTH)")
    run.set_defaults(func=cmd_analytics_run)

    sim = sub.add_parser("simulate", help="simulated MQTT devices publishing temperatures",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sim.add_argument("--devices", type=int, default=10)
    sim.add_argument("--rate", type=float, default=1.0, help="messages per second per device")
    sim.add_argument("--mqtt", default="127.0.0.1:1883", help="MQTT HOST:PORT")
    sim.add_argument("--topic-prefix", default="devices")
    sim.add_argument("--seconds", type=float, default=10.0, help="how long to publish")
    sim.add_argument("--qos", type=int, default=1, choices=(0, 1, 2))
    sim.add_argument("--base", type=float, default=22.0, help="typical temperature")
    sim.add_argument("--hot", type=int, default=0,
                     help="the first N devices run hot (around --hot-temp)")
    sim.add_argument("--hot-temp", type=float, default=95.0)
    sim.add_argument("--seed", type=int)
    sim.add_argument("--as", dest="as_user", metavar="NAME:PASSWORD",
                     help="MQTT user name and password (or env LIGHTGATE_AUTH)")
    sim.set_defaults(func=cmd_simulate)


def cmd_simulate(args: argparse.Namespace) -> int:
    try:
        import paho.mqtt.client  # noqa: F401
    except ModuleNotFoundError:
        raise CommandError(f"needs paho-mqtt, which is not installed: {INSTALL_EXTRA}"
                           ) from None
    from spark_streaming.simulate import SimConfig, run

    username, password = _credentials(args)
    run(SimConfig(mqtt=args.mqtt, devices=args.devices, rate=args.rate, seconds=args.seconds,
                  topic_prefix=args.topic_prefix, qos=args.qos, base=args.base, hot=args.hot,
                  hot_temp=args.hot_temp, seed=args.seed, username=username,
                  password=password))
    return 0


def _credentials(args: argparse.Namespace) -> tuple[str | None, str | None]:
    import os

    spec = getattr(args, "as_user", None) or os.environ.get("LIGHTGATE_AUTH")
    if not spec:
        return None, None
    try:
        return split_credentials(spec, "--as (or LIGHTGATE_AUTH)")
    except ValueError as exc:
        raise SystemExit(f"lightgate: {exc}") from None


def cmd_analytics_run(args: argparse.Namespace) -> int:
    from spark_streaming.session import SparkSetupError, check_requirements

    try:
        check_requirements()  # before the jobs' modules, which import pyspark
    except SparkSetupError as exc:
        raise CommandError(str(exc)) from None
    from spark_streaming.jobs.rules import load_rules

    rules = None
    if args.job == "alerts":
        if not args.rules:
            print("lightgate analytics run alerts: --rules FILE is required", file=sys.stderr)
            return 2
        try:
            rules = load_rules(args.rules)  # before Spark starts: fail fast on a typo
        except (OSError, ValueError) as exc:
            print(f"lightgate: bad rules file: {exc}", file=sys.stderr)
            return 2
    try:
        return _run(args, rules)
    except SparkSetupError as exc:
        raise CommandError(str(exc)) from None


def _default_trigger(job: str) -> str:
    return ALERTS_TRIGGER if job == "alerts" else TRIGGER


def _run(args: argparse.Namespace, rules: Any) -> int:
    from spark_streaming.jobs import aggregates, alerts, offline
    from spark_streaming.jobs.common import JobConfig
    from spark_streaming.session import get_spark

    cfg = JobConfig(server=args.server, checkpoint=args.checkpoint or f"checkpoints/{args.job}",
                    source_topic=args.topic, device_from=args.device_from,
                    starting_offsets=args.starting_offsets,
                    max_offsets_per_trigger=args.max_offsets_per_trigger,
                    trigger=getattr(args, "trigger", None) or _default_trigger(args.job),
                    watermark=args.watermark,
                    username=_credentials(args)[0], password=_credentials(args)[1])
    logging.getLogger("py4j").setLevel(logging.WARNING)  # one line per call otherwise
    spark = get_spark(args.master, f"lightgate-{args.job}")
    stopping = False

    def stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    if args.job == "alerts":
        queries = alerts.start(spark, cfg, rules)
    elif args.job == "aggregates":
        queries = aggregates.start(spark, cfg, args.field, args.window, args.slide)
    else:
        queries = offline.start(spark, cfg, args.offline_after)
    print(f"analytics {args.job} running: {', '.join(q.name for q in queries)} "
          f"(server {args.server}, checkpoint {cfg.checkpoint})", file=sys.stderr, flush=True)
    deadline = time.monotonic() + args.duration if args.duration else None
    failed = None
    while not stopping and (deadline is None or time.monotonic() < deadline):
        failed = next((q for q in queries if not q.isActive), None)
        if failed is not None:
            break
        time.sleep(0.2)
    for q in queries:
        q.stop()
    spark.stop()
    if failed is not None and failed.exception() is not None:
        print(f"lightgate: query {failed.name} failed: {failed.exception()}", file=sys.stderr)
        return 1
    return 0
