"""A store group whose three nodes run with wall clocks an hour apart (libfaketime; their
monotonic clocks are the host's). Nothing compares wall-clock times across nodes, so the
group neither fails over while its master is healthy nor waits longer than usual once it
is killed. (Apart from the idle minute's file, so that the two run side by side.)"""

from __future__ import annotations

import time
from pathlib import Path

from tests.ha import netns
from tests.ha.cluster import Group, cluster
from tests.ha.test_idle_and_clocks import ELECTION_LIMIT_S, _send, _whole

LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")


def test_wall_clocks_an_hour_apart_change_nothing(tmp_path: Path) -> None:
    if not LIBFAKETIME.exists():
        netns.require("libfaketime is not installed (make test installs it)")
    skews = ["+1h", "-1h", "+0"]
    g = Group(tmp_path, 3, "--replication", "sync", "--min-insync", "2")
    for node, skew in zip(g.nodes, skews, strict=True):
        # Preloaded into the node's own process (the faketime command would fork, and a
        # SIGKILL would reach the wrapper, not the node).
        node.prefix = ["env", f"LD_PRELOAD={LIBFAKETIME}", f"FAKETIME={skew}",
                       "FAKETIME_DONT_FAKE_MONOTONIC=1"]
    g.start()
    try:
        for _ in range(2):
            m = _whole(g)
            epoch = cluster(g.nodes[m])["epoch"]
            time.sleep(6.0)  # longer than --failover-after-s: a healthy master stays
            assert g.master(5) == m and cluster(g.nodes[m])["epoch"] == epoch
            assert len(_send(g.addrs, f"e{epoch}", 10)) == 10
            g.nodes[m].kill()
            t0 = time.monotonic()
            new = g.master(ELECTION_LIMIT_S + 5)
            elected = time.monotonic() - t0
            print(f"master {m} (clock {skews[m]}) killed: {new} (clock {skews[new]}) "
                  f"elected after {elected:.2f} s")
            assert new != m and elected < ELECTION_LIMIT_S
            g.nodes[m].start()
    finally:
        g.stop()
