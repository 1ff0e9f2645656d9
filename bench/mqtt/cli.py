"""MQTT benchmarks side by side: Lightgate (embedded, flush async and sync; separated)
against Debian's Mosquitto, RabbitMQ's MQTT plugin (Debian's rabbitmq-server), rumqttd
(built from its crate) and the amqtt broker, each started here on loopback, one at a
time, every broker in turn for each scenario.

The load generator is meant not to be the bottleneck: packets are encoded once with our
sans-IO codec and written in large chunks from raw sockets; publishers and subscribers
run in separate worker processes (as many as the machine has cores), each holding many
connections on plain non-blocking sockets and a selector; the hot receive path splits
frames by their fixed header instead of decoding them. Every loop is bounded in
messages and in seconds.

    python bench/mqtt_bench.py --quick          # ~10 minutes: make bench
    python bench/mqtt_bench.py                  # the full set: make bench-full
    python bench/mqtt_bench.py --brokers lightgate-async,mosquitto --scenarios qos0_1to1
    python bench/mqtt_bench.py --quick --scenarios qos0_1to1 --profile /tmp/prof
    python bench/mqtt_bench.py --quick --tls    # every broker on its TLS listener
    python -m bench.mqtt --quick                # the same, from the repository root

Prints one JSON list of rows (bench/README.md, "Reading the JSON", explains them)
and writes bench/results/latest.json plus a PNG per scenario.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from . import CORES, ROOT, progress, report
from .brokers import BROKERS, OPT_IN
from .procfs import raise_nofile
from .runner import run_one
from .scenarios import NEEDS, QUICK_SCENARIOS, SCENARIOS, SIZES, TLS_ONLY
from .tls import Certs, make_certs

RESULTS = ROOT / "bench" / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="every scenario but reconnect_storm, small (~10 min)")
    parser.add_argument("--tiny", action="store_true", help="a smoke run for the tests")
    parser.add_argument("--brokers", default=",".join(BROKERS),
                        help=f"comma-separated, of {','.join(BROKERS + OPT_IN)} "
                             "(default: all but the last three)")
    parser.add_argument("--scenarios", default=None,
                        help=f"comma-separated subset of {','.join(SCENARIOS)}")
    parser.add_argument("--out", default=None,
                        help=f"where latest.json and PNGs go (default {RESULTS}, with --tls "
                             f"{RESULTS / 'tls'})")
    parser.add_argument("--tls", action="store_true",
                        help="every broker on its TLS listener (one P-256 certificate made "
                             "for the run); adds device_fleet_mtls to the default scenarios")
    parser.add_argument("--profile", metavar="DIR", default=None,
                        help="py-spy record each Lightgate broker; top self time per row")
    parser.add_argument("--idle-conns", type=int, default=None, metavar="N",
                        help="idle_conns: hold N connections (default: the size's)")
    args = parser.parse_args()
    size = dict(SIZES["tiny" if args.tiny else "quick" if args.quick else "full"])
    if args.idle_conns:
        size["idle_conns"] = args.idle_conns
    scenarios = (args.scenarios.split(",") if args.scenarios else
                 list(QUICK_SCENARIOS) if args.quick or args.tiny else
                 [s for s in SCENARIOS if s not in TLS_ONLY])
    if args.tls and not args.scenarios:
        scenarios += [s for s in TLS_ONLY if s not in scenarios]
    brokers = args.brokers.split(",")
    if bad := [s for s in scenarios if s not in SCENARIOS] + [b for b in brokers
                                                             if b not in BROKERS + OPT_IN]:
        parser.error(f"unknown scenario or broker: {', '.join(bad)}")
    nofile = raise_nofile(2 * max(size["idle_conns"], size["fleet_devices"]) + 10_000)
    profile_dir = Path(args.profile) if args.profile else None
    if profile_dir:
        profile_dir.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else RESULTS / "tls" if args.tls else RESULTS
    # One CA and certificate for the whole run, where any row is on TLS.
    mutual = any(NEEDS[s](size).get("mutual") for s in scenarios if s in NEEDS)
    cert_dir = Path(tempfile.mkdtemp(prefix="bench-certs-")) if args.tls or mutual else None
    certs = make_certs(cert_dir) if cert_dir else None
    progress(f"{len(scenarios)} scenarios x {len(brokers)} brokers, {CORES} cores, "
             f"RLIMIT_NOFILE {nofile}, load {os.getloadavg()[0]:.2f}"
             + (", on TLS" if args.tls else ""))
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    try:
        for scenario in scenarios:
            rows.extend(run_scenario(scenario, brokers, size, profile_dir, certs, args))
    finally:
        if cert_dir:
            shutil.rmtree(cert_dir, ignore_errors=True)
    report.write(rows, out)
    progress(f"done in {time.monotonic() - started:.0f} s\n{report.table(rows)}")
    print(json.dumps(rows))


def run_scenario(scenario: str, brokers: list[str], size: dict[str, Any],
                 profile_dir: Path | None, certs: Certs | None, args: argparse.Namespace
                 ) -> list[dict[str, Any]]:
    """Every broker in turn on one scenario, with the ratios between them."""
    figure = SCENARIOS[scenario][1]
    mine = []
    # At 2,000 msg/s of QoS 0 the floor under the goal runs beside the brokers: what a
    # bare trio forwarder storing every message costs, in the same run (plain TCP only).
    floor = scenario == "cpu_at_rate" and not args.tiny and not args.tls
    for name in [*brokers, *(["trio-floor"] if floor else [])]:
        progress(f"{scenario} on {name}")
        row = run_one(scenario, name, size, profile_dir, certs, args.tls)
        mine.append(row)
        progress(f"  -> {figure}={row.get(figure)} in {row['duration_s']} s "
                 f"{row.get('error', '')}")
    add_ratios(mine, figure)
    return mine


# Every row is compared with Mosquitto's (ratio_vs_mosquitto, null without it); with the
# other peers and the trio floor only when they ran: ratio_vs_rabbitmq, ratio_vs_rumqttd.
REFERENCES = ("mosquitto", "rabbitmq", "rumqttd", "trio-floor")


def add_ratios(rows: list[dict[str, Any]], figure: str) -> None:
    """Each row's main figure over each reference broker's in the same scenario."""
    for ref in REFERENCES:
        base = next((r for r in rows if r["broker"] == ref and r.get(figure)), None)
        if base is None:
            continue
        for r in rows:
            if r.get(figure) is not None:
                r[f"ratio_vs_{ref.replace('-', '_')}"] = round(r[figure] / base[figure], 3)
