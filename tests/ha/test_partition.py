"""Store groups under partitions made outside the processes: each store node in a network
namespace of its own (tests.ha.netns), links cut with routes while QoS 1 publishers on two
gateways keep publishing and a persistent subscriber counts what arrives.

Each round cuts the master in one of these ways, holds the cut, heals it, and waits for
the group to be whole again (one master, the three nodes in the committed in-sync set):

- `isolated`: from every node and from the gateways,
- `raft`: from the controller only (replication and gateways still reach it),
- `one_replica`: from one replica only (Raft and replication),
- `raft_and_one`: from the controller and from one replica, the other replica still
  fetching from it (the case where a master without a lease could acknowledge writes
  that the next master cuts).

At the end: no acknowledged message lost, each publisher's messages in order, three
byte-identical CommitLogs, and no two nodes ever acknowledged writes at overlapping
times (their first-to-last acknowledgement spans per epoch, on this host's monotonic
clock). LIGHTGATE_PARTITION_ROUNDS sets the rounds (`make soak` runs 30, some after an
idle minute and some killing the master instead)."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import RedisServer, Server
from tests.faults.persistent import assert_each_in_order
from tests.ha import netns
from tests.ha.cluster import Group, cluster, log_bytes, wait_for
from tests.ha.load import Load, collect, overlapping_acks, subscriber

ROUNDS = int(os.environ.get("LIGHTGATE_PARTITION_ROUNDS", "4"))
CUTS = ("raft_and_one", "isolated", "raft", "one_replica")
SOAK_FAULTS = (*CUTS, "kill", "pause")
HOLD_S = 8.0  # a cut lasts this long: past the lease, the election and then some
IDLE_S = 61.0

@pytest.fixture
def net() -> Iterator[netns.Net]:
    netns.require()
    n = netns.Net(3).up()
    yield n
    n.down()


def _statuses(g: Group) -> dict[str, dict[str, Any]]:
    out = {}
    for node in g.nodes:
        st = cluster(node)
        out[st["node"]] = st
    return out


def _cut(net: netns.Net, kind: str, m: int, r1: int, r2: int) -> None:
    if kind == "isolated":
        net.isolate(m)
    elif kind == "raft":
        net.cut(m, r1, ("raft",))
        net.cut(m, r2, ("raft",))
    elif kind == "one_replica":
        net.cut(m, r2)
    elif kind == "raft_and_one":
        net.cut(m, r1, ("raft",))
        net.cut(m, r2)
    else:
        raise ValueError(kind)


def _whole(g: Group) -> int:
    """Wait until the group is whole: one master whose committed in-sync set has every
    node. Returns the master's index."""
    def whole() -> int | None:
        m = g.master(5)
        return m + 1 if len(g.insync(m)) == len(g.nodes) else None
    return int(wait_for(whole, 40, "the group whole again", step=0.25)) - 1


def _round(g: Group, net: netns.Net, load: Load, kind: str) -> dict[str, Any]:
    m = g.master(15)
    r1, r2 = [i for i in range(3) if i != m]
    epoch = cluster(g.nodes[m])["epoch"]
    t0 = time.monotonic()
    if kind == "kill":
        g.nodes[m].kill()
    elif kind == "pause":
        os.kill(g.nodes[m].proc.pid, signal.SIGSTOP)
    else:
        _cut(net, kind, m, r1, r2)
    out: dict[str, Any] = {"fault": kind, "master": m}
    if kind != "one_replica":  # the master loses its lease: another is elected
        new = wait_for(lambda: next((i + 1 for i in (r1, r2)
                                     if cluster(g.nodes[i])["role"] == "master"
                                     and cluster(g.nodes[i])["epoch"] > epoch), None),
                       15, "a new master") - 1
        out.update(new_master=new, elected_s=round(time.monotonic() - t0, 2))
    if kind not in ("kill", "pause"):
        fenced = wait_for(lambda: cluster(g.nodes[m])["role"] != "master"
                          or kind == "one_replica", 15, "the cut master to step down")
        out["old_master_role"] = cluster(g.nodes[m])["role"] if fenced else "master"
    time.sleep(max(0.0, t0 + HOLD_S - time.monotonic()))
    if kind == "kill":
        g.nodes[m].start()
    elif kind == "pause":
        os.kill(g.nodes[m].proc.pid, signal.SIGCONT)
    else:
        net.heal()
    healed = time.monotonic()
    master = _whole(g)
    first = load.first_ack_after(t0)
    out.update(first_ack_s=round(first - t0, 2) if first else None,
               whole_after_heal_s=round(time.monotonic() - healed, 2),
               truncated_bytes=cluster(g.nodes[m])["truncated_bytes"])
    if kind != "one_replica":
        assert master != m or cluster(g.nodes[m])["epoch"] > epoch, out
    # One history of masterships on every node, and the master's own epoch last in it:
    # an answer of the old master that lands after an election does not rewrite it.
    histories = wait_for(lambda: len({str(cluster(n)["epochs"]) for n in g.nodes}) == 1
                         and cluster(g.nodes[master])["epochs"], 10, "one epoch history")
    assert histories[-1][0] == cluster(g.nodes[master])["epoch"], histories
    return out


