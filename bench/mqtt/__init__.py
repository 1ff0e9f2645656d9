"""The MQTT benchmark harness: Lightgate against Mosquitto, RabbitMQ, rumqttd and amqtt
(bench/README.md).

Run it as `python bench/mqtt_bench.py` (what `make bench` does) or `python -m bench.mqtt`;
cli.py has the usage. The modules, lowest first (each imports only those above it):

    wire       raw-socket MQTT client pieces: frame splitting, CONNECT/SUBSCRIBE, PUBACKs
    procfs     what /proc says: CPU, RSS, per-thread CPU and switches, listen overflows
    installs   install the peers on first use (apt-get; rumqttd from its crate)
    brokers    start and stop Mosquitto, RabbitMQ, rumqttd, amqtt and Lightgate
    loadgen    worker processes (Crew) and the client loops they run
    scenarios  each scenario as a function, their registry and the quick / full sizes
    runner     one row: start a broker, measure a scenario on it, stop it (and py-spy)
    report     latest.json, a PNG per scenario, the summary table
    cli        the flags and the loop over scenarios x brokers

What several of them share lives here, so that none imports another just for it.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAYLOAD = 64
CORES = os.cpu_count() or 2


def progress(text: str) -> None:
    print(f"[mqtt_bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)
