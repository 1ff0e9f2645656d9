"""MQTT benchmarks side by side: Lightgate (embedded, flush async and sync; separated)
against Debian's Mosquitto and the amqtt broker, each started here on loopback, one at
a time, every broker in turn for each scenario.

The load generator is meant not to be the bottleneck: packets are encoded once with our
sans-IO codec and written in large chunks from raw sockets; publishers and subscribers
run in separate worker processes (as many as the machine has cores), each holding many
connections on plain non-blocking sockets and a selector; the hot receive path splits
frames by their fixed header instead of decoding them. Every loop is bounded in
messages and in seconds.

    python bench/mqtt_bench.py --quick          # ~5 minutes: make bench
    python bench/mqtt_bench.py                  # the full set: make bench-full
    python bench/mqtt_bench.py --brokers lightgate-async,mosquitto --scenarios qos0_1to1
    python bench/mqtt_bench.py --quick --scenarios qos0_1to1 --profile /tmp/prof

Prints one JSON list of rows (INTERFACES.md, Benchmarks; bench/README.md explains them)
and writes bench/results/latest.json plus a PNG per scenario.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import queue
import resource
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
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
CORES = os.cpu_count() or 2
MOSQUITTO = Path("/usr/sbin/mosquitto")
# Linux: pick the source port at connect() time, not bind(), so each source address
# gets the whole ephemeral range per destination (Python may not export the constant).
IP_BIND_ADDRESS_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)
STAMP = struct.Struct(">qI")  # send time (perf_counter_ns, system-wide monotonic), seq
FIELDS = ("msgs_per_s", "p50_ms", "p99_ms", "kb_per_conn", "connects_per_s")


def progress(text: str) -> None:
    print(f"[mqtt_bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raise_nofile(want: int) -> int:
    """Raise RLIMIT_NOFILE as far as allowed; brokers started afterwards inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < want:
        try:  # root may raise the hard limit up to fs.nr_open
            nr_open = int(Path("/proc/sys/fs/nr_open").read_text())
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, nr_open),) * 2)
            return min(want, nr_open)
        except (OSError, ValueError):
            pass
    new = min(max(soft, want), hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    return new


def rss_kb(pid: int) -> int:
    """Resident memory of a process and its children (kB)."""
    total = 0
    for p in [pid, *_children(pid)]:
        try:
            with open(f"/proc/{p}/status") as fh:
                total += next(int(ln.split()[1]) for ln in fh if ln.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of these processes and their children so far. Unlike a
    rate, CPU per message hardly moves when other work shares the machine."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        for p in [pid, *_children(pid)]:
            try:
                with open(f"/proc/{p}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick
            except (OSError, IndexError, ValueError):
                pass
    return total


def thread_times(pids: list[int]) -> dict[str, list[float]]:
    """Per thread name (comm) of these processes: [CPU seconds, voluntary and involuntary
    context switches]. Shows which thread burns the CPU, and whether threads hand the GIL
    back and forth (involuntary switches)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, list[float]] = {}
    for pid in pids:
        for p in [pid, *_children(pid)]:
            try:
                tids = os.listdir(f"/proc/{p}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    with open(f"/proc/{p}/task/{tid}/stat") as fh:
                        head, _, rest = fh.read().rpartition(")")
                    status = Path(f"/proc/{p}/task/{tid}/status").read_text()
                except OSError:
                    continue
                fields = rest.split()
                name = head.split("(", 1)[1]
                sw = {k: int(v) for k, v in (ln.split(":\t") for ln in status.splitlines()
                                             if ln.endswith(tuple("0123456789"))
                                             and "ctxt_switches" in ln)}
                row = out.setdefault(name, [0.0, 0, 0])
                row[0] += (int(fields[11]) + int(fields[12])) / tick
                row[1] += sw.get("voluntary_ctxt_switches", 0)
                row[2] += sw.get("nonvoluntary_ctxt_switches", 0)
    return out


def thread_report(before: dict[str, list[float]], after: dict[str, list[float]],
                  messages: int, seconds: float) -> dict[str, dict[str, float]]:
    """CPU µs per message and context switches per second, per thread name (a name
    shared by several threads, e.g. a pool, is their sum)."""
    rep = {}
    for name, (cpu, vol, invol) in after.items():
        b = before.get(name, [0.0, 0, 0])
        used = cpu - b[0]
        if used <= 0 and vol - b[1] <= 0:
            continue
        rep[name] = {"cpu_us_per_msg": round(used * 1e6 / messages, 2) if messages else None,
                     "voluntary_switches_per_s": round((vol - b[1]) / seconds),
                     "involuntary_switches_per_s": round((invol - b[2]) / seconds)}
    return rep


def listen_overflows() -> int:
    """Kernel count of SYNs dropped on a full accept queue (each costs the client a 1 s
    SYN retransmit); system-wide, so only meaningful on an otherwise idle machine."""
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
        names, values = (ln.split() for ln in lines if ln.startswith("TcpExt:"))
        return int(dict(zip(names, values, strict=True))["ListenOverflows"])
    except (OSError, ValueError, KeyError):
        return 0


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
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)
    tmp: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="bench-")))

    @property
    def pid(self) -> int:
        return self.procs[-1].pid  # the process that holds the MQTT connections

    def died(self) -> str | None:
        for p in self.procs:
            if p.poll() is not None:
                return f"broker process exited with {p.returncode}: {self.log_tail()}"
        return None

    def log_tail(self, n: int = 600) -> str:
        tails = [f.read_text(errors="replace")[-n:] for f in sorted(self.tmp.glob("*.log"))]
        return " | ".join(t.strip() for t in tails if t.strip())

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
        shutil.rmtree(self.tmp, ignore_errors=True)


def _spawn(b: Broker, cmd: list[str], tag: str, ready_line: bool) -> subprocess.Popen[Any]:
    log = open(b.tmp / f"{tag}.log", "w")  # noqa: SIM115 - the child owns it
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE if ready_line else log,
                         stderr=log, text=True)
    log.close()
    b.procs.append(p)
    return p


def _wait_ready(b: Broker, proc: subprocess.Popen[Any], timeout: float = 60) -> dict[str, str]:
    """Read the `ready k=v ...` line, bounded in time (a broker may hang on start-up)."""
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        raise RuntimeError(f"{b.name}: no ready line within {timeout:.0f} s: {b.log_tail()}")
    line = proc.stdout.readline()
    sel.close()
    if not line.startswith("ready"):
        raise RuntimeError(f"{b.name} did not start: {line!r} {b.log_tail()}")
    # Keep reading stdout so a chatty broker never blocks on a full pipe.
    threading.Thread(target=collections.deque, args=(proc.stdout, 0), daemon=True).start()
    return dict(p.split("=", 1) for p in line.split()[1:])


def _wait_port(b: Broker, port: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (err := b.died()) is not None:
            raise RuntimeError(err)
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{b.name}: nothing listens on {port}: {b.log_tail()}")


def _lightgate_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "lightgate", "--log-level", "WARNING", *args]


def start_broker(name: str) -> Broker:
    b = Broker(name, free_port())
    try:
        _start(b)
    except BaseException:
        b.stop()
        raise
    return b


def _start(b: Broker) -> None:
    name = b.name
    if name == "mosquitto":
        ensure_mosquitto()
        conf = b.tmp / "mosquitto.conf"
        conf.write_text(f"listener {b.port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
                        "max_inflight_messages 32\nmax_queued_messages 100000\n"
                        "log_dest stderr\nlog_type error\n")
        _spawn(b, [str(MOSQUITTO), "-c", str(conf)], "mosquitto", False)
        _wait_port(b, b.port)
    elif name == "amqtt":
        p = _spawn(b, [sys.executable, str(ROOT / "bench" / "amqtt_broker.py"), str(b.port)],
                   "amqtt", True)
        _wait_ready(b, p)
        _wait_port(b, b.port)
    elif name in ("lightgate-async", "lightgate-sync"):
        # Same bounds as the Mosquitto config: 32 in flight, 100,000 queued per session.
        p = _spawn(b, _lightgate_cmd(
            "serve", "--data-dir", str(b.tmp / "d"), "--ws", "off",
            "--mqtt", f"127.0.0.1:{b.port}",
            "--native", "127.0.0.1:0", "--http", "127.0.0.1:0", "--max-inflight", "32",
            "--max-offline-messages", "100000", "--flush", name.split("-")[1]),
            "lightgate", True)
        _wait_ready(b, p)
    elif name == "lightgate-separated":
        if not shutil.which("redis-server"):
            raise RuntimeError("redis-server missing (apt-get install redis-server)")
        redis_port = free_port()
        _spawn(b, ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1",
                   "--save", "", "--appendonly", "no"], "redis", False)
        _wait_port(b, redis_port)
        url = f"redis://127.0.0.1:{redis_port}"
        store = _spawn(b, _lightgate_cmd("store", "--data-dir", str(b.tmp / "d"), "--native",
                                         "127.0.0.1:0", "--http", "127.0.0.1:0", "--notify",
                                         url), "store", True)
        native = _wait_ready(b, store)["native"]
        gw = _spawn(b, _lightgate_cmd("gateway", "--store", native, "--notify", url, "--mqtt",
                                      f"127.0.0.1:{b.port}", "--http", "127.0.0.1:0",
                                      "--max-inflight", "32"), "gateway", True)
        _wait_ready(b, gw)
    else:
        raise ValueError(f"unknown broker {name}")


def ensure_mosquitto() -> None:
    """CI machines start empty: install Debian's broker on first use."""
    if MOSQUITTO.exists():
        return
    progress("installing Debian's mosquitto (apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    res = subprocess.run("apt-get update -qq && apt-get install -y -qq mosquitto", shell=True,
                         env=env, capture_output=True, text=True, timeout=600)
    if res.returncode != 0 or not MOSQUITTO.exists():
        raise RuntimeError(f"could not install mosquitto: {res.stderr[-500:]}")
    # Debian's package starts a system broker on 1883; ours get their own ports and config.


# -- wire helpers -----------------------------------------------------------------------
def split_frames(buf: bytes, bodies: bool) -> tuple[int, list[tuple[int, bytes]], int]:
    """Walk the complete MQTT packets at the start of `buf` without decoding them.

    Returns (PUBLISH packets seen, [(first byte, body)] when `bodies`, bytes consumed).
    About 10x cheaper than a full decode, so counting is not what limits a run.
    """
    n, p, count = len(buf), 0, 0
    out: list[tuple[int, bytes]] = []
    while p + 2 <= n:
        q, mult, length = p + 1, 1, 0
        while True:  # remaining length: a varint of at most 4 bytes
            if q >= n:
                return count, out, p
            byte = buf[q]
            q += 1
            length += (byte & 0x7F) * mult
            if byte < 0x80:
                break
            mult <<= 7
        end = q + length
        if end > n:
            break
        b0 = buf[p]
        if b0 >> 4 == 3:
            count += 1
        if bodies:
            out.append((b0, buf[q:end]))
        p = end
    return count, out, p


def publish_fields(b0: int, body: bytes) -> tuple[bytes, bytes]:
    """(packet id bytes, payload) of an MQTT 3.1.1 PUBLISH body."""
    pos = 2 + (body[0] << 8 | body[1])
    if b0 & 0x06:
        return body[pos:pos + 2], body[pos + 2:]
    return b"", body[pos:]


def puback(pid: bytes) -> bytes:
    return b"\x40\x02" + pid


def connect_packet(client_id: str, clean: bool = True) -> bytes:
    return mqtt.encode(mqtt.Connect(client_id=client_id, clean_start=clean, keepalive=0), 4)


def _recv_until(s: socket.socket, want: type, deadline: float) -> Any:
    """Blocking read until a packet of type `want` arrives (bounded by deadline)."""
    dec = mqtt.Decoder(server=False, version=4)
    while time.monotonic() < deadline:
        s.settimeout(max(0.1, deadline - time.monotonic()))
        data = s.recv(65536)
        if not data:
            raise ConnectionError("broker closed the connection")
        for p in dec.feed(data):
            if isinstance(p, want):
                return p
    raise TimeoutError(f"no {want.__name__} in time")


def connect(port: int, client_id: str, clean: bool = True, timeout: float = 30) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.sendall(connect_packet(client_id, clean))
    ack = _recv_until(s, mqtt.Connack, time.monotonic() + timeout)
    if ack.reason_code != 0:
        raise RuntimeError(f"CONNACK refused: {ack.reason_code}")
    return s


def subscribe(s: socket.socket, topic_filter: str, qos: int, timeout: float = 30) -> None:
    s.sendall(mqtt.encode(mqtt.Subscribe(1, [(topic_filter, mqtt.SubscriptionOptions(qos))]),
                          4))
    ack = _recv_until(s, mqtt.Suback, time.monotonic() + timeout)
    if ack.reason_codes[0] >= 0x80:
        raise RuntimeError(f"SUBACK refused {topic_filter}: {ack.reason_codes}")


def nb_connect(port: int, source: str | None) -> socket.socket:
    """Start a non-blocking TCP connect (optionally from a given 127.x.y.z address)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setblocking(False)
    if source:
        s.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
        s.bind((source, 0))
    s.connect_ex(("127.0.0.1", port))
    return s


# -- worker processes -------------------------------------------------------------------
class Crew:
    """Worker processes with a common start signal, results over one queue, and a bound
    on everything: setup, run, and the kill of whatever is left at the end."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("fork")
        self.q: Any = self.ctx.Queue()
        self.go_evt = self.ctx.Event()
        self.release = self.ctx.Event()
        self.procs: list[Any] = []

    def add(self, fn: Callable[..., dict[str, Any]], *args: Any) -> None:
        wid = len(self.procs)
        self.procs.append(self.ctx.Process(target=_worker_main, daemon=True,
                                           args=(fn, wid, self.q, self.go_evt, self.release,
                                                 args)))

    def _get(self, kind: str, n: int, timeout: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        got: dict[int, dict[str, Any]] = {}
        while len(got) < n:
            try:
                msg = self.q.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{n - len(got)} workers not {kind} in {timeout:.0f} s") from None
                if dead := [p for p in self.procs if p.exitcode not in (None, 0)]:
                    raise RuntimeError(f"worker died with {dead[0].exitcode}") from None
                continue
            if msg[0] == "error":
                raise RuntimeError(f"worker {msg[1]}: {msg[2]}")
            if msg[0] == kind:
                got[msg[1]] = msg[2]
        return [got[w] for w in sorted(got)]  # in the order the workers were added

    def start(self, setup_timeout: float) -> list[dict[str, Any]]:
        for p in self.procs:
            p.start()
        return self._get("ready", len(self.procs), setup_timeout)

    def go(self) -> float:
        t0 = time.monotonic()
        self.go_evt.set()
        return t0

    def results(self, timeout: float) -> list[dict[str, Any]]:
        return self._get("result", len(self.procs), timeout)

    def close(self) -> None:
        self.release.set()
        self.go_evt.set()
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)


def _worker_main(fn: Callable[..., dict[str, Any]], wid: int, q: Any, go_evt: Any,
                 release: Any, args: tuple[Any, ...]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    try:
        res = fn(wid, lambda info=None: q.put(("ready", wid, info or {})), go_evt, *args)
        q.put(("result", wid, res))
        release.wait(600)  # e.g. idle connections stay open until RSS was measured
    except BaseException as exc:
        q.put(("error", wid, f"{type(exc).__name__}: {exc}"))


def _await_go(go_evt: Any) -> float:
    if not go_evt.wait(300):
        raise TimeoutError("no start signal")
    return time.monotonic()


def w_subscribers(wid: int, ready: Callable[..., None], go_evt: Any, port: int,
                  topic_filter: str, n_subs: int, qos: int, expect_each: int,
                  seconds: float) -> dict[str, Any]:
    """n_subs subscribers; QoS 1 deliveries are PUBACKed. Reports count, first, last."""
    socks = []
    for i in range(n_subs):
        s = connect(port, f"sub-{wid}-{i}-{os.getpid()}")
        subscribe(s, topic_filter, qos)
        s.setblocking(False)
        socks.append(s)
    sel = selectors.DefaultSelector()
    rest: dict[socket.socket, bytes] = {}
    for s in socks:
        sel.register(s, selectors.EVENT_READ)
        rest[s] = b""
    ready()
    t0 = _await_go(go_evt)
    deadline = t0 + seconds
    total = expect_each * n_subs
    count = 0
    first = last = 0.0
    report = t0 + 2
    while count < total:
        now = time.monotonic()
        if now > deadline or (last and now - last > 5):  # stop on a quiet broker too
            break
        if now > report:
            progress(f"  subscribers w{wid}: {count}/{total}")
            report = now + 2
        for key, _ in sel.select(timeout=0.2):
            s = key.fileobj
            try:
                data = s.recv(1 << 20)  # type: ignore[union-attr]
            except BlockingIOError:
                continue
            if not data:
                sel.unregister(s)
                continue
            last = time.monotonic()
            first = first or last
            buf = rest[s] + data if rest[s] else data
            n, frames, used = split_frames(buf, qos > 0)
            rest[s] = buf[used:]
            count += n
            if frames:
                acks = b"".join(puback(publish_fields(b0, body)[0]) for b0, body in frames
                                if b0 >> 4 == 3)
                s.setblocking(True)  # acks are small; the broker reads them promptly
                s.sendall(acks)  # type: ignore[union-attr]
                s.setblocking(False)
    for s in socks:
        s.close()
    return {"count": count, "first": first, "last": last}


def w_publishers(wid: int, ready: Callable[..., None], go_evt: Any, port: int,
                 topics: list[str], qos: int, per_topic: int, seconds: float,
                 window: int = 64) -> dict[str, Any]:
    """One connection per topic. QoS 0: pre-encoded chunks of 100 packets written in turn
    on each connection. QoS 1: keep `window` PUBLISHes unacknowledged per connection."""
    socks = [connect(port, f"pub-{wid}-{i}-{os.getpid()}") for i in range(len(topics))]
    payload = b"x" * PAYLOAD
    ready()
    deadline = _await_go(go_evt) + seconds
    sent = 0
    if qos == 0:
        pkts = [mqtt.encode_publish(t, payload, 0, False, False, None, 4) for t in topics]
        rounds = [100] * (per_topic // 100) + ([per_topic % 100] if per_topic % 100 else [])
        for n in rounds:
            for s, pkt in zip(socks, pkts, strict=True):
                s.sendall(pkt * n)
            sent += n * len(topics)
            if time.monotonic() > deadline:
                break
    else:
        # Packet ids cycle through 1..window*2: an id is only reused once acknowledged.
        for s, t in zip(socks, topics, strict=True):
            pkts = [mqtt.encode_publish(t, payload, qos, False, False, pid, 4)
                    for pid in range(1, 2 * window + 1)]
            inflight = done = i = 0
            rest = b""
            s.settimeout(1.0)
            while done < per_topic and time.monotonic() < deadline:
                burst = []
                while inflight < window and i < per_topic:
                    burst.append(pkts[i % len(pkts)])
                    i += 1
                    inflight += 1
                if burst:
                    s.sendall(b"".join(burst))
                try:
                    data = s.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    raise ConnectionError("broker closed the publisher")
                buf = rest + data
                _, frames, used = split_frames(buf, True)
                rest = buf[used:]
                acked = sum(1 for b0, _ in frames if b0 >> 4 == 4)
                inflight -= acked
                done += acked
            sent += done
    # Stay connected until the subscribers are done: a broker may drop what it has not
    # processed yet when the publisher goes away.
    globals()["_held"] = socks
    return {"sent": sent}


def run_flow(port: int, pub_topics: list[str], sub_filter: str, n_subs: int, qos: int,
             count: int, seconds: float) -> dict[str, Any]:
    """Subscribers first (spread over the cores), then one publisher process; the rate
    is deliveries over the span from first to last delivery seen by any subscriber."""
    crew = Crew()
    sub_procs = min(CORES, n_subs)
    per_topic = count // len(pub_topics)
    expect = per_topic * len(pub_topics)
    try:
        for w in range(sub_procs):
            n = n_subs // sub_procs + (1 if w < n_subs % sub_procs else 0)
            crew.add(w_subscribers, port, sub_filter, n, qos, expect, seconds)
        crew.add(w_publishers, port, pub_topics, qos, per_topic, seconds)
        crew.start(setup_timeout=120)
        time.sleep(0.3)  # subscriptions registered everywhere before the first message
        crew.go()
        res = crew.results(seconds + 60)
    finally:
        crew.close()
    subs = res[:sub_procs]
    received = sum(r["count"] for r in subs)
    firsts = [r["first"] for r in subs if r["first"]]
    lasts = [r["last"] for r in subs if r["last"]]
    span = max(lasts) - min(firsts) if firsts else 0.0
    out: dict[str, Any] = {"received": received, "expected": expect * n_subs,
                           "sent": res[-1]["sent"],
                           "msgs_per_s": round(received / span) if span > 0 else None}
    if received < expect * n_subs:
        out["notes"] = f"{expect * n_subs - received} not delivered within the deadline"
    if not received:
        out["error"] = "nothing delivered"
    return out


# -- scenarios --------------------------------------------------------------------------
def sc_qos0(b: Broker, size: dict[str, Any]) -> dict[str, Any]:
    return run_flow(b.port, ["bench/a"], "bench/a", 1, 0, size["msgs"], size["seconds"])


def sc_qos1(b: Broker, size: dict[str, Any]) -> dict[str, Any]:
    res = run_flow(b.port, ["bench/a"], "bench/a", 1, 1, size["qos1_msgs"], size["seconds"])
    res["notes"] = (res.get("notes", "") + "; publisher window 64 unacked").lstrip("; ")
    return res


def sc_fanin(b: Broker, size: dict[str, Any]) -> dict[str, Any]:
    topics = [f"fanin/{i}/t" for i in range(100)]
    return run_flow(b.port, topics, "fanin/+/t", 1, 0, size["msgs"], size["seconds"])


def sc_fanout(b: Broker, size: dict[str, Any]) -> dict[str, Any]:
    n = size["fanout_subs"]
    res = run_flow(b.port, ["fanout/x/t"], "fanout/+/t", n, 0, size["fanout_msgs"],
                   size["seconds"])
    res["notes"] = (f"{n} subscribers x {size['fanout_msgs']} messages; msgs_per_s counts "
                    f"deliveries; " + res.get("notes", "")).rstrip("; ")
    return res


def w_latency_pub(wid: int, ready: Callable[..., None], go_evt: Any, port: int, rate: int,
                  total: int, qos: int = 0) -> dict[str, Any]:
    """Publish `total` messages at `rate`/s, each stamped with its send time. QoS 1:
    packet ids cycle, PUBACKs are read (and counted) as they come."""
    s = connect(port, f"lat-pub-{os.getpid()}")
    pad = b" " * (PAYLOAD - STAMP.size)
    ready()
    t0 = _await_go(go_evt)
    sent = acked = 0
    rest = b""
    hard_stop = t0 + total / rate * 2 + 5  # a broker that stops reading must not hang us
    while sent < total and time.monotonic() < hard_stop:
        if qos:
            acked, rest = _read_acks(s, acked, rest)
        now = time.monotonic()
        due = t0 + sent / rate
        if now < due:
            time.sleep(min(due - now, 0.0005))
            continue
        batch = []
        stamp = time.perf_counter_ns()  # send time of everything due now
        while sent < total and t0 + sent / rate <= now:
            batch.append(mqtt.encode_publish("lat/t", STAMP.pack(stamp, sent) + pad, qos,
                                             False, False, sent % 65535 + 1 if qos else None,
                                             4))
            sent += 1
        s.setblocking(True)
        s.sendall(b"".join(batch))
    while qos and acked < sent and time.monotonic() < hard_stop:
        acked, rest = _read_acks(s, acked, rest)
        time.sleep(0.001)
    globals()["_held"] = s  # connected until the subscriber is done (see w_publishers)
    return {"sent": sent, "acked": acked}


def _acks_in(rest: bytes, data: bytes) -> tuple[int, bytes]:
    """PUBACKs in what a publisher received (after `rest`, a partial packet from the last
    read), and the new partial rest."""
    if not data:
        raise ConnectionError("broker closed the publisher")
    buf = rest + data
    _, frames, used = split_frames(buf, True)
    return sum(1 for b0, _ in frames if b0 >> 4 == 4), buf[used:]


def _read_acks(s: socket.socket, acked: int, rest: bytes) -> tuple[int, bytes]:
    """PUBACKs waiting on a publisher's socket, without blocking."""
    s.setblocking(False)
    try:
        while True:
            n, rest = _acks_in(rest, s.recv(65536))
            acked += n
    except BlockingIOError:
        pass
    return acked, rest


def w_latency_sub(wid: int, ready: Callable[..., None], go_evt: Any, port: int, total: int,
                  warmup: int, seconds: float, qos: int = 0) -> dict[str, Any]:
    """A blocking reader on its own core, so the receive time is taken as data lands;
    QoS 1 deliveries are PUBACKed after each read."""
    s = connect(port, f"lat-sub-{os.getpid()}")
    subscribe(s, "lat/t", qos)
    s.settimeout(0.2)
    lat: list[int] = []
    got = 0
    rest = b""
    ready()
    deadline = _await_go(go_evt) + seconds + 5
    while got < total and time.monotonic() < deadline:
        try:
            data = s.recv(1 << 20)
        except TimeoutError:
            continue
        now = time.perf_counter_ns()
        if not data:
            break
        buf = rest + data
        _, frames, used = split_frames(buf, True)
        rest = buf[used:]
        acks = []
        for b0, body in frames:
            if b0 >> 4 == 3:
                got += 1
                pid, payload = publish_fields(b0, body)
                stamp, seq = STAMP.unpack_from(payload)
                if seq >= warmup:
                    lat.append(now - stamp)
                if pid:
                    acks.append(puback(pid))
        if acks:
            s.sendall(b"".join(acks))
    s.close()
    lat.sort()
    pick = (lambda q: round(lat[min(len(lat) - 1, int(len(lat) * q))] / 1e6, 3)) if lat else None
    return {"got": got, "p50_ms": pick(0.5) if pick else None,
            "p99_ms": pick(0.99) if pick else None, "max_ms": pick(1.0) if pick else None}


def _fixed_rate(b: Broker, rate: int, seconds: float, qos: int) -> dict[str, Any]:
    """Fixed offered rate, one publisher and one subscriber in separate processes;
    latency = receive time - send time stamped in the payload (same monotonic clock)."""
    total = int(rate * seconds)
    warmup = min(rate // 2, total // 10)  # the first half second warms caches and queues
    crew = Crew()
    try:
        crew.add(w_latency_sub, b.port, total, warmup, seconds, qos)
        crew.add(w_latency_pub, b.port, rate, total, qos)
        crew.start(setup_timeout=60)
        time.sleep(0.3)
        crew.go()
        sub, pub = crew.results(seconds * 2 + 30)
    finally:
        crew.close()
    if not sub["p99_ms"]:
        return {"error": "nothing delivered"}
    return {"p50_ms": sub["p50_ms"], "p99_ms": sub["p99_ms"], "max_ms": sub["max_ms"],
            "msgs_per_s": round(sub["got"] / seconds), "received": sub["got"],
            "expected": total, "sent": pub["sent"], "acked": pub["acked"] if qos else None,
            "notes": f"QoS {qos}, offered {rate} msg/s for {seconds} s; "
                     f"first {warmup} not timed"}


def sc_latency(b: Broker, size: dict[str, Any]) -> dict[str, Any]:
    return _fixed_rate(b, size["latency_rate"], size["latency_seconds"], 0)


def sc_cpu_at_rate(b: Broker, size: dict[str, Any]) -> dict[str, Any]:
    """What a realistic fleet costs: broker CPU per message at 2,000 msg/s, where nothing
    batches and each message is its own wake-up (the main figure is cpu_us_per_msg)."""
    return _fixed_rate(b, size["cpu_rate"], size["cpu_seconds"], 0)


def sc_cpu_at_rate_qos1(b: Broker, size: dict[str, Any]) -> dict[str, Any]:
    return _fixed_rate(b, size["cpu_rate"], size["cpu_seconds"], 1)


def w_idle(wid: int, ready: Callable[..., None], go_evt: Any, port: int, n: int,
           seconds: float, spread: bool) -> dict[str, Any]:
    """Open n connections (CONNECT/CONNACK each) with up to 512 handshakes in flight,
    from source addresses 127.(wid+1).x.y when `spread`; keep them open until released."""
    ready()
    t0 = _await_go(go_evt)
    deadline = t0 + seconds
    sel = selectors.DefaultSelector()
    pkt = {i: connect_packet(f"idle-{wid}-{i}") for i in range(n)}
    done: list[socket.socket] = []
    failed = 0
    first_error = ""
    started = 0
    pending = 0
    last_report = t0
    t_last = t0
    while (started < n or pending) and time.monotonic() < deadline:
        while started < n and pending < 512:
            src = f"127.{wid + 1}.{started // 250 % 250}.{started % 250 + 1}" if spread else None
            try:
                s = nb_connect(port, src)
            except OSError as exc:
                failed += 1
                first_error = first_error or str(exc)
                started += 1
                continue
            sel.register(s, selectors.EVENT_WRITE, started)
            started += 1
            pending += 1
        for key, ev in sel.select(timeout=0.2):
            s = key.fileobj  # type: ignore[assignment]
            try:
                if ev & selectors.EVENT_WRITE:
                    err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if err:
                        raise OSError(err, os.strerror(err))
                    s.send(pkt.pop(key.data))
                    sel.modify(s, selectors.EVENT_READ, key.data)
                    continue
                data = s.recv(16)
                if data[:2] != b"\x20\x02" or data[3:4] != b"\x00":
                    raise OSError(f"no CONNACK: {data!r}")
                sel.unregister(s)
                done.append(s)
                t_last = time.monotonic()
            except OSError as exc:
                failed += 1
                first_error = first_error or str(exc)
                sel.unregister(s)
                s.close()
            pending -= 1
        if time.monotonic() - last_report > 2:
            progress(f"  idle w{wid}: {len(done)}/{n} connected")
            last_report = time.monotonic()
    # Each worker holds its sockets in this process until the parent releases it.
    globals()["_held"] = done
    return {"connected": len(done), "failed": failed, "error": first_error,
            "t_start": t0, "t_last": t_last}


def sc_idle(b: Broker, size: dict[str, Any]) -> dict[str, Any]:
    """Idle connections: broker RSS growth per connection and the connect rate."""
    n = wanted = size["idle_conns"]
    # The broker inherits our RLIMIT_NOFILE: beyond it, connections fail on its side.
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    n = min(n, limit - 1000)
    workers = CORES
    crew = Crew()
    try:
        for w in range(workers):
            crew.add(w_idle, b.port, n // workers + (1 if w < n % workers else 0),
                     size["idle_seconds"], n > 5000)
        crew.start(setup_timeout=30)
        time.sleep(1.0)  # a freshly started broker settles first
        before = rss_kb(b.pid)
        overflows = listen_overflows()
        crew.go()
        res = crew.results(size["idle_seconds"] + 30)
        time.sleep(2.0)  # let lazily allocated per-connection state land
        after = rss_kb(b.pid)
    finally:
        crew.close()
    connected = sum(r["connected"] for r in res)
    span = max(r["t_last"] for r in res) - min(r["t_start"] for r in res)
    out: dict[str, Any] = {
        "connected": connected, "expected": n,
        "listen_overflows": listen_overflows() - overflows,
        "kb_per_conn": round((after - before) / connected, 2) if connected else None,
        "connects_per_s": round(connected / span) if connected and span > 0 else None,
        "notes": f"{connected}/{n} connections, RSS {before} -> {after} kB"}
    if n < wanted:
        out["notes"] += (f"; capped from {wanted} by RLIMIT_NOFILE {limit} (raising the hard "
                         "limit needs CAP_SYS_RESOURCE)")
    if errors := [r["error"] for r in res if r["error"]]:
        out["notes"] += f"; {sum(r['failed'] for r in res)} failed: {errors[0]}"
    if not connected:
        out["error"] = "no connection succeeded"
    return out


def w_storm(wid: int, ready: Callable[..., None], go_evt: Any, port: int, ids: list[str],
            m: int, seconds: float) -> dict[str, Any]:
    """Persistent sessions: subscribe and leave; on go, all reconnect at once and PUBACK
    their queued messages until each has m of them."""
    setup_deadline = time.monotonic() + 120
    for cid in ids:
        s = connect(port, cid, clean=False)
        subscribe(s, "storm/+/cmd", 1)
        s.sendall(mqtt.encode(mqtt.Disconnect(), 4))
        s.close()
        if time.monotonic() > setup_deadline:
            raise TimeoutError("session set-up too slow")
    ready()
    t0 = _await_go(go_evt)
    deadline = t0 + seconds
    sel = selectors.DefaultSelector()
    got: dict[socket.socket, int] = {}
    rest: dict[socket.socket, bytes] = {}
    pkt: dict[socket.socket, bytes] = {}
    for i, cid in enumerate(ids):
        s = nb_connect(port, f"127.{wid + 1}.{i // 250 % 250}.{i % 250 + 1}")
        sel.register(s, selectors.EVENT_WRITE)
        got[s], rest[s], pkt[s] = 0, b"", connect_packet(cid, clean=False)
    connacks = complete = 0
    t_connacks = t_done = t0
    errors = 0
    while complete < len(ids) and time.monotonic() < deadline:
        for key, ev in sel.select(timeout=0.2):
            s = key.fileobj  # type: ignore[assignment]
            try:
                if ev & selectors.EVENT_WRITE:
                    s.send(pkt[s])
                    sel.modify(s, selectors.EVENT_READ)
                    continue
                data = s.recv(1 << 16)
                if not data:
                    raise ConnectionError("closed")
            except OSError:
                errors += 1
                sel.unregister(s)
                continue
            buf = rest[s] + data
            _, frames, used = split_frames(buf, True)
            rest[s] = buf[used:]
            acks = []
            for b0, body in frames:
                if b0 >> 4 == 2:
                    connacks += 1
                    t_connacks = time.monotonic()
                elif b0 >> 4 == 3:
                    got[s] += 1
                    if got[s] == m:
                        complete += 1
                        t_done = time.monotonic()
                    pid = publish_fields(b0, body)[0]
                    if pid:
                        acks.append(puback(pid))
            if acks:
                s.setblocking(True)
                s.sendall(b"".join(acks))
                s.setblocking(False)
    for s in got:
        s.close()
    return {"connacks": connacks, "complete": complete, "received": sum(got.values()),
            "t0": t0, "t_connacks": t_connacks, "t_done": t_done, "errors": errors}


def sc_reconnect_storm(b: Broker, size: dict[str, Any]) -> dict[str, Any]:
    """K persistent sessions (QoS 1 on storm/+/cmd) go offline; M messages are published
    (the first half retained), so each session has M queued; then all K reconnect at
    once: connects/s until the last CONNACK, msgs/s until every session has its M."""
    k, m = size["storm_clients"], size["storm_msgs"]
    crew = Crew()
    ids = [f"storm-{i}" for i in range(k)]
    try:
        for w in range(CORES):
            crew.add(w_storm, b.port, ids[w::CORES], m, size["seconds"])
        crew.start(setup_timeout=150)
        pub = connect(b.port, "storm-pub")
        pkts = [mqtt.encode_publish(f"storm/{j}/cmd", b"x" * PAYLOAD, 1, j < m // 2, False,
                                    j + 1, 4) for j in range(m)]
        pub.sendall(b"".join(pkts))
        acked, rest, deadline = 0, b"", time.monotonic() + 30
        while acked < m and time.monotonic() < deadline:
            n, rest = _acks_in(rest, pub.recv(65536))
            acked += n
        pub.close()
        time.sleep(0.5)  # queued for every offline session
        overflows = listen_overflows()
        crew.go()
        res = crew.results(size["seconds"] + 30)
    finally:
        crew.close()
    t0 = min(r["t0"] for r in res)
    connacks = sum(r["connacks"] for r in res)
    received = sum(r["received"] for r in res)
    complete = sum(r["complete"] for r in res)
    t_conn = max(r["t_connacks"] for r in res) - t0
    t_done = max(r["t_done"] for r in res) - t0
    out: dict[str, Any] = {
        "connects_per_s": round(connacks / t_conn) if connacks and t_conn > 0 else None,
        "msgs_per_s": round(received / t_done) if received and t_done > 0 else None,
        "received": received, "expected": k * m, "sessions_complete": complete,
        "listen_overflows": listen_overflows() - overflows,
        "notes": f"{k} sessions x {m} queued messages ({m // 2} of them retained); "
                 f"all CONNACKed after {t_conn:.2f} s, {complete}/{k} complete after "
                 f"{t_done:.2f} s"}
    if not received:
        out["error"] = f"nothing delivered ({connacks}/{k} CONNACKs)"
    return out


# name: (function, main figure, higher is better)
SCENARIOS: dict[str, tuple[Callable[[Broker, dict[str, Any]], dict[str, Any]], str, bool]] = {
    "qos0_1to1": (sc_qos0, "msgs_per_s", True),
    "qos1_1to1": (sc_qos1, "msgs_per_s", True),
    "fanin_100to1": (sc_fanin, "msgs_per_s", True),
    "fanout_1to1000": (sc_fanout, "msgs_per_s", True),
    "idle_conns": (sc_idle, "kb_per_conn", False),
    "latency_fixed_rate": (sc_latency, "p99_ms", False),
    "cpu_at_rate": (sc_cpu_at_rate, "cpu_us_per_msg", False),
    "cpu_at_rate_qos1": (sc_cpu_at_rate_qos1, "cpu_us_per_msg", False),
    "reconnect_storm": (sc_reconnect_storm, "msgs_per_s", True),
}
QUICK_SCENARIOS = [s for s in SCENARIOS if s != "reconnect_storm"]
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"msgs": 2000, "qos1_msgs": 1000, "seconds": 8, "fanout_subs": 10,
             "fanout_msgs": 50, "idle_conns": 100, "idle_seconds": 10, "latency_rate": 200,
             "latency_seconds": 1, "storm_clients": 10, "storm_msgs": 4, "cpu_rate": 200,
             "cpu_seconds": 1},
    "quick": {"msgs": 100_000, "qos1_msgs": 25_000, "seconds": 15, "fanout_subs": 200,
              "fanout_msgs": 500, "idle_conns": 2000, "idle_seconds": 30,
              "latency_rate": 2000, "latency_seconds": 5, "storm_clients": 500,
              "storm_msgs": 10, "cpu_rate": 2000, "cpu_seconds": 5},
    "full": {"msgs": 500_000, "qos1_msgs": 100_000, "seconds": 45, "fanout_subs": 1000,
             "fanout_msgs": 1000, "idle_conns": 100_000, "idle_seconds": 120,
             "latency_rate": 20_000, "latency_seconds": 10, "storm_clients": 5000,
             "storm_msgs": 20, "cpu_rate": 2000, "cpu_seconds": 10},
}
BROKERS = ["mosquitto", "lightgate-async", "lightgate-sync", "lightgate-separated", "amqtt"]


# -- profiling --------------------------------------------------------------------------
def profile_start(b: Broker, out_dir: Path, tag: str) -> tuple[subprocess.Popen[Any], Path]:
    raw = out_dir / f"{tag}.collapsed"
    spy = Path(sys.executable).with_name("py-spy")
    p = subprocess.Popen([str(spy) if spy.exists() else "py-spy", "record", "--pid",
                          str(b.pid), "--format", "raw", "--rate", "250", "-o", str(raw)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return p, raw


def profile_stop(p: subprocess.Popen[Any], raw: Path, top: int = 15) -> list[str]:
    """Stop py-spy and list the functions with the most self time (leaf frames)."""
    p.send_signal(signal.SIGINT)
    try:
        p.wait(30)
    except subprocess.TimeoutExpired:
        p.kill()
    if not raw.exists():
        return ["py-spy wrote nothing (ptrace not permitted?)"]
    self_time: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        leaf = stack.rsplit(";", 1)[-1]
        func, _, loc = leaf.partition(" (")
        self_time[f"{func} ({loc.rsplit(':', 1)[0]})"] += int(n)
        total += int(n)
    lines = [f"{100 * n / total:5.1f}% {f}" for f, n in self_time.most_common(top)]
    raw.with_suffix(".top.txt").write_text("\n".join(lines) + "\n")
    return lines


# -- output -----------------------------------------------------------------------------
def plot(rows: list[dict[str, Any]], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress("matplotlib missing: no plots")
        return
    for scenario, (_, figure, higher) in SCENARIOS.items():
        mine = [r for r in rows if r["scenario"] == scenario]
        if not mine:  # a chart from an earlier run would not match latest.json
            (out / f"{scenario}.png").unlink(missing_ok=True)
            continue
        fig, ax = plt.subplots(figsize=(8, 4))
        values = [r.get(figure) or 0 for r in mine]
        colors = ["#888888" if r["broker"] == "mosquitto" else
                  "#d9534f" if r.get("error") else "#2b7de9" for r in mine]
        bars = ax.bar([r["broker"] for r in mine], values, color=colors)
        for bar, r in zip(bars, mine, strict=True):
            ratio = r.get("ratio_vs_mosquitto")
            text = ("error" if r.get(figure) is None else
                    f"{r[figure]:,.6g}\n{ratio:.2f}x mosquitto" if ratio is not None else
                    f"{r[figure]:,.6g}")
            if r.get("expected") and (r.get("received") or 0) < r["expected"]:
                text += f"\n({(r.get('received') or 0) / r['expected']:.0%} delivered)"
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=9)
        ax.set_ylim(0, max(values + [1]) * 1.25)
        ax.set_ylabel(figure)
        ax.set_title(f"{scenario}: {figure} ({'higher' if higher else 'lower'} is better)")
        ax.tick_params(axis="x", labelsize=9)
        fig.tight_layout()
        fig.savefig(out / f"{scenario}.png", dpi=100)
        plt.close(fig)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'scenario':<20} {'broker':<20} {'main figure':>22} {'vs mosquitto':>12} "
             f"{'CPU us/msg':>10}"]
    for r in rows:
        figure = SCENARIOS[r["scenario"]][1]
        value = r.get(figure)
        ratio = r.get("ratio_vs_mosquitto")
        shown = f"{figure}={value}" if value is not None else f"error: {r.get('error', '?')}"
        cpu = r.get("cpu_us_per_msg")
        lines.append(f"{r['scenario']:<20} {r['broker']:<20} {shown[:60]:>22} "
                     f"{(f'{ratio:.3f}x' if ratio is not None else '-'):>12} "
                     f"{(f'{cpu:.1f}' if cpu is not None else '-'):>10}")
    return "\n".join(lines)


def run_one(scenario: str, name: str, size: dict[str, Any],
            profile_dir: Path | None) -> dict[str, Any]:
    fn, figure, higher = SCENARIOS[scenario]
    row: dict[str, Any] = {"scenario": scenario, "broker": name, **dict.fromkeys(FIELDS),
                           "ratio_vs_mosquitto": None, "higher_is_better": higher,
                           "main_figure": figure}
    t0 = time.monotonic()
    broker = None
    prof = None
    try:
        row["load_1m_before"] = os.getloadavg()[0]  # other work on the machine skews results
        broker = start_broker(name)
        if profile_dir and name.startswith("lightgate"):
            prof = profile_start(broker, profile_dir, f"{scenario}-{name}")
        pids = [p.pid for p in broker.procs]
        cpu0, threads0, t1 = cpu_seconds(pids), thread_times(pids), time.monotonic()
        row.update(fn(broker, size))
        cpu = cpu_seconds(pids) - cpu0
        if row.get("received"):
            row["cpu_us_per_msg"] = round(cpu * 1e6 / row["received"], 2)
            row["threads"] = thread_report(threads0, thread_times(pids), row["received"],
                                           time.monotonic() - t1)
        if err := broker.died():
            row["error"] = err
    except Exception as exc:  # record it; the other brokers and scenarios still run
        row["error"] = f"{type(exc).__name__}: {exc}"[:1000]
    finally:
        if prof:
            row["profile_top"] = profile_stop(*prof)[:10]
        if broker:
            broker.stop()
    row["duration_s"] = round(time.monotonic() - t0, 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="every scenario but reconnect_storm, small (~6 min)")
    parser.add_argument("--tiny", action="store_true", help="a smoke run for the tests")
    parser.add_argument("--brokers", default=",".join(BROKERS),
                        help=f"comma-separated subset of {','.join(BROKERS)}")
    parser.add_argument("--scenarios", default=None,
                        help=f"comma-separated subset of {','.join(SCENARIOS)}")
    parser.add_argument("--out", default=str(RESULTS), help="where latest.json and PNGs go")
    parser.add_argument("--profile", metavar="DIR", default=None,
                        help="py-spy record each Lightgate broker; top self time per row")
    args = parser.parse_args()
    size = SIZES["tiny" if args.tiny else "quick" if args.quick else "full"]
    scenarios = (args.scenarios.split(",") if args.scenarios else
                 QUICK_SCENARIOS if args.quick or args.tiny else list(SCENARIOS))
    brokers = args.brokers.split(",")
    if bad := [s for s in scenarios if s not in SCENARIOS] + [b for b in brokers
                                                             if b not in BROKERS]:
        parser.error(f"unknown scenario or broker: {', '.join(bad)}")
    nofile = raise_nofile(2 * size["idle_conns"] + 10_000)
    profile_dir = Path(args.profile) if args.profile else None
    if profile_dir:
        profile_dir.mkdir(parents=True, exist_ok=True)
    progress(f"{len(scenarios)} scenarios x {len(brokers)} brokers, {CORES} cores, "
             f"RLIMIT_NOFILE {nofile}, load {os.getloadavg()[0]:.2f}")
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    for scenario in scenarios:
        figure = SCENARIOS[scenario][1]
        mine = []
        for name in brokers:
            progress(f"{scenario} on {name}")
            row = run_one(scenario, name, size, profile_dir)
            mine.append(row)
            progress(f"  -> {figure}={row.get(figure)} in {row['duration_s']} s "
                     f"{row.get('error', '')}")
        base = next((r for r in mine if r["broker"] == "mosquitto" and r.get(figure)), None)
        for r in mine:
            if base and r.get(figure) is not None:
                r["ratio_vs_mosquitto"] = round(r[figure] / base[figure], 3)
        rows.extend(mine)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "latest.json").write_text(json.dumps(rows, indent=2) + "\n")
    plot(rows, out)
    progress(f"done in {time.monotonic() - started:.0f} s\n{table(rows)}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
