"""Store groups after an idle minute (skewed clocks: test_skewed_clocks.py).

Three groups (nine nodes, each in a network namespace) are left alone for over a minute,
long enough for any thread tied to a retired worker to have gone; then one group's master
is killed with SIGKILL, one's is cut from everyone and one's is cut from the controller
and one replica. Each group elects a new master, takes writes, and is whole again once the
cut heals or the node restarts, with every acknowledged message kept."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from store.sdk import Producer
from tests.ha import netns
from tests.ha.cluster import Group, cluster, log_bytes, read_topic, wait_for

IDLE_S = 61.0
ELECTION_LIMIT_S = 10.0


def _send(addrs: str, tag: str, n: int) -> list[bytes]:
    """Send n messages through the group (retrying while it has no master); the bodies
    acknowledged."""
    acked: list[bytes] = []
    with Producer(addrs, timeout=5) as prod:
        for i in range(n):
            body = f"{tag}-{i}".encode()
            for _ in range(150):
                try:
                    prod.send("idle", body)
                    acked.append(body)
                    break
                except Exception:  # noqa: BLE001 - no master yet: again
                    time.sleep(0.1)
    return acked


def _whole(g: Group, timeout: float = 40) -> int:
    def whole() -> int | None:
        m = g.master(5)
        return m + 1 if len(g.insync(m)) == len(g.nodes) else None
    return int(wait_for(whole, timeout, "the group whole", step=0.25)) - 1


def _fault_after_idle(g: Group, net: netns.Net, fault: str, out: dict[str, Any]) -> None:
    m = g.master(5)
    r1, r2 = [i for i in range(3) if i != m]
    epoch = cluster(g.nodes[m])["epoch"]
    t0 = time.monotonic()
    if fault == "kill":
        g.nodes[m].kill()
    elif fault == "isolated":
        net.isolate(m)
    else:  # cut from the controller and one replica: the other still fetches from it
        net.cut(m, r1, ("raft",))
        net.cut(m, r2)
    new = wait_for(lambda: next((i + 1 for i in (r1, r2)
                                 if cluster(g.nodes[i])["role"] == "master"
                                 and cluster(g.nodes[i])["epoch"] > epoch), None),
                   ELECTION_LIMIT_S + 5, f"a new master after {fault}") - 1
    out["elected_s"] = round(time.monotonic() - t0, 2)
    out["acked"] = _send(",".join(g.nodes[i].native for i in (r1, r2)), fault, 20)
    if fault == "kill":
        g.nodes[m].start()
    else:
        net.heal()
    _whole(g)
    out["old_master"] = cluster(g.nodes[m])["role"]
    out["new"] = new


def test_an_idle_minute_then_kill_or_partition(tmp_path: Path) -> None:
    netns.require()
    faults = ["kill", "isolated", "raft_and_one"]
    nets: list[netns.Net] = []
    groups: list[Group] = []
    try:
        for _ in faults:
            nets.append(netns.Net(3).up())
        for k, net in enumerate(nets):
            groups.append(Group(tmp_path / f"g{k}", 3, "--replication", "sync",
                                "--min-insync", "2", net=net).start())
        before = []
        for g in groups:
            _whole(g)
            before.append(_send(g.addrs, "before", 20))
        time.sleep(IDLE_S)  # nothing written, nothing asked: an idle group
        results: list[dict[str, Any]] = [{} for _ in faults]
        threads = [threading.Thread(target=_fault_after_idle, daemon=True,
                                    args=(groups[k], nets[k], faults[k], results[k]))
                   for k in range(len(faults))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        print("after an idle minute:", [{k: v for k, v in r.items() if k != "acked"}
                                        for r in results])
        for k, g in enumerate(groups):
            r = results[k]
            assert r.get("elected_s", 99) < ELECTION_LIMIT_S, (faults[k], r)
            assert len(r["acked"]) == 20 and r["old_master"] == "replica", (faults[k], r)
            m = _whole(g)
            wait_for(lambda g=g, m=m: all(log_bytes(d) == log_bytes(g.dirs[m])
                                          for d in g.dirs), 15, "identical logs")
            got = read_topic(g.nodes[m].native, "idle")
            assert sorted(got) == sorted(before[k] + r["acked"]), faults[k]
    finally:
        for g in groups:
            g.stop()
        for net in nets:
            net.down()
