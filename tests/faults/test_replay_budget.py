"""Replay subscriptions that read nothing, against a real `lightgate serve`: the history
the gateway reads for them stays within --max-replay-bytes-per-client and
--max-replay-bytes, a well-behaved client keeps its latency meanwhile, and a replay of a
client that reads goes on while the budgets are spent.

Without the budgets each replay subscription held its first batch (up to 4 MiB) from
SUBSCRIBE on: one client with 200 of them grew the server by over 800 MiB."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from gateway import mqtt
from tests.conftest import Server
from tests.faults.hostile import (
    MiB,
    Probe,
    RssPeak,
    assert_unharmed,
    flood,
    metric,
    metrics,
    rss,
)
from tests.mqtt.paho_client import Client

LEVELS = ["big", "1", "2", "3", "4", "5", "6", "7"]
TOPIC = "/".join(LEVELS)
MESSAGES, PAYLOAD = 256, 16 * 1024  # a first batch's worth: 256 messages, 4 MiB
ATTACK_S = 8.0


def _filters(n: int) -> list[str]:
    """`n` distinct filters that all match TOPIC: any of its levels may be a `+`."""
    return ["/".join("+" if mask >> i & 1 else level for i, level in enumerate(LEVELS))
            for mask in range(n)]


def _subscribes(filters: list[str]) -> bytes:
    return b"".join(mqtt.encode(mqtt.Subscribe(i + 1, [(f"$replay/earliest/{f}",
                                                        mqtt.SubscriptionOptions(1))]), 5)
                    for i, f in enumerate(filters))


def _store_history(srv: Server) -> None:
    pub = Client(srv.port, "history", version=5)
    for i in range(MESSAGES):
        pub.publish(TOPIC, b"%06d" % i + os.urandom(PAYLOAD - 6), 1)
    pub.disconnect()


def _attack(srv: Server, packets: list[bytes]) -> int:
    """One attacker per entry of `packets`, each sending its SUBSCRIBEs and then reading
    nothing for ATTACK_S (with a Receive Maximum of 1: its one unacknowledged
    QoS 1 message holds every replay, so that its answers stay small), while a
    well-behaved client measures its round trips; the server's RSS growth and the replay
    budget's peak."""
    probe = Probe(srv.port)
    try:
        baseline = probe.measure(2.0)
        base = rss(srv.proc.pid)
        peak = RssPeak(srv.proc.pid)
        ctx = multiprocessing.get_context("fork")
        out = ctx.Queue()
        attackers = [ctx.Process(target=flood, args=(srv.port, p, ATTACK_S, 0.0, 0, out),
                                 kwargs={"properties": {"receive_maximum": 1},
                                         "repeat": False}, daemon=True)
                     for p in packets]
        probe.start()
        for a in attackers:
            a.start()
        for _ in attackers:
            out.get(timeout=ATTACK_S + 30)
        for a in attackers:
            a.join(10)
        during = probe.stop()
        grown = peak.stop() - base
    finally:
        probe.close()
    held = metric(metrics(srv), "lightgate_budget_peak", "replay_bytes")
    print(f"{len(packets)} attackers: RSS +{grown / MiB:.1f} MiB (base {base / MiB:.0f} MiB), "
          f"replay history held at most {held / MiB:.1f} MiB; well-behaved client: "
          f"baseline {baseline}, during {during}")
    assert_unharmed(baseline, during)
    return grown, held


@pytest.mark.timeout(180)
def test_one_client_with_200_replays_holds_its_budget(tmp_path: Path) -> None:
    srv = Server(tmp_path).start()  # defaults: 8 MiB a client, 256 MiB in all
    try:
        _store_history(srv)
        grown, held = _attack(srv, [_subscribes(_filters(200))])
        assert held <= 8 * MiB + 64 * 1024 + PAYLOAD + 2048
        assert grown < 48 * MiB  # 200 first batches held were 800 MiB
        assert metric(metrics(srv), "lightgate_budget_refusals_total",
                      "replay_reads_cut") >= 150
    finally:
        srv.stop()


@pytest.mark.timeout(180)
def test_many_clients_hold_the_nodes_budget_and_a_replay_goes_on(tmp_path: Path) -> None:
    srv = Server(tmp_path, "--max-replay-bytes", str(16 * MiB)).start()
    try:
        _store_history(srv)
        # 8 clients, 25 replays each: 8 MiB each by their own budgets, 16 MiB in all.
        filters = _filters(200)
        grown, held = _attack(srv, [_subscribes(filters[i::8]) for i in range(8)])
        assert held <= 16 * MiB + 8 * (64 * 1024 + PAYLOAD + 2048)
        assert grown < 48 * MiB
        # With the budgets spent by others, a client that reads gets its history.
        reader = Client(srv.port, "reader", version=5)
        reader.subscribe(f"$replay/earliest/{TOPIC}", 0)
        got = reader.expect(MESSAGES, timeout=60)
        assert [m.payload[:6] for m in got] == [b"%06d" % i for i in range(MESSAGES)]
        reader.disconnect()
    finally:
        srv.stop()
