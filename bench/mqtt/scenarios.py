"""The scenarios: each one a function of a started broker and the sizes, returning the
row's figures; the registry (name -> function, main figure, which way is better) and the
tiny / quick / full sizes."""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from typing import Any

from gateway import mqtt

from . import CORES, PAYLOAD
from .brokers import MAX_QUEUED, Broker
from .loadgen import (
    Crew,
    percentiles,
    w_catchup,
    w_devices,
    w_fleet,
    w_idle,
    w_latency_pub,
    w_latency_sub,
    w_publishers,
    w_storm,
    w_subscribers,
)
from .procfs import listen_overflows, rss_kb, usage
from .wire import acks_in, connect, recv_batch, subscribe


def run_flow(port: int, pub_topics: list[str], sub_filter: str, n_subs: int, qos: int,
             count: int, seconds: float, window: int = 64) -> dict[str, Any]:
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
        crew.add(w_publishers, port, pub_topics, qos, per_topic, seconds, window)
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


def sc_qos0(b: Broker, size: dict[str, Any]) -> dict[str, Any]:
    return run_flow(b.port, ["bench/a"], "bench/a", 1, 0, size["msgs"], size["seconds"])


def sc_qos1(b: Broker, size: dict[str, Any]) -> dict[str, Any]:
    res = run_flow(b.port, ["bench/a"], "bench/a", 1, 1, size["qos1_msgs"], size["seconds"])
    res["notes"] = (res.get("notes", "") + "; publisher window 64 unacked").lstrip("; ")
    return res


def sc_qos1_deep(b: Broker, size: dict[str, Any]) -> dict[str, Any]:
    """QoS 1 with 1,000 unacknowledged at the publisher: the subscriber's window (32)
    fills and it falls behind the log for as long as the row lasts, so this is the row
    where a broker serves a subscriber from its backlog rather than as messages come."""
    res = run_flow(b.port, ["bench/deep"], "bench/deep", 1, 1, size["deep_msgs"],
                   size["seconds"] * 2, window=1000)
    res["notes"] = (res.get("notes", "") + "; publisher window 1,000 unacked").lstrip("; ")
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


def sc_device_fanin(b: Broker, size: dict[str, Any]) -> dict[str, Any]:
    """The load a fleet makes: 20 devices, each publishing QoS 1 and waiting for its
    PUBACK before the next (every message its own wake-up), one QoS 1 subscriber."""
    n = 20
    topics = [f"dev/{i}/t" for i in range(n)]
    per_device = size["device_msgs"] // n
    crew = Crew()
    try:
        crew.add(w_subscribers, b.port, "dev/+/t", 1, 1, per_device * n, size["seconds"])
        crew.add(w_devices, b.ports, topics, per_device, size["seconds"])
        crew.start(setup_timeout=60)
        time.sleep(0.3)
        crew.go()
        sub, dev = crew.results(size["seconds"] + 60)
    finally:
        crew.close()
    span = sub["last"] - sub["first"] if sub["first"] else 0.0
    out: dict[str, Any] = {"received": sub["count"], "expected": per_device * n,
                           "sent": dev["sent"], "acked": dev["acked"],
                           "msgs_per_s": round(sub["count"] / span) if span > 0 else None,
                           "ack_p50_ms": dev["ack_p50_ms"], "ack_p99_ms": dev["ack_p99_ms"],
                           "ack_max_ms": dev["ack_max_ms"],
                           "notes": f"{n} QoS 1 devices, one message in flight each, one "
                                    "QoS 1 subscriber; ack_*_ms: PUBLISH -> PUBACK from "
                                    "each device's second message on"}
    if not sub["count"]:
        out["error"] = "nothing delivered"
    return out


