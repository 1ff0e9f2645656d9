"""A store group under MQTT load: three `lightgate store` nodes with the embedded
controller, two gateways given all three addresses, QoS 1 publishers (paho, MQTT 5) on
both gateways and a persistent subscriber. The master is killed with SIGKILL at random
moments, round after round; each time a new master is elected within 10 s, publishing
resumes, the old master comes back as a replica (cutting any tail the group never
acknowledged) and catches up. At the end every PUBACKed message has been delivered and
the three CommitLogs are byte-identical.

LIGHTGATE_HA_ROUNDS sets the rounds (3 here; `make soak` runs more)."""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import RedisServer, Server
from tests.faults.persistent import assert_each_in_order
from tests.ha.cluster import Group, cluster, log_bytes, wait_for
from tests.ha.load import Publisher, collect, subscriber

ROUNDS = int(os.environ.get("LIGHTGATE_HA_ROUNDS", "3"))
FAILOVER_LIMIT_S = 10.0


def _run_group(tmp_path: Path, redis: RedisServer, mode: str, rounds: int,
               seed: int, steady_s: float = 1.0) -> dict:
    extra = ["--replication", mode, "--notify", redis.url]
    if mode == "sync":
        extra += ["--min-insync", "2"]
    g = Group(tmp_path, 3, *extra).start()
    gws: list[Server] = []
    stats: dict = {"rounds": []}
    try:
        m = g.master(20)
        wait_for(lambda: len(g.insync(m)) == 3, 15, "all three in sync")
        gws = [Server(None, "--store", g.addrs, "--notify", redis.url,
                      "--max-offline-messages", "10000000", command="gateway").start()
               for _ in range(2)]
        sub = subscriber(gws[1].port)
        sub.subscribe("ha/#", 1)
        pubs = [Publisher(gws[i % 2].port, f"p{i}") for i in range(4)]
        stop = threading.Event()
        threads = [threading.Thread(target=p.run, args=(stop,), daemon=True) for p in pubs]
        for t in threads:
            t.start()
        rng = random.Random(seed)
        delivered: list[bytes] = []
        t0 = time.monotonic()
        kills: list[float] = []
        for _ in range(rounds):
            time.sleep(rng.uniform(1.0, 3.0))
            m = g.master(5)
            epoch = cluster(g.nodes[m])["epoch"]
            acked_before = sum(len(p.acked) for p in pubs)
            g.nodes[m].kill()  # kill -9 at a random moment
            killed = time.monotonic()
            kills.append(killed)
            new = g.master(FAILOVER_LIMIT_S + 2)
            elected = time.monotonic() - killed
            assert new != m
            assert cluster(g.nodes[new])["epoch"] > epoch
            wait_for(lambda n=acked_before: sum(len(p.acked) for p in pubs) > n + 20, 20,
                     "publishing to resume")
            resumed = min(t for p in pubs for t in p.acked_at if t > killed) - killed
            g.nodes[m].start()  # the old master comes back: a replica now
            wait_for(lambda n=new: len(g.insync(n)) == 3, 20, "the old master back in sync")
            st = cluster(g.nodes[m])
            assert st["role"] == "replica"
            stats["rounds"].append({"killed": m, "new_master": new,
                                    "elected_s": round(elected, 2),
                                    "first_ack_after_s": round(resumed, 2),
                                    "old_master_cut_bytes": st["truncated_bytes"]})
            assert elected < FAILOVER_LIMIT_S, stats
        time.sleep(steady_s)
        stop.set()
        for t in threads:
            t.join(20)
        for p in pubs:
            assert not p.error, p.error
        m = g.master(5)
        wait_for(lambda: all(log_bytes(d) == log_bytes(g.dirs[m]) for d in g.dirs), 20,
                 "three byte-identical CommitLogs")
        delivered += collect(sub, 5.0)
        acked = [a for p in pubs for a in p.acked]
        lost = set(acked) - set(delivered)
        stats.update(acked=len(acked), delivered=len(delivered),
                     distinct_delivered=len(set(delivered)), lost=len(lost),
                     refused=sum(p.refused for p in pubs),
                     timeouts=sum(p.timeouts for p in pubs),
                     log_bytes=len(log_bytes(g.dirs[m])))
        lost_at = sorted(t for p in pubs for a, t in zip(p.acked, p.acked_at, strict=True)
                         if a in lost)
        stats["lost_acked_s_after_start"] = (
            [round(lost_at[0] - t0, 2), round(lost_at[-1] - t0, 2)] if lost_at else [])
        # How long before the nearest kill each lost message was acked (the loss window).
        stats["lost_acked_s_before_kill"] = [
            round(min((k - t for k in kills if k >= t), default=-1.0), 3) for t in lost_at]
        stats["kills_s_after_start"] = [round(k - t0, 2) for k in kills]
        assert_each_in_order(delivered, {p.name.encode() for p in pubs})
        sub.disconnect()
        return stats
    finally:
        dump = os.environ.get("LIGHTGATE_HA_DUMP")  # a directory for the nodes' logs
        if dump:
            for name, srv in [*((f"gateway{i}", s) for i, s in enumerate(gws)),
                              *((f"store{i}", s) for i, s in enumerate(g.nodes))]:
                Path(dump, name + ".log").write_text(srv.logs())
        for srv in gws:
            if srv.proc is not None:
                srv.kill()
        g.stop()


@pytest.fixture
def redis(redis_server: RedisServer) -> RedisServer:
    return redis_server


def test_sync_group_kill_master_three_times(tmp_path: Path, redis: RedisServer) -> None:
    stats = _run_group(tmp_path, redis, "sync", ROUNDS, seed=20)
    print("sync replication, min-insync 2:", stats)
    assert stats["acked"] > 100
    assert stats["lost"] == 0, stats
    assert all(r["elected_s"] < FAILOVER_LIMIT_S for r in stats["rounds"])


def test_async_group_loss_window_is_measured(tmp_path: Path, redis: RedisServer) -> None:
    """Async replication acks before any replica has the bytes: a master killed under
    load may take with it what it acked in the last moments, and a subscriber that read
    them may skip as many messages given their queue offsets after the failover.
    Measured, not hidden: the lost messages (if any) were acked just before the kill or
    are within that count, and the group still converges to one log."""
    stats = _run_group(tmp_path, redis, "async", 1, seed=7)
    print("async replication:", stats)
    assert stats["acked"] > 100
    # Whatever was lost was acked in the last moments before the kill (what the
    # replicas had not fetched yet), never earlier; the group converged (checked in
    # _run_group) and a new master was elected in time.
    before = [s for s in stats["lost_acked_s_before_kill"] if s >= 0]
    assert all(s <= 2.0 for s in before), stats
    # Async readers see what the master wrote before any replica holds it: a subscriber
    # that read the tail the failover cut skips as many of the messages that take its
    # queue offsets on the new master, never more (records here are over 100 bytes).
    after = len(stats["lost_acked_s_before_kill"]) - len(before)
    assert after <= stats["rounds"][0]["old_master_cut_bytes"] // 100, stats
    assert stats["rounds"][0]["elected_s"] < FAILOVER_LIMIT_S
