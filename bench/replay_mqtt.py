"""MQTT replay benchmark: `$replay/<since>/<filter>` through a real gateway (`lightgate
serve`, one process) to raw-socket MQTT 3.1.1 clients in worker processes.

One run measures, on the same server:
- live_fanin: publishers (one connection each, QoS 0) storing 1M messages over 10,000
  topics `fleet/d<n>/temp`, delivered live to one `fleet/+/temp` subscriber: msg/s from
  its first delivery to its last, and the gateway's CPU µs per message (/proc);
- replay: one QoS 0 subscriber of `$replay/earliest/fleet/+/temp` receiving all 1M:
  msg/s from the first replayed message to the last [>= 200,000 and >= live_fanin],
  the gateway's CPU µs per message, and SUBSCRIBE -> first message;
- startup_ms: SUBSCRIBE -> first historical message of `$replay/<a time in the
  middle>/fleet/+/temp` (10,000 topic queues), median of several [<= 50 ms];
- live_beside_replay: a fan-in of its own (`live/+/temp`, 10,000 topics) alone, then
  while another 1M replay runs beside it: its msg/s both ways [slowdown <= 10 %], and a
  fixed-rate stream's latency alone and beside a replay.

    python bench/replay_bench.py --mqtt             # the full run (about 2 minutes)
    python bench/replay_bench.py --mqtt --quick     # 100k messages over 1,000 topics

Prints one JSON object (progress on stderr), also written to
bench/results/replay_mqtt_latest.json.
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from bench.mqtt.brokers import start_broker
from bench.mqtt.loadgen import Crew, _await_go, w_latency_pub, w_latency_sub, w_subscribers
from bench.mqtt.procfs import cpu_seconds
from bench.mqtt.wire import _recv_until, connect, split_frames
from gateway import mqtt

PAYLOAD = b'{"temp": 21.5, "unit": "C", "ok": true, "seq": 0000000}'  # 56 bytes
PUBLISHERS = 4


def progress(text: str) -> None:
    print(f"[replay_mqtt {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


# -- worker processes ----------------------------------------------------------------------
def w_fanin(wid: int, ready: Callable[..., None], go_evt: Any, port: int, topics: list[str],
            total: int, seconds: float, delay: float = 0.0) -> dict[str, Any]:
    """One connection publishing `total` QoS 0 messages round robin over `topics` (a
    pre-encoded cycle written again and again), `delay` seconds after go, then a QoS 1
    one: its PUBACK says the gateway took everything before it."""
    s = connect(port, f"fanin-{wid}-{os.getpid()}")
    pkts = [mqtt.encode_publish(t, PAYLOAD, 0, False, False, None, 4) for t in topics]
    cycle = b"".join(pkts)
    ready()
    deadline = _await_go(go_evt) + seconds
    time.sleep(delay)
    sent = 0
    while sent < total and time.monotonic() < deadline:
        n = min(len(pkts), total - sent)
        s.sendall(cycle if n == len(pkts) else b"".join(pkts[:n]))
        sent += n
    s.sendall(mqtt.encode_publish("bench/flush", b"", 1, False, False, 1, 4))
    _recv_until(s, mqtt.Puback, time.monotonic() + 60)
    s.close()
    return {"sent": sent}


def w_replayer(wid: int, ready: Callable[..., None], go_evt: Any, port: int,
               topic_filter: str, expect: int, seconds: float) -> dict[str, Any]:
    """SUBSCRIBE to a replay (QoS 0) on go and count what comes: when it was asked, the
    first message, the last."""
    s = connect(port, f"replayer-{wid}-{os.getpid()}")
    ready()
    deadline = _await_go(go_evt) + seconds
    asked = time.monotonic()
    s.sendall(mqtt.encode(mqtt.Subscribe(1, [(topic_filter, mqtt.SubscriptionOptions(0))]), 4))
    s.settimeout(1.0)
    count, rest = 0, b""
    first = last = 0.0
    while count < expect and time.monotonic() < deadline:
        try:
            data = s.recv(1 << 20)
        except TimeoutError:
            if last and time.monotonic() - last > 5:
                break
            continue
        if not data:
            break
        buf = rest + data if rest else data
        n, _, used = split_frames(buf, False)
        rest = buf[used:]
        if n:
            last = time.monotonic()
            first = first or last
            count += n
    s.close()
    return {"count": count, "asked": asked, "first": first, "last": last}


# -- measurements ----------------------------------------------------------------------------
def fanin(port: int, prefix: str, topics: int, total: int, pid: int, seconds: float,
          beside: str | None = None, beside_expect: int = 0) -> dict[str, Any]:
    """`total` messages over `topics` topics to one `prefix/+/temp` subscriber: msg/s and
    the gateway's CPU per message; `beside`: a replay filter run at the same time."""
    names = [f"{prefix}/d{i}/temp" for i in range(topics)]
    crew = Crew()
    crew.add(w_subscribers, port, f"{prefix}/+/temp", 1, 0, total, seconds)
    per = total // PUBLISHERS
    for w in range(PUBLISHERS):  # beside a replay: once it is under way
        crew.add(w_fanin, port, names[w::PUBLISHERS], per, seconds, 0.0 if beside is None
                 else 1.0)
    if beside is not None:
        crew.add(w_replayer, port, beside, beside_expect, seconds)
    try:
        crew.start(setup_timeout=120)
        time.sleep(0.3)
        cpu0, wall0 = cpu_seconds([pid]), time.time()
        crew.go()
        res = crew.results(seconds + 90)
        cpu = cpu_seconds([pid]) - cpu0
    finally:
        crew.close()
    sub = res[0]
    span = sub["last"] - sub["first"]
    out: dict[str, Any] = {"received": sub["count"], "expected": per * PUBLISHERS,
                           "msgs_per_s": round(sub["count"] / span) if span > 0 else None,
                           "wall": [wall0, time.time()]}
    if beside is None:
        out["gateway_cpu_us_per_msg"] = round(cpu / max(1, sub["count"]) * 1e6, 2)
    else:
        out["replay"] = _replayed(res[-1])
    return out