def sc_device_fleet(b: Broker, size: dict[str, Any]) -> dict[str, Any]:
    """A fleet at its own pace: N devices (spread over the load generator's processes),
    each publishing one QoS 1 message every `fleet_period` s and waiting for its PUBACK,
    one QoS 1 subscriber (the application) on fleet/+/t. The devices connect first and
    publish one round (a device's first message on its topic may cost a broker more
    than the next ones: first_round_cpu_us_per_msg); the broker's CPU per message (the
    main figure), latency and py-spy cover the `fleet_seconds` after that round."""
    wanted, period, seconds = size["fleet_devices"], size["fleet_period"], size["fleet_seconds"]
    # The broker inherits our RLIMIT_NOFILE: beyond it, connections fail on its side.
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    n = min(wanted, limit - 1000)
    per_device = 1 + round(seconds / period)  # the first round, then the timed ones
    total = n * per_device
    pids = [p.pid for p in b.procs]
    crew = Crew()
    try:
        # Latency from each device's second message on (a message's seq is its number).
        crew.add(w_latency_sub, b.port, total, 1, period + seconds, 1, "fleet/+/t")
        for w in range(CORES):  # interleaved: each process sends at the fleet's rate / CORES
            crew.add(w_fleet, b.ports, list(range(w, n, CORES)), n, period, per_device,
                     period + seconds)
        t_setup = time.monotonic()
        crew.start(setup_timeout=150)
        t_setup = time.monotonic() - t_setup
        time.sleep(1.0)  # the broker settles after the CONNECTs
        first = usage(pids)
        t_go = crew.go()
        # Round k of device g is due at go + period * (k + g / n): the timed rounds start
        # one period after go (the workers' go is a little later than ours, not earlier).
        time.sleep(max(0.0, t_go + period - time.monotonic()))
        timed = usage(pids)
        b.window.begin()
        sub, *devs = crew.results(period + seconds + 30)
        b.window.end()
    finally:
        crew.close()
    sent, acked = sum(d["sent"] for d in devs), sum(d["acked"] for d in devs)
    late = sum(d["late"] for d in devs)
    out: dict[str, Any] = {
        "received": sub["got"], "expected": total, "window_msgs": sub["timed"],
        "sent": sent, "acked": acked, "msgs_per_s": round(sub["timed"] / seconds),
        "p50_ms": sub["p50_ms"], "p99_ms": sub["p99_ms"], "max_ms": sub["max_ms"],
        **percentiles([ns for d in devs for ns in d["ack_ns"]], "ack_"),
        "late": late,
        "first_round_cpu_us_per_msg": round((timed.cpu - first.cpu) * 1e6 / n, 1),
        "notes": f"{n} QoS 1 devices x {per_device} messages, one every {period} s each "
                 f"({n / period:.0f} msg/s offered), one QoS 1 subscriber of fleet/+/t; "
                 f"connected in {t_setup:.1f} s, then one round, neither timed; then "
                 f"{seconds} s timed"}
    if b.opts.mutual:
        out["notes"] += ("; over mutual TLS: every device presents a client certificate "
                         "signed by the run's CA (one for the fleet), which the broker "
                         "verifies at each handshake")
    if n < wanted:
        out["notes"] += (f"; capped from {wanted} by RLIMIT_NOFILE {limit} (raising the hard "
                         "limit needs CAP_SYS_RESOURCE)")
    if late:
        out["notes"] += f"; {late} messages waited for their device's previous PUBACK"
    if sub["got"] < total:
        out["notes"] += f"; {total - sub['got']} not delivered within the deadline"
    if not sub["timed"]:
        out["error"] = "nothing delivered in the timed window"
    return out


