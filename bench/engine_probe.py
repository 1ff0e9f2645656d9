"""What the native per-message path costs on its own, side by side with Mosquitto in one
run: `native/examples/engine_broker` (the native engine with the least owner around it:
CONNECT accepted as is, SUBSCRIBE to plain filters, no auth, sessions or index) under the
MQTT benchmark's own scenarios and CPU accounting. A probe of the design, not a row of
`make bench`: Lightgate's rows are the product's.

    cargo build --release --example engine_broker --manifest-path native/Cargo.toml
    python bench/engine_probe.py [--quick] [--scenarios qos0_1to1,...] [--io-threads N]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.mqtt import brokers, runner  # noqa: E402
from bench.mqtt.scenarios import SIZES  # noqa: E402

BINARY = ROOT / "native" / "target" / "release" / "examples" / "engine_broker"


def start_engine(io_threads: int) -> brokers.Broker:
    b = brokers.Broker("native-engine")
    b.port = brokers.free_port()
    data = Path(tempfile.mkdtemp(prefix="engine-probe-"))
    brokers._spawn(b, [str(BINARY), str(b.port), str(data), str(io_threads)], "engine", False)
    brokers._wait_port(b, b.port)
    return b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the quick sizes (default: tiny)")
    ap.add_argument("--scenarios", default="qos0_1to1,qos1_1to1,fanin_100to1,device_fanin,"
                                           "fanout_1to1000,cpu_at_rate")
    ap.add_argument("--io-threads", type=int, default=1)
    args = ap.parse_args()
    if not BINARY.exists():
        sys.exit(f"build it first: cargo build --release --example engine_broker "
                 f"--manifest-path native/Cargo.toml ({BINARY} is missing)")
    size = SIZES["quick" if args.quick else "tiny"]
    original = runner.start_broker
    runner.start_broker = lambda name: (start_engine(args.io_threads)
                                        if name == "native-engine" else original(name))
    rows = []
    for scenario in args.scenarios.split(","):
        by = {}
        for name in ("mosquitto", "native-engine"):
            row = runner.run_one(scenario, name, size, None)
            by[name] = row
            print(f"{scenario:16} {name:14} msgs/s={row.get('msgs_per_s')} "
                  f"cpu_us/msg={row.get('cpu_us_per_msg')} p99={row.get('p99_ms')} "
                  f"received={row.get('received')}/{row.get('expected')} "
                  f"{row.get('error') or ''}", file=sys.stderr, flush=True)
        m, n = by["mosquitto"], by["native-engine"]
        rows.append({"scenario": scenario, "io_threads": args.io_threads,
                     "mosquitto": {k: m.get(k) for k in ("msgs_per_s", "cpu_us_per_msg",
                                                         "p99_ms", "received", "error")},
                     "native_engine": {k: n.get(k) for k in ("msgs_per_s", "cpu_us_per_msg",
                                                             "p99_ms", "received", "error")}})
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
