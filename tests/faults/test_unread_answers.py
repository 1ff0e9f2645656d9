"""Clients that send requests and do not read the answers, against a real `lightgate
serve`: what waits for a connection's socket is bounded (past its high-water mark the
connection is not read), a client that reads a trickle is disconnected as one that reads
nothing, and a well-behaved client keeps its latency meanwhile.

Without the bound, a flood of SUBSCRIBEs (19 bytes in, a 200-byte SUBACK out) grew the
server by about 9 MiB a second, and reading a little now and then kept it growing. (The
clients that read a little, and the PINGREQ flood: test_unread_answers_trickle.py, so
that the two files' floods run side by side.)"""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path
from typing import Any

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
from tests.security.test_tls import make_pki, tls_args

ATTACK_S = 12.0
# What the server may grow by during an attack: a connection's answers up to the
# high-water mark (2 MiB), the allocator's slack, the probe's messages in the store.
BOUND = 24 * MiB
# A SUBSCRIBE to a replay whose since is not a time: refused with a reason string.
SUBSCRIBE = mqtt.encode(mqtt.Subscribe(1, [("$replay/x/a", mqtt.SubscriptionOptions(0))]), 5)
PINGREQ = mqtt.encode(mqtt.Pingreq(), 5)


def _server(tmp_path: Path, transport: str, *extra: str) -> Server:
    if transport != "tls":
        return Server(tmp_path, *extra).start()
    pki = make_pki(tmp_path / "pki")
    return Server(tmp_path / "data", *tls_args(pki), *extra).start()


def _port(srv: Server, transport: str) -> int:
    name = {"tcp": "mqtt", "ws": "ws", "tls": "mqtt_tls"}[transport]
    return int(srv.addrs[name].rsplit(":", 1)[1])


def _attack(srv: Server, packet: bytes, read_every: float = 0.0, read_bytes: int = 0,
            seconds: float = ATTACK_S, transport: str = "tcp") -> tuple[int, dict[str, Any]]:
    """Flood with `packet` over `transport` while a well-behaved client (plain TCP)
    measures its round trips; the server's RSS growth and what the attacker saw."""
    probe = Probe(srv.port)
    try:
        baseline = probe.measure(2.0)
        base = rss(srv.proc.pid)
        peak = RssPeak(srv.proc.pid)
        ctx = multiprocessing.get_context("fork")
        out = ctx.Queue()
        attacker = ctx.Process(target=flood, args=(_port(srv, transport), packet, seconds,
                                                   read_every, read_bytes, out, transport),
                               daemon=True)
        probe.start()
        attacker.start()
        # What waits for sockets, as /metrics says while the attack runs.
        unsent = 0.0
        while out.empty() and attacker.is_alive():
            unsent = max(unsent, metric(metrics(srv), "lightgate_budget_used",
                                        "unsent_bytes"))
            time.sleep(0.5)
        seen = out.get(timeout=seconds + 30)
        seen["unsent_peak"] = unsent
        attacker.join(10)
        during = probe.stop()
        grown = peak.stop() - base
    finally:
        probe.close()
    print(f"attack over {transport}: {seen}; RSS +{grown / MiB:.1f} MiB (base "
          f"{base / MiB:.0f} MiB); well-behaved client: baseline {baseline}, during {during}")
    assert_unharmed(baseline, during)
    return grown, seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["tcp", "ws", "tls"])
def test_a_subscribe_flood_that_reads_nothing_is_not_read(tmp_path: Path,
                                                          transport: str) -> None:
    srv = _server(tmp_path, transport)
    try:
        grown, seen = _attack(srv, SUBSCRIBE, transport=transport)
        assert grown < BOUND
        text = metrics(srv)  # held at the mark, with what waits for it counted
        assert metric(text, "lightgate_budget_refusals_total", "unsent_bytes_held") >= 1
        # At the mark: 2 MiB counting 64 bytes a packet, 1.5 MiB of ~200-byte SUBACKs.
        assert MiB < seen["unsent_peak"] <= 2 * MiB
        assert metric(text, "lightgate_budget_limit", "unsent_bytes") == 2 * MiB
    finally:
        srv.stop()
