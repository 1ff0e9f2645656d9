"""MQTT benchmarks side by side: Lightgate (embedded, flush async and sync; separated)
against Debian's Mosquitto and the amqtt broker, each started here on loopback.

The load generator is not the bottleneck it measures: pre-encoded packets written in
large chunks from raw sockets, publishers and subscribers in separate processes, and
QoS 0 deliveries counted by bytes (every packet of a run has the same size) rather than
decoded. Every loop is bounded in messages and seconds.

    python bench/mqtt_bench.py --quick          # ~5 minutes: make bench
    python bench/mqtt_bench.py                  # the full set: make bench-full
    python bench/mqtt_bench.py --brokers lightgate-async,mosquitto --scenarios qos0_1to1

Prints a JSON list of rows (INTERFACES.md, Benchmarks) and writes
bench/results/latest.json plus a PNG per scenario.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway import mqtt  # noqa: E402

RESULTS = ROOT / "bench" / "results"
PAYLOAD = 64


def progress(text: str) -> None:
    print(f"[mqtt_bench] {text}", file=sys.stderr, flush=True)


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def rss_kb(pid: int) -> int:
    total = 0
    for p in [pid, *_children(pid)]:
        try:
            with open(f"/proc/{p}/status") as fh:
                total += next(int(ln.split()[1]) for ln in fh if ln.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(x) for x in fh.read().split()]
    except OSError:
        return []


# -- brokers ----------------------------------------------------------------------------
@dataclass
class Broker:
    name: str
    port: int = 0
    procs: list[subprocess.Popen] = field(default_factory=list)
    tmp: Path | None = None

    @property
    def pid(self) -> int:
        return self.procs[-1].pid  # the process that holds the MQTT connections

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)


def _wait_ready(proc: subprocess.Popen, what: str) -> dict[str, str]:
    line = proc.stdout.readline()
    if not line.startswith("ready"):
        raise RuntimeError(f"{what} did not start: {line!r}")
    return dict(p.split("=", 1) for p in line.split()[1:])


def _lightgate(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lightgate", "--log-level", "WARNING", *cmd],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)


def start_broker(name: str) -> Broker:
    b = Broker(name, free_port(), tmp=Path(tempfile.mkdtemp(prefix=f"bench-{name}-")))
    if name == "mosquitto":
        ensure_mosquitto()
        conf = b.tmp / "mosquitto.conf"
        conf.write_text(f"listener {b.port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
                        "max_inflight_messages 32\nmax_queued_messages 100000\n"
                        "log_type none\n")
        b.procs.append(subprocess.Popen(["/usr/sbin/mosquitto", "-c", str(conf)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _wait_port(b.port)
    elif name == "amqtt":
        p = subprocess.Popen([sys.executable, str(ROOT / "bench" / "amqtt_broker.py"),
                              str(b.port)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True)
        b.procs.append(p)
        _wait_ready(p, name)
    elif name in ("lightgate-async", "lightgate-sync"):
        p = _lightgate(["serve", "--data-dir", str(b.tmp / "d"), "--mqtt",
                        f"127.0.0.1:{b.port}", "--native", "127.0.0.1:0", "--http",
                        "127.0.0.1:0", "--flush", name.split("-")[1]])
        b.procs.append(p)
        _wait_ready(p, name)
    elif name == "lightgate-separated":
        redis_port = free_port()
        b.procs.append(subprocess.Popen(
            ["redis-server", "--port", str(redis_port), "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _wait_port(redis_port)
        url = f"redis://127.0.0.1:{redis_port}"
        store = _lightgate(["store", "--data-dir", str(b.tmp / "d"), "--native",
                            "127.0.0.1:0", "--http", "127.0.0.1:0", "--notify", url])
        b.procs.append(store)
        native = _wait_ready(store, "store")["native"]
        gw = _lightgate(["gateway", "--store", native, "--notify", url, "--mqtt",
                         f"127.0.0.1:{b.port}", "--http", "127.0.0.1:0"])
        b.procs.append(gw)
        _wait_ready(gw, "gateway")
    else:
        raise ValueError(f"unknown broker {name}")
    return b


def _wait_port(port: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def ensure_mosquitto() -> None:
    if not Path("/usr/sbin/mosquitto").exists():
        progress("installing Debian's mosquitto")
        subprocess.run("apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install "
                       "-y -qq mosquitto", shell=True, check=True, capture_output=True)


# -- raw clients ------------------------------------------------------------------------
def connect(port: int, client_id: str, clean: bool = True, source: str | None = None,
            timeout: float = 30) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout,
                                 source_address=(source, 0) if source else None)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.sendall(mqtt.encode(mqtt.Connect(client_id=client_id, clean_start=clean,
                                       keepalive=0), 4))
    ack = _read_exact(s, 4)
    if ack[:2] != b"\x20\x02" or ack[3] != 0:
        raise RuntimeError(f"CONNACK refused: {ack!r}")
    return s


def _read_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


def subscribe(s: socket.socket, topic_filter: str, qos: int) -> None:
    s.sendall(mqtt.encode(mqtt.Subscribe(1, [(topic_filter, mqtt.SubscriptionOptions(qos))]),
                          4))
    dec = mqtt.Decoder(server=False, version=4)
    while True:
        for p in dec.feed(s.recv(4096)):
            if isinstance(p, mqtt.Suback):
                return


def publish_packet(topic: str, qos: int, pid: int | None, payload: bytes) -> bytes:
    return mqtt.encode_publish(topic, payload, qos, False, False, pid, 4)


# -- load processes ---------------------------------------------------------------------
def sub_counter(port: int, topic_filter: str, n_subs: int, qos: int, expect: int,
                seconds: float, packet_len: int, ready: Any, out: Any) -> None:
    """Subscribers in one process; report (messages received, first, last) times."""
    import selectors

    socks = [connect(port, f"sub-{os.getpid()}-{i}") for i in range(n_subs)]
    for s in socks:
        subscribe(s, topic_filter, qos)
        s.setblocking(False)
    sel = selectors.DefaultSelector()
    decoders = {}
    for s in socks:
        sel.register(s, selectors.EVENT_READ)
        decoders[s] = mqtt.Decoder(server=False, version=4)
    ready.set()
    counts = 0
    byte_count = 0
    first = last = None
    deadline = time.monotonic() + seconds
    total = expect * n_subs
    while time.monotonic() < deadline:
        for key, _ in sel.select(timeout=0.2):
            s = key.fileobj
            try:
                data = s.recv(1 << 20)
            except BlockingIOError:
                continue
            if not data:
                continue
            now = time.monotonic()
            first = first or now
            last = now
            if qos == 0:
                byte_count += len(data)
                counts = byte_count // packet_len
            else:
                acks = []
                for p in decoders[s].feed(data):
                    if isinstance(p, mqtt.Publish):
                        counts += 1
                        acks.append(mqtt.encode(mqtt.Puback(p.packet_id), 4))
                if acks:
                    s.setblocking(True)
                    s.sendall(b"".join(acks))
                    s.setblocking(False)
        if counts >= total:
            break
    out.put((counts, first, last))
    for s in socks:
        s.close()


def pub_flood(port: int, topics: list[str], qos: int, count: int, seconds: float,
              start: Any) -> None:
    """Publish `count` messages spread over `topics` (one connection per topic)."""
    socks = [connect(port, f"pub-{os.getpid()}-{i}") for i in range(len(topics))]
    start.wait()
    payload = b"x" * PAYLOAD
    deadline = time.monotonic() + seconds
    per = count // len(topics)
    if qos == 0:
        chunks = [publish_packet(t, 0, None, payload) * 100 for t in topics]
        for _ in range(per // 100):
            for s, chunk in zip(socks, chunks, strict=True):
                s.sendall(chunk)
            if time.monotonic() > deadline:
                break
    else:
        window = 64
        for s, t in zip(socks, topics, strict=True):  # one at a time per connection
            dec = mqtt.Decoder(server=False, version=4)
            inflight = 0
            sent = 0
            pid = 1
            while sent < per and time.monotonic() < deadline:
                burst = []
                while inflight < window and sent < per:
                    burst.append(publish_packet(t, qos, pid, payload))
                    pid = pid % 65535 + 1
                    inflight += 1
                    sent += 1
                if burst:
                    s.sendall(b"".join(burst))
                for p in dec.feed(s.recv(65536)):
                    if isinstance(p, mqtt.Puback):
                        inflight -= 1
    time.sleep(0.5)
    for s in socks:
        s.close()


def run_flow(port: int, pub_topics: list[str], sub_filter: str, n_subs: int, qos: int,
             count: int, seconds: float, sub_procs: int = 1) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    ready = [ctx.Event() for _ in range(sub_procs)]
    start = ctx.Event()
    packet_len = len(publish_packet(pub_topics[0], 0, None, b"x" * PAYLOAD))
    per_proc = n_subs // sub_procs
    subs = [ctx.Process(target=sub_counter, args=(port, sub_filter, per_proc, qos, count,
                                                  seconds, packet_len, ready[i], out))
            for i in range(sub_procs)]
    for p in subs:
        p.start()
    for r in ready:
        r.wait(120)
    time.sleep(0.3)
    pub = ctx.Process(target=pub_flood, args=(port, pub_topics, qos, count, seconds, start))
    pub.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    start.set()
    results = [out.get(timeout=seconds + 120) for _ in subs]
    pub.join(30)
    for p in subs:
        p.join(30)
    received = sum(r[0] for r in results)
    firsts = [r[1] for r in results if r[1]]
    lasts = [r[2] for r in results if r[2]]
    span = (max(lasts) - min(firsts)) if firsts and lasts else (time.monotonic() - t0)
    return {"received": received, "expected": count * n_subs,
            "msgs_per_s": round(received / max(span, 1e-6))}


# -- scenarios --------------------------------------------------------------------------
def sc_qos0(b: Broker, size: dict) -> dict:
    return run_flow(b.port, ["bench/a"], "bench/a", 1, 0, size["msgs"], size["seconds"])


def sc_qos1(b: Broker, size: dict) -> dict:
    return run_flow(b.port, ["bench/a"], "bench/a", 1, 1, size["msgs"] // 4, size["seconds"])


def sc_fanin(b: Broker, size: dict) -> dict:
    topics = [f"fanin/{i}/t" for i in range(100)]
    return run_flow(b.port, topics, "fanin/+/t", 1, 0, size["msgs"], size["seconds"])


def sc_fanout(b: Broker, size: dict) -> dict:
    n = size["fanout_subs"]
    res = run_flow(b.port, ["fanout/x/t"], "fanout/+/t", n, 0, size["fanout_msgs"],
                   size["seconds"], sub_procs=2)
    res["notes"] = f"{n} subscribers; msgs_per_s counts deliveries"
    return res


def sc_latency(b: Broker, size: dict) -> dict:
    """Publish at a fixed rate with send timestamps in the payload; measure delivery."""
    rate, seconds = size["latency_rate"], size["latency_seconds"]
    sub = connect(b.port, "lat-sub")
    subscribe(sub, "lat/t", 0)
    pub = connect(b.port, "lat-pub")
    sub.setblocking(False)
    dec = mqtt.Decoder(server=False, version=4)
    lat: list[float] = []
    t0 = time.perf_counter()
    sent = 0
    total = int(rate * seconds)
    while sent < total:
        due = t0 + sent / rate
        now = time.perf_counter()
        if now < due:
            time.sleep(min(due - now, 0.001))
        batch = []
        while sent < total and t0 + sent / rate <= time.perf_counter():
            stamp = str(time.perf_counter()).encode().ljust(PAYLOAD, b" ")
            batch.append(publish_packet("lat/t", 0, None, stamp))
            sent += 1
        if batch:
            pub.sendall(b"".join(batch))
        _drain_latency(sub, dec, lat)
    end = time.perf_counter() + 5
    while len(lat) < total and time.perf_counter() < end:
        _drain_latency(sub, dec, lat)
        time.sleep(0.001)
    sub.close()
    pub.close()
    if not lat:
        return {"error": "nothing delivered"}
    lat.sort()
    return {"p50_ms": round(statistics.median(lat) * 1000, 3),
            "p99_ms": round(lat[int(len(lat) * 0.99) - 1] * 1000, 3),
            "msgs_per_s": round(len(lat) / seconds), "received": len(lat), "expected": total,
            "notes": f"offered {rate} msg/s"}


def _drain_latency(sub: socket.socket, dec: Any, lat: list[float]) -> None:
    try:
        while True:
            data = sub.recv(1 << 20)
            if not data:
                return
            now = time.perf_counter()
            for p in dec.feed(data):
                if isinstance(p, mqtt.Publish):
                    lat.append(now - float(p.payload.strip()))
    except BlockingIOError:
        return


def sc_idle(b: Broker, size: dict) -> dict:
    """Idle connections: memory per connection and connect rate."""
    n = size["idle_conns"]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, n + 1000)), hard))
    time.sleep(0.5)
    before = rss_kb(b.pid)
    socks = []
    t0 = time.monotonic()
    for i in range(n):
        socks.append(connect(b.port, f"idle-{i}", source=f"127.0.{1 + i // 50000}.{2 + i % 250}"))
        if i and i % 10000 == 0:
            progress(f"  {i} connections")
    rate = n / (time.monotonic() - t0)
    time.sleep(1.0)
    after = rss_kb(b.pid)
    for s in socks:
        s.close()
    return {"kb_per_conn": round((after - before) / n, 2), "connects_per_s": round(rate),
            "notes": f"{n} connections, RSS {before} -> {after} kB"}


def sc_reconnect_storm(b: Broker, size: dict) -> dict:
    """K persistent sessions go offline, M messages queue for each, and they all come
    back at once: time until every one of them has its M messages (QoS 1)."""
    import selectors

    k, m = size["storm_clients"], size["storm_msgs"]
    for i in range(k):
        s = connect(b.port, f"storm-{i}", clean=False)
        subscribe(s, "storm/+/cmd", 1)
        s.close()
    time.sleep(0.5)
    pub = connect(b.port, "storm-pub")
    dec = mqtt.Decoder(server=False, version=4)
    for j in range(m):
        pub.sendall(publish_packet(f"storm/{j}/cmd", 1, j + 1, b"x" * PAYLOAD))
        while not any(isinstance(p, mqtt.Puback) for p in dec.feed(pub.recv(4096))):
            pass
    pub.close()
    sel = selectors.DefaultSelector()
    got: dict[socket.socket, int] = {}
    decs = {}
    t0 = time.monotonic()
    for i in range(k):
        s = socket.create_connection(("127.0.0.1", b.port), timeout=30)
        s.sendall(mqtt.encode(mqtt.Connect(client_id=f"storm-{i}", clean_start=False,
                                           keepalive=0), 4))
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
        got[s], decs[s] = 0, mqtt.Decoder(server=False, version=4)
    connected = time.monotonic()
    done = 0
    deadline = time.monotonic() + size["seconds"] * 3
    while done < k and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=0.5):
            s = key.fileobj
            try:
                data = s.recv(65536)
            except BlockingIOError:
                continue
            acks = []
            for p in decs[s].feed(data):
                if isinstance(p, mqtt.Publish):
                    got[s] += 1
                    acks.append(mqtt.encode(mqtt.Puback(p.packet_id), 4))
                    if got[s] == m:
                        done += 1
            if acks:
                s.setblocking(True)
                s.sendall(b"".join(acks))
                s.setblocking(False)
    elapsed = time.monotonic() - t0
    for s in got:
        s.close()
    return {"connects_per_s": round(k / max(connected - t0, 1e-6)),
            "msgs_per_s": round(sum(got.values()) / elapsed), "received": sum(got.values()),
            "expected": k * m, "notes": f"{k} sessions x {m} queued messages"}


SCENARIOS: dict[str, tuple[Callable[[Broker, dict], dict], str, bool]] = {
    # name: (function, main figure, higher is better)
    "qos0_1to1": (sc_qos0, "msgs_per_s", True),
    "qos1_1to1": (sc_qos1, "msgs_per_s", True),
    "fanin_100to1": (sc_fanin, "msgs_per_s", True),
    "fanout_1toN": (sc_fanout, "msgs_per_s", True),
    "idle_conns": (sc_idle, "kb_per_conn", False),
    "latency_fixed_rate": (sc_latency, "p99_ms", False),
    "reconnect_storm": (sc_reconnect_storm, "msgs_per_s", True),
}
SIZES = {
    "tiny": {"msgs": 2000, "seconds": 10, "fanout_subs": 10, "fanout_msgs": 50,
             "idle_conns": 100, "latency_rate": 200, "latency_seconds": 1,
             "storm_clients": 10, "storm_msgs": 3},
    "quick": {"msgs": 100_000, "seconds": 20, "fanout_subs": 200, "fanout_msgs": 500,
              "idle_conns": 2000, "latency_rate": 2000, "latency_seconds": 5,
              "storm_clients": 200, "storm_msgs": 10},
    "full": {"msgs": 500_000, "seconds": 60, "fanout_subs": 1000, "fanout_msgs": 2000,
             "idle_conns": 100_000, "latency_rate": 20_000, "latency_seconds": 10,
             "storm_clients": 2000, "storm_msgs": 20},
}
BROKERS = ["mosquitto", "lightgate-async", "lightgate-sync", "lightgate-separated", "amqtt"]


def plot(rows: list[dict], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress("matplotlib missing: no plots")
        return
    for scenario, (_, figure, higher) in SCENARIOS.items():
        mine = [r for r in rows if r["scenario"] == scenario and r.get(figure) is not None]
        if not mine:
            continue
        fig, ax = plt.subplots(figsize=(7, 3.5))
        bars = ax.bar([r["broker"] for r in mine], [r[figure] for r in mine],
                      color=["#888" if r["broker"] == "mosquitto" else "#2b7de9" for r in mine])
        for bar, r in zip(bars, mine, strict=True):
            ratio = r.get("ratio_vs_mosquitto")
            ax.annotate(f"{ratio:.2f}x" if ratio is not None else "",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=9)
        ax.set_title(f"{scenario}: {figure} ({'higher' if higher else 'lower'} is better)")
        ax.tick_params(axis="x", labelsize=8)
        fig.tight_layout()
        fig.savefig(out / f"{scenario}.png", dpi=100)
        plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="a smoke run for the tests")
    parser.add_argument("--out", default=str(RESULTS), help="where latest.json and PNGs go")
    parser.add_argument("--brokers", default=",".join(BROKERS))
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = parser.parse_args()
    size = SIZES["tiny" if args.tiny else "quick" if args.quick else "full"]
    brokers = args.brokers.split(",")
    rows: list[dict] = []
    for scenario in args.scenarios.split(","):
        fn, figure, higher = SCENARIOS[scenario]
        for name in brokers:  # alternating brokers within each scenario
            progress(f"{scenario} on {name}")
            row: dict[str, Any] = {"scenario": scenario, "broker": name, "msgs_per_s": None,
                                   "p50_ms": None, "p99_ms": None, "kb_per_conn": None,
                                   "connects_per_s": None, "ratio_vs_mosquitto": None,
                                   "higher_is_better": higher}
            t0 = time.monotonic()
            broker = None
            try:
                broker = start_broker(name)
                row.update(fn(broker, size))
            except Exception as exc:  # record it; the other brokers still run
                row["error"] = f"{type(exc).__name__}: {exc}"
            finally:
                if broker:
                    broker.stop()
            row["duration_s"] = round(time.monotonic() - t0, 1)
            rows.append(row)
            progress(f"  -> {row.get(figure)} {row.get('error', '')}")
        base = next((r for r in rows if r["scenario"] == scenario and r["broker"] == "mosquitto"
                     and r.get(figure)), None)
        for r in rows:
            if r["scenario"] == scenario and base and r.get(figure):
                r["ratio_vs_mosquitto"] = round(r[figure] / base[figure], 3)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "latest.json").write_text(json.dumps(rows, indent=2) + "\n")
    plot(rows, out)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
