"""The load generator: worker processes (a Crew) with a common start signal, each holding
many client connections on non-blocking sockets and a selector: subscribers, bulk and
fixed-rate publishers (counting their PUBACKs), a latency sampler, idle connections, a
device fleet on its own clock and a reconnect storm. Every loop is bounded in messages
and in seconds."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import selectors
import signal
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

from gateway import mqtt

from . import PAYLOAD, progress
from .wire import (
    acks_in,
    connect,
    connect_packet,
    dial,
    handshake,
    handshaking,
    nb_connect,
    puback,
    publish_fields,
    read_acks,
    recv_batch,
    split_frames,
    subscribe,
)

STAMP = struct.Struct(">qI")  # send time (perf_counter_ns, system-wide monotonic), seq

# The CPU seconds the workers of metered Crews spent from their start signal to their
# result, summed in the parent (the runner's `loadgen_cpu_us_per_msg`).
_loadgen_cpu = 0.0


def loadgen_cpu() -> float:
    return _loadgen_cpu


class Crew:
    """Worker processes with a common start signal, results over one queue, and a bound
    on everything: setup, run, and the kill of whatever is left at the end."""

    def __init__(self, metered: bool = True) -> None:
        self.metered = metered  # False: set-up work (e.g. filling a queue), not the row's
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
        global _loadgen_cpu
        res = self._get("result", len(self.procs), timeout)
        if self.metered:
            _loadgen_cpu += sum(r.pop("cpu_s", 0.0) for r in res)
        return res

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
        res["cpu_s"] = time.process_time() - _cpu_at_go if _cpu_at_go else 0.0
        q.put(("result", wid, res))
        release.wait(600)  # e.g. idle connections stay open until RSS was measured
    except BaseException as exc:
        q.put(("error", wid, f"{type(exc).__name__}: {exc}"))


_cpu_at_go = 0.0  # this worker's CPU time when its start signal came


def _await_go(go_evt: Any) -> float:
    global _cpu_at_go
    if not go_evt.wait(300):
        raise TimeoutError("no start signal")
    _cpu_at_go = time.process_time()
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
                data = recv_batch(s, 1 << 20)  # type: ignore[arg-type]
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
                    data = recv_batch(s, 65536)
                except TimeoutError:
                    continue
                acked, rest = acks_in(rest, data)
                inflight -= acked
                done += acked
            sent += done
    # Stay connected until the subscribers are done: a broker may drop what it has not
    # processed yet when the publisher goes away.
    globals()["_held"] = socks
    return {"sent": sent}


def port_of(ports: int | list[int], i: int) -> int:
    """Device i's port: devices spread over a broker's gateways in turn."""
    return ports if isinstance(ports, int) else ports[i % len(ports)]


def w_devices(wid: int, ready: Callable[..., None], go_evt: Any, port: int | list[int],
              topics: list[str], per_device: int, seconds: float) -> dict[str, Any]:
    """Devices as a fleet publishes: one connection per topic (over the ports in turn),
    each sending a QoS 1 PUBLISH and waiting for its PUBACK before the next (one message
    in flight each), all at once from one selector. Reports the PUBLISH -> PUBACK round
    trips (ack_*_ms) from each device's second message on, as this loop sees them."""
    socks = [connect(port_of(port, i), f"dev-{wid}-{i}-{os.getpid()}")
             for i in range(len(topics))]
    payload = b"x" * PAYLOAD
    pkts = {s: [mqtt.encode_publish(t, payload, 1, False, False, pid, 4) for pid in (1, 2)]
            for s, t in zip(socks, topics, strict=True)}
    sel = selectors.DefaultSelector()
    sent: dict[socket.socket, int] = {}
    rest: dict[socket.socket, bytes] = {}
    sent_at: dict[socket.socket, int] = {}  # perf_counter_ns of the message in flight
    rtts: list[int] = []
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
        sent[s], rest[s] = 0, b""
    ready()
    t0 = _await_go(go_evt)
    deadline = t0 + seconds
    for s in socks:
        s.send(pkts[s][0])
        sent[s] = 1
    acked = 0
    total = per_device * len(socks)
    report = t0 + 2
    while acked < total and time.monotonic() < deadline:
        if time.monotonic() > report:
            progress(f"  devices w{wid}: {acked}/{total} acked")
            report = time.monotonic() + 2
        for key, _ in sel.select(timeout=0.2):
            s = key.fileobj  # type: ignore[assignment]
            try:
                data = recv_batch(s, 4096)
            except BlockingIOError:
                continue
            now = time.perf_counter_ns()
            n, rest[s] = acks_in(rest[s], data)
            acked += n
            if n and s in sent_at:
                rtts.append(now - sent_at[s])
            if n and sent[s] < per_device:
                sent_at[s] = time.perf_counter_ns()
                s.send(pkts[s][sent[s] % 2])  # the next one, now that this one is acked
                sent[s] += 1
    globals()["_held"] = socks  # connected until the subscriber is done (see w_publishers)
    return {"sent": sum(sent.values()), "acked": acked, **percentiles(rtts, "ack_")}