def sc_catchup(b: Broker, size: dict[str, Any]) -> dict[str, Any]:
    """A persistent session catching up: its subscriber (clean session 0, QoS 1 on
    catchup/t) goes offline, `catchup_msgs` QoS 1 messages are published and
    acknowledged (not timed), then it connects again: msg/s from its CONNECT to the last
    queued message, each PUBACKed as it comes (the broker's window: 32 in flight)."""
    n, seconds = size["catchup_msgs"], size["catchup_seconds"]
    client_id = f"catchup-{time.monotonic_ns()}"
    s = connect(b.port, client_id, clean=False)
    subscribe(s, "catchup/t", 1)
    s.sendall(mqtt.encode(mqtt.Disconnect(), 4))
    s.close()
    time.sleep(0.3)  # the session is offline before the first message
    pub = Crew(metered=False)  # filling the queue is set-up, not the row's
    try:
        pub.add(w_publishers, b.port, ["catchup/t"], 1, n, seconds)
        pub.start(setup_timeout=60)
        t_pub = pub.go()
        [res] = pub.results(seconds + 30)
        t_pub = time.monotonic() - t_pub
    finally:
        pub.close()
    queued = res["sent"]  # every one acknowledged, so stored for the session
    time.sleep(0.5)
    crew = Crew()
    try:
        crew.add(w_catchup, b.port, client_id, queued, seconds)
        crew.start(setup_timeout=30)
        b.window.begin()
        crew.go()
        [sub] = crew.results(seconds + 30)
        b.window.end()
    finally:
        crew.close()
    span = sub["t_last"] - sub["t0"] if sub["got"] else 0.0
    out: dict[str, Any] = {
        "received": sub["got"], "expected": queued, "session_present": sub["present"],
        "msgs_per_s": round(sub["got"] / span) if span > 0 else None,
        "connack_ms": sub["connack_ms"], "first_ms": sub["first_ms"],
        "notes": f"{queued} QoS 1 messages queued for one offline persistent session "
                 f"(published in {t_pub:.2f} s, not timed), then it reconnects: from its "
                 f"CONNECT to the last one, each PUBACKed as it comes"}
    if queued < n:
        out["notes"] += f"; {n - queued} of {n} not acknowledged within {seconds} s"
    if sub["got"] < queued:
        out["notes"] += f"; {queued - sub['got']} not delivered within the deadline"
    if not sub["got"]:
        out["error"] = f"nothing delivered (session present: {sub['present']})"
    return out


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
            n, rest = acks_in(rest, recv_batch(pub, 65536))
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
    "qos1_deep": (sc_qos1_deep, "msgs_per_s", True),
    "fanin_100to1": (sc_fanin, "msgs_per_s", True),
    "device_fanin": (sc_device_fanin, "msgs_per_s", True),
    "device_fleet": (sc_device_fleet, "cpu_us_per_msg", False),
    "fanout_1to1000": (sc_fanout, "msgs_per_s", True),
    "idle_conns": (sc_idle, "kb_per_conn", False),
    "latency_fixed_rate": (sc_latency, "p99_ms", False),
    "cpu_at_rate": (sc_cpu_at_rate, "cpu_us_per_msg", False),
    "cpu_at_rate_qos1": (sc_cpu_at_rate_qos1, "cpu_us_per_msg", False),
    "reconnect_storm": (sc_reconnect_storm, "msgs_per_s", True),
    "catchup_persistent": (sc_catchup, "msgs_per_s", True),
    # device_fleet with every client presenting a certificate: always on TLS.
    "device_fleet_mtls": (sc_device_fleet, "cpu_us_per_msg", False),
}
# What a scenario needs of its broker beyond the shared bounds (brokers.Options' fields).
NEEDS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "device_fleet_mtls": lambda size: {"mutual": True},
    "catchup_persistent": lambda size: {"max_queued": max(MAX_QUEUED, size["catchup_msgs"])},
}
# Only in a run with --tls (or when asked for by name).
TLS_ONLY = ["device_fleet_mtls"]
QUICK_SCENARIOS = [s for s in SCENARIOS if s not in ("reconnect_storm", *TLS_ONLY)]
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"msgs": 2000, "qos1_msgs": 1000, "deep_msgs": 2000, "seconds": 8,
             "fanout_subs": 10,
             "fanout_msgs": 50, "idle_conns": 100, "idle_seconds": 10, "latency_rate": 200,
             "latency_seconds": 1, "storm_clients": 10, "storm_msgs": 4, "cpu_rate": 200,
             "cpu_seconds": 1, "device_msgs": 1000, "fleet_devices": 300, "fleet_period": 1.0,
             "fleet_seconds": 2, "catchup_msgs": 500, "catchup_seconds": 20},
    "quick": {"msgs": 100_000, "qos1_msgs": 25_000, "deep_msgs": 200_000, "seconds": 15,
              "fanout_subs": 200,
              "fanout_msgs": 500, "idle_conns": 2000, "idle_seconds": 30,
              "latency_rate": 2000, "latency_seconds": 5, "storm_clients": 500,
              "storm_msgs": 10, "cpu_rate": 2000, "cpu_seconds": 5, "device_msgs": 40_000,
              "fleet_devices": 5000, "fleet_period": 2.5, "fleet_seconds": 10,
              "catchup_msgs": 50_000, "catchup_seconds": 60},
    "full": {"msgs": 500_000, "qos1_msgs": 100_000, "deep_msgs": 1_000_000, "seconds": 45,
             "fanout_subs": 1000,
             "fanout_msgs": 1000, "idle_conns": 100_000, "idle_seconds": 120,
             "latency_rate": 20_000, "latency_seconds": 10, "storm_clients": 5000,
             "storm_msgs": 20, "cpu_rate": 2000, "cpu_seconds": 10, "device_msgs": 200_000,
             "fleet_devices": 5000, "fleet_period": 2.5, "fleet_seconds": 60,
             "catchup_msgs": 1_000_000, "catchup_seconds": 300},
}
