"""Native protocol benchmark: produce and consume msgs/s through the SDK.

Starts `lightgate store` on loopback (flush async), then measures, each bounded in count
and time: single sends (one request per message, sync Producer), batch sends
(send_batch of 100), and a consumer group of one draining what was produced. Beside each
rate, the CPU time per message of the store process and of this one (the SDK): on a
shared machine the rates swing with the load, CPU per message much less.
Prints one JSON object and writes bench/results/native_latest.json.

    python bench/native_bench.py [--messages N] [--size BYTES] [--no-idempotent]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results_dir import RESULTS  # noqa: E402
from lightgate import Consumer, Producer  # noqa: E402


def progress(text: str) -> None:
    print(f"[native_bench] {text}", file=sys.stderr, flush=True)


def start_store(data: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "lightgate", "--log-level", "WARNING", "store", "--data-dir",
         str(data), "--native", "127.0.0.1:0", "--http", "127.0.0.1:0"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("ready "):
        raise RuntimeError(f"store did not start: {line!r}")
    addrs = dict(part.split("=", 1) for part in line.split()[1:])
    return proc, addrs["native"]


def _cpu(pid: int) -> float:
    """CPU seconds of process `pid` (Linux /proc), all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Cpu:
    """CPU per message of the store and of this process over a phase, in µs."""

    def __init__(self, store_pid: int) -> None:
        self.pid = store_pid
        self.store, self.own = _cpu(store_pid), _cpu(os.getpid())

    def per(self, n: int) -> dict[str, float]:
        return {"store_cpu_us": round((_cpu(self.pid) - self.store) / max(n, 1) * 1e6, 2),
                "client_cpu_us": round((_cpu(os.getpid()) - self.own) / max(n, 1) * 1e6, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=60.0, help="bound per phase")
    parser.add_argument("--idempotent", action=argparse.BooleanOptionalAction, default=True,
                        help="the producer numbers its sends (the SDK's default)")
    args = parser.parse_args()
    data = Path(tempfile.mkdtemp(prefix="native-bench-"))
    proc, addr = start_store(data)
    body = b"x" * args.size
    out: dict = {"messages": args.messages, "size": args.size, "idempotent": args.idempotent}
    try:
        with Producer(addr, idempotent=args.idempotent) as producer:
            progress(f"single sends x{args.messages // 4}")
            n, t0, cpu = 0, time.perf_counter(), Cpu(proc.pid)
            while n < args.messages // 4 and time.perf_counter() - t0 < args.seconds:
                producer.send("bench", body, key=str(n))
                n += 1
            out["produce_single_msgs_per_s"] = round(n / (time.perf_counter() - t0))
            out["produce_single"] = cpu.per(n)
            progress(f"batch sends of 100 x{args.messages // 100}")
            m, t0, cpu = 0, time.perf_counter(), Cpu(proc.pid)
            while m < args.messages and time.perf_counter() - t0 < args.seconds:
                producer.send_batch("bench", [body] * 100, key=str(m))
                m += 100
            out["produce_batch_msgs_per_s"] = round(m / (time.perf_counter() - t0))
            out["produce_batch"] = cpu.per(m)
        total = n + m
        progress(f"consume {total} with one group member")
        with Consumer(addr, "bench-group", "bench") as consumer:
            got, t0 = 0, time.perf_counter()
            while got < total and time.perf_counter() - t0 < args.seconds:
                msgs = consumer.poll(timeout=1.0, max_messages=256)
                for msg in msgs:
                    consumer.ack(msg)
                got += len(msgs)
            out["consume_msgs_per_s"] = round(got / (time.perf_counter() - t0))
            out["consumed"] = got
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(data, ignore_errors=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "native_latest.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