def _run(tmp_path: Path, net: netns.Net, faults: list[str], idle_before: set[int]
         ) -> dict[str, Any]:
    redis = RedisServer(net.ip(netns.HOST, "mgmt")).start()
    g = Group(tmp_path, 3, "--replication", "sync", "--min-insync", "2",
              "--notify", redis.url, net=net).start()
    gws: list[Server] = []
    stats: dict[str, Any] = {"rounds": []}
    try:
        _whole(g)
        gws = [Server(None, "--store", g.addrs, "--notify", redis.url,
                      "--max-offline-messages", "10000000", command="gateway").start()
               for _ in range(2)]
        sub = subscriber(gws[1].port)
        sub.subscribe("ha/#", 1)
        load = Load([gw.port for gw in gws]).start()
        delivered: list[bytes] = []
        for i, fault in enumerate(faults):
            if i in idle_before:  # an idle minute: the publishers wait, then the fault
                load.paused.set()
                time.sleep(IDLE_S)
                load.paused.clear()
                stats.setdefault("idle_before", []).append(i)
            time.sleep(random.uniform(1.0, 3.0))
            try:
                stats["rounds"].append(_round(g, net, load, fault))
            except AssertionError as exc:  # what each node said, to see why
                tails = "\n".join(f"--- node {n}: {node.logs()[-3000:]}"
                                   for n, node in enumerate(g.nodes))
                raise AssertionError(f"round {i} ({fault}): {exc}\n{tails}") from exc
            print("round", i, stats["rounds"][-1], flush=True)
        time.sleep(1.0)
        load.stop()
        m = _whole(g)
        wait_for(lambda: all(log_bytes(d) == log_bytes(g.dirs[m]) for d in g.dirs), 20,
                 "three byte-identical CommitLogs")
        delivered += collect(sub, 5.0)
        acked = load.all_acked()
        lost = set(acked) - set(delivered)
        stats.update(acked=len(acked), delivered=len(delivered), lost=len(lost),
                     refused=load.refused(), log_bytes=len(log_bytes(g.dirs[m])))
        stats["overlaps"] = overlapping_acks(_statuses(g))
        assert_each_in_order(delivered, {f"p{i}".encode() for i in range(4)})
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
        redis.stop()


def test_partitions_under_load(tmp_path: Path, net: netns.Net) -> None:
    rng = random.Random(29)
    if len(CUTS) >= ROUNDS:
        faults = list(CUTS[:ROUNDS])
        idle: set[int] = set()
    else:  # the soak: every kind of fault, and an idle minute before every fifth
        faults = [rng.choice(SOAK_FAULTS) for _ in range(ROUNDS)]
        idle = set(range(4, ROUNDS, 5))
    stats = _run(tmp_path, net, faults, idle)
    print("partition rounds:", stats)
    assert stats["acked"] > 100, stats
    assert stats["lost"] == 0, stats
    assert not stats["overlaps"], stats