def replay(port: int, topic_filter: str, expect: int, pid: int, seconds: float
           ) -> dict[str, Any]:
    crew = Crew()
    crew.add(w_replayer, port, topic_filter, expect, seconds)
    try:
        crew.start(setup_timeout=60)
        cpu0 = cpu_seconds([pid])
        crew.go()
        [res] = crew.results(seconds + 60)
        cpu = cpu_seconds([pid]) - cpu0
    finally:
        crew.close()
    out = _replayed(res)
    out["gateway_cpu_us_per_msg"] = round(cpu / max(1, res["count"]) * 1e6, 2)
    return out


def _replayed(res: dict[str, Any]) -> dict[str, Any]:
    span = res["last"] - res["first"]
    return {"received": res["count"],
            "msgs_per_s": round(res["count"] / span) if span > 0 else None,
            "first_message_ms": round((res["first"] - res["asked"]) * 1000, 2)
            if res["first"] else None}


def startup_ms(port: int, topic_filter: str, rounds: int) -> dict[str, float]:
    """SUBSCRIBE -> the first PUBLISH, a fresh connection each round (this process)."""
    took = []
    for i in range(rounds):
        s = connect(port, f"startup-{i}-{os.getpid()}")
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        s.sendall(mqtt.encode(mqtt.Subscribe(1, [(topic_filter, mqtt.SubscriptionOptions(0))]),
                              4))
        s.settimeout(30)
        buf = b""
        while not any(b0 >> 4 == 3 for b0, _ in split_frames(buf, True)[1]):
            data = s.recv(1 << 16)  # (frames split, not decoded: the time is the server's)
            if not data:
                raise ConnectionError("closed before the first replayed message")
            buf += data
        took.append((time.perf_counter() - t0) * 1000)
        s.close()
    return {"median": round(statistics.median(took), 2), "max": round(max(took), 2)}


