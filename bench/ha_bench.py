"""QoS 1 throughput through a gateway: a single store node vs a store group with
synchronous replication (3 nodes, --min-insync 2). One table row each: messages/s and
PUBACK latency (p50, p99) for the same load.

    .venv/bin/python bench/ha_bench.py                 # 4 publishers x 10,000 messages
    .venv/bin/python bench/ha_bench.py --smoke         # a few hundred messages (seconds)

Everything runs on 127.0.0.1 on free ports, in fresh temporary data directories; every
loop is bounded by message count and by a deadline. Prints one JSON list on stdout and
writes bench/results/ha.json. The machine must be otherwise idle (docs/benchmarks.md,
"Running them")."""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results_dir import RESULTS  # noqa: E402
from gateway import mqtt  # noqa: E402

PY = sys.executable


def free_port() -> int:
    """A loopback port free now, below the ephemeral range: a port from bind(0) can be
    taken by another process's outgoing connection before the store binds it."""
    for _ in range(1000):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free loopback port below the ephemeral range")


def start(args: list[str]) -> tuple[subprocess.Popen, dict[str, str]]:
    proc = subprocess.Popen([PY, "-m", "lightgate", "--log-level", "WARNING", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("ready "):
        proc.kill()
        raise RuntimeError(f"{args[0]} did not start: {line!r}")
    return proc, dict(part.split("=", 1) for part in line.split()[1:])


def wait_master(http_addrs: list[str], timeout: float = 30.0) -> None:
    import urllib.request
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        roles, insync = [], 0
        for h in http_addrs:
            try:
                with urllib.request.urlopen(f"http://{h}/api/v1/cluster", timeout=2) as r:
                    st = json.loads(r.read())
                roles.append(st["role"])
                insync = max(insync, len(st.get("insync", [])))
            except OSError:
                roles.append(None)
        if roles.count("master") == 1 and insync == len(http_addrs):
            return
        time.sleep(0.2)
    raise RuntimeError("no master with every node in sync")


def publisher(port: int, name: str, count: int, window: int, deadline: float,
              out: dict) -> None:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    dec = mqtt.Decoder(server=False, version=5)
    pending: list = []

    def recv() -> object:
        while not pending:
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("closed")
            pending.extend(dec.feed(data))
        return pending.pop(0)

    sock.sendall(mqtt.encode(mqtt.Connect(client_id=name, protocol_level=5), 5))
    assert isinstance(recv(), mqtt.Connack)
    sent_at: dict[int, float] = {}
    lat: list[float] = []
    errors = sent = 0
    payload = b"x" * 100
    while (sent < count or sent_at) and time.monotonic() < deadline:
        while sent < count and len(sent_at) < window:
            pid = sent % 65535 + 1
            sock.sendall(mqtt.encode(mqtt.Publish("bench/ha", payload, qos=1, packet_id=pid), 5))
            sent_at[pid] = time.perf_counter()
            sent += 1
        ack = recv()
        if isinstance(ack, mqtt.Puback) and ack.packet_id in sent_at:
            lat.append(time.perf_counter() - sent_at.pop(ack.packet_id))
            errors += ack.reason_code != 0
    sock.close()
    out[name] = {"acked": len(lat) - errors, "errors": errors, "latencies": lat}


def run(kind: str, pubs: int, count: int, window: int, limit_s: float) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="ha-bench-", dir=ROOT / "bench"))
    procs: list[subprocess.Popen] = []
    try:
        if kind == "single":
            p, a = start(["store", "--data-dir", str(tmp / "s0"), "--native", "127.0.0.1:0",
                          "--http", "127.0.0.1:0"])
            procs.append(p)
            stores = a["native"]
        else:
            raft = [f"127.0.0.1:{free_port()}" for _ in range(3)]
            natives, https = [], []
            for i in range(3):
                p, a = start(["store", "--data-dir", str(tmp / f"s{i}"),
                              "--native", "127.0.0.1:0", "--http", "127.0.0.1:0",
                              "--raft", raft[i], "--group-peers", ",".join(raft),
                              "--replication", "sync", "--min-insync", "2",
                              "--raft-secret", "ha-bench-group"])
                procs.append(p)
                natives.append(a["native"])
                https.append(a["http"])
            wait_master(https)
            stores = ",".join(natives)
        g, ga = start(["gateway", "--store", stores, "--mqtt", "127.0.0.1:0", "--ws", "off",
                       "--http", "127.0.0.1:0"])
        procs.append(g)
        port = int(ga["mqtt"].rsplit(":", 1)[1])
        out: dict = {}
        deadline = time.monotonic() + limit_s
        t0 = time.perf_counter()
        threads = [threading.Thread(target=publisher,
                                    args=(port, f"pub{i}", count, window, deadline, out))
                   for i in range(pubs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(limit_s + 10)
        secs = time.perf_counter() - t0
        lat = sorted(x for r in out.values() for x in r["latencies"])
        acked = sum(r["acked"] for r in out.values())
        return {"scenario": f"qos1_{pubs}pub_window{window}", "store": kind,
                "messages": pubs * count, "acked": acked,
                "errors": sum(r["errors"] for r in out.values()), "seconds": round(secs, 2),
                "msgs_per_s": round(acked / secs, 1),
                "ack_p50_ms": round(lat[len(lat) // 2] * 1000, 2) if lat else None,
                "ack_p99_ms": round(lat[int(len(lat) * 0.99)] * 1000, 2) if lat else None,
                "load_1m_before": os.getloadavg()[0]}
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="a few hundred messages")
    ap.add_argument("--publishers", type=int, default=4)
    ap.add_argument("--messages", type=int, default=10_000, help="per publisher")
    ap.add_argument("--window", type=int, default=16, help="QoS 1 publishes in flight each")
    ap.add_argument("--limit-s", type=float, default=300.0, help="deadline per row")
    a = ap.parse_args()
    count = 100 if a.smoke else a.messages
    rows = [run(kind, a.publishers, count, a.window, a.limit_s) for kind in ("single", "sync3")]
    for r in rows:
        print(f"{r['store']:>7}: {r['msgs_per_s']:>9} msg/s  p50 {r['ack_p50_ms']} ms  "
              f"p99 {r['ack_p99_ms']} ms  ({r['acked']}/{r['messages']} acked)", file=sys.stderr)
    out = RESULTS
    out.mkdir(exist_ok=True)
    if not a.smoke:
        (out / "ha.json").write_text(json.dumps(rows, indent=1))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