def percentiles(ns: list[int], prefix: str = "") -> dict[str, float | None]:
    """p50, p99 and the maximum of durations in ns, in ms (None for none)."""
    ns = sorted(ns)

    def pick(q: float) -> float | None:
        return round(ns[min(len(ns) - 1, int(len(ns) * q))] / 1e6, 3) if ns else None

    return {f"{prefix}p50_ms": pick(0.5), f"{prefix}p99_ms": pick(0.99),
            f"{prefix}max_ms": pick(1.0)}


def w_fleet(wid: int, ready: Callable[..., None], go_evt: Any, port: int | list[int],
            ids: list[int], fleet: int, period: float, per_device: int,
            seconds: float) -> dict[str, Any]:
    """Devices `ids` of a fleet of `fleet`, from one selector: they connect
    (at most 32 handshakes in flight) before ready(); after go, device g publishes QoS 1
    on fleet/g/t at go + period * (g / fleet + k), k < per_device (so the fleet offers
    fleet / period msg/s evenly spread), each message stamped with its send time and
    sent only once the device's previous one was PUBACKed (`late` counts those held).
    Returns the PUBLISH -> PUBACK round trips from each device's second message on
    (`ack_ns`, for the scenario to merge)."""
    sel = selectors.DefaultSelector()
    n = len(ids)
    socks: list[socket.socket] = []  # device j of this worker: fleet device ids[j]
    connected = 0
    setup_deadline = time.monotonic() + 120
    while connected < n:
        if time.monotonic() > setup_deadline:
            raise TimeoutError(f"{connected}/{n} devices connected in 120 s")
        while len(socks) < n and len(socks) - connected < 32:
            g = ids[len(socks)]
            socks.append(nb_connect(port_of(port, g),
                                    f"127.{wid + 1}.{g // 250 % 250}.{g % 250 + 1}"))
            sel.register(socks[-1], selectors.EVENT_WRITE, len(socks) - 1)
        for key, ev in sel.select(timeout=0.2):
            s, j = socks[key.data], key.data
            if ev & selectors.EVENT_WRITE or handshaking(s):
                try:
                    if want := handshake(s):  # TLS: its handshake goes on
                        sel.modify(s, want, j)
                        continue
                except OSError as exc:
                    raise OSError(f"device {ids[j]}: {exc}") from exc
                s.send(connect_packet(f"fleet-{ids[j]}"))
                sel.modify(s, selectors.EVENT_READ, j)
                continue
            try:
                data = recv_batch(s, 16)
            except BlockingIOError:  # TLS: a session ticket, no CONNACK yet
                continue
            if data[:2] != b"\x20\x02" or data[3:4] != b"\x00":
                raise OSError(f"device {ids[j]}: no CONNACK: {data!r}")
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connected += 1
    topics = [f"fleet/{g}/t" for g in ids]
    pad = b" " * (PAYLOAD - STAMP.size)
    ready({"connected": n})
    t0 = _await_go(go_evt)
    total = n * per_device
    phase = [t0 + period * g / fleet for g in ids]
    rest = [b""] * n
    sent_by = [0] * n
    inflight = [False] * n
    owed = [0] * n  # messages that fell due while the previous one was unacknowledged
    sent_at = [0] * n  # perf_counter_ns of each device's message in flight
    rtts: list[int] = []
    sent = acked = late = 0
    cursor = 0  # the next message due: device cursor % n, its number cursor // n

    def due(c: int) -> float:
        return phase[c % n] + period * (c // n)

    def send(j: int) -> None:
        nonlocal sent
        k = sent_by[j]
        sent_at[j] = time.perf_counter_ns()
        pkt = mqtt.encode_publish(topics[j], STAMP.pack(sent_at[j], k) + pad, 1,
                                  False, False, k % 65535 + 1, 4)
        if socks[j].send(pkt) != len(pkt):
            raise OSError(f"device {ids[j]}: short send")
        sent_by[j] += 1
        inflight[j] = True
        sent += 1

    hard_stop = t0 + seconds + 10
    report = t0 + 2
    while acked < total and time.monotonic() < hard_stop:
        now = time.monotonic()
        while cursor < total and due(cursor) <= now:
            j = cursor % n
            if inflight[j]:
                owed[j] += 1
                late += 1
            else:
                send(j)
            cursor += 1
        if now > report:
            progress(f"  fleet w{wid}: {sent}/{total} sent, {acked} acked, {late} late")
            report = now + 2
        wait = due(cursor) - now if cursor < total else 0.2
        for key, _ in sel.select(timeout=min(0.2, max(0.0, wait))):
            j = key.data
            try:
                data = recv_batch(socks[j], 4096)
            except BlockingIOError:
                continue
            got, rest[j] = acks_in(rest[j], data)
            if got:
                if sent_by[j] > 1:
                    rtts.append(time.perf_counter_ns() - sent_at[j])
                acked += got
                inflight[j] = False
                if owed[j]:
                    owed[j] -= 1
                    send(j)
    globals()["_held"] = socks  # connected until the subscriber is done (see w_publishers)
    return {"sent": sent, "acked": acked, "late": late, "ack_ns": rtts}


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
            acked, rest = read_acks(s, acked, rest)
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
        acked, rest = read_acks(s, acked, rest)
        time.sleep(0.001)
    globals()["_held"] = s  # connected until the subscriber is done (see w_publishers)
    return {"sent": sent, "acked": acked}


def w_latency_sub(wid: int, ready: Callable[..., None], go_evt: Any, port: int, total: int,
                  warmup: int, seconds: float, qos: int = 0,
                  topic_filter: str = "lat/t") -> dict[str, Any]:
    """A blocking reader on its own core, so the receive time is taken as data lands;
    QoS 1 deliveries are PUBACKed after each read."""
    s = connect(port, f"lat-sub-{os.getpid()}")
    subscribe(s, topic_filter, qos)
    s.settimeout(0.2)
    lat: list[int] = []
    got = 0
    rest = b""
    ready()
    deadline = _await_go(go_evt) + seconds + 5
    while got < total and time.monotonic() < deadline:
        try:
            data = recv_batch(s, 1 << 20)
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
    return {"got": got, "timed": len(lat), **percentiles(lat)}


def w_catchup(wid: int, ready: Callable[..., None], go_evt: Any, port: int, client_id: str,
              expect: int, seconds: float) -> dict[str, Any]:
    """A persistent session's subscriber coming back (clean session 0): connect on go,
    PUBACK every queued message as it comes until `expect` of them (or a deadline, or 10
    s of quiet). The CONNACK is read from the same stream: the messages may follow it in
    the same read."""
    ready()
    t0 = _await_go(go_evt)
    deadline = t0 + seconds
    s = dial(port)  # the TCP (and TLS) connect counts: the session starts with it
    s.sendall(connect_packet(client_id, clean=False))
    s.settimeout(0.2)
    got = 0
    rest = b""
    t_connack = t_first = t_last = 0.0
    present = None
    while got < expect and time.monotonic() < deadline:
        if time.monotonic() - (t_last or t_connack or t0) > 10:  # a broker gone quiet
            break
        try:
            data = recv_batch(s, 1 << 20)
        except TimeoutError:
            continue
        if not data:
            break
        now = time.monotonic()
        buf = rest + data
        _, frames, used = split_frames(buf, True)
        rest = buf[used:]
        acks = []
        for b0, body in frames:
            if b0 >> 4 == 2:  # CONNACK: session present, return code
                if body[1] != 0:
                    raise RuntimeError(f"CONNACK refused: {body[1]}")
                t_connack, present = now, bool(body[0] & 1)
            elif b0 >> 4 == 3:
                got += 1
                t_first = t_first or now
                t_last = now
                pid = publish_fields(b0, body)[0]
                if pid:
                    acks.append(puback(pid))
        if acks:
            s.sendall(b"".join(acks))
    s.close()

    def ms(t: float) -> float | None:
        return round((t - t0) * 1e3, 1) if t else None

    return {"got": got, "t0": t0, "t_last": t_last, "present": present,
            "connack_ms": ms(t_connack), "first_ms": ms(t_first)}


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
                if ev & selectors.EVENT_WRITE or handshaking(s):
                    if want := handshake(s):  # TLS: its handshake goes on
                        sel.modify(s, want, key.data)
                        continue
                    s.send(pkt.pop(key.data))
                    sel.modify(s, selectors.EVENT_READ, key.data)
                    continue
                try:
                    data = recv_batch(s, 16)
                except BlockingIOError:  # TLS: a session ticket, no CONNACK yet
                    continue
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
                if ev & selectors.EVENT_WRITE or handshaking(s):
                    if want := handshake(s):  # TLS: its handshake goes on
                        sel.modify(s, want)
                        continue
                    s.send(pkt[s])
                    sel.modify(s, selectors.EVENT_READ)
                    continue
                data = recv_batch(s, 1 << 16)
                if not data:
                    raise ConnectionError("closed")
            except BlockingIOError:  # TLS: a session ticket, no data yet
                continue
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