def latency(port: int, rate: int, seconds: float, beside: str | None = None,
            beside_expect: int = 0) -> dict[str, Any]:
    """A stream at `rate` msg/s for `seconds` (QoS 0, one topic): its end-to-end latency,
    alone or beside a replay."""
    total = int(rate * seconds)
    crew = Crew()
    crew.add(w_latency_sub, port, total, total // 10, seconds + 30)
    crew.add(w_latency_pub, port, rate, total)
    if beside is not None:
        crew.add(w_replayer, port, beside, beside_expect, seconds + 60)
    try:
        crew.start(setup_timeout=60)
        time.sleep(0.3)
        crew.go()
        res = crew.results(seconds + 90)
    finally:
        crew.close()
    out = {k: res[0][k] for k in ("got", "p50_ms", "p99_ms", "max_ms")}
    if beside is not None:
        out["replay"] = _replayed(res[-1])
    return out


def run(messages: int, topics: int) -> dict[str, Any]:
    b = start_broker("lightgate-async")
    try:
        pid, port = b.pid, b.port
        secs = max(120.0, messages / 5000)
        out: dict[str, Any] = {"messages": messages, "topics": topics}
        progress(f"live fan-in: {messages:,} messages over {topics:,} topics")
        live = fanin(port, "fleet", topics, messages, pid, secs)
        out["live_fanin"] = {k: v for k, v in live.items() if k != "wall"}
        progress(f"live fan-in: {live['msgs_per_s']} msg/s")
        middle_ms = int(sum(live["wall"]) / 2 * 1000)
        time.sleep(1.0)  # the store settles (its last appends indexed)
        progress("replay of everything, alone")
        out["replay"] = replay(port, "$replay/earliest/fleet/+/temp", messages, pid, secs)
        progress(f"replay: {out['replay']['msgs_per_s']} msg/s")
        out["startup_ms"] = {
            "middle": startup_ms(port, f"$replay/{middle_ms}/fleet/+/temp", 10),
            "earliest": startup_ms(port, "$replay/earliest/fleet/+/temp", 10),
        }
        progress(f"start-up: {out['startup_ms']}")
        live_n = max(messages * 3 // 10, 10_000)
        progress(f"live fan-in of {live_n:,} alone, then beside a replay of {messages:,}")
        alone = fanin(port, "live", topics, live_n, pid, secs)
        beside = fanin(port, "live", topics, live_n, pid, secs,
                       beside="$replay/earliest/fleet/+/temp", beside_expect=messages)
        drop = 1 - beside["msgs_per_s"] / alone["msgs_per_s"]
        progress("fixed-rate stream's latency alone, then beside a replay")
        lat_alone = latency(port, 5000, 4.0)
        lat_beside = latency(port, 5000, 4.0, "$replay/earliest/fleet/+/temp", messages)
        out["live_beside_replay"] = {
            "fanin_alone_msgs_per_s": alone["msgs_per_s"],
            "fanin_beside_msgs_per_s": beside["msgs_per_s"],
            "slowdown_pct": round(drop * 100, 1),
            "replay_beside": beside["replay"],
            "stream_5000_per_s_alone": lat_alone,
            "stream_5000_per_s_beside": lat_beside,
        }
        rate = out["replay"]["msgs_per_s"] or 0
        out["goals"] = {
            "replay_msgs_per_s>=200000": rate >= 200_000,
            "replay>=live_fanin": rate >= (out["live_fanin"]["msgs_per_s"] or 0),
            "startup_ms<=50": out["startup_ms"]["middle"]["median"] <= 50,
            "live_slowdown<=10%": drop <= 0.10,
        }
        return out
    finally:
        b.stop()
