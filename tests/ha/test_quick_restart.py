"""A master killed and restarted soon after: its Raft journal, read at start, still says
it is master of its old epoch, while the group has elected another meanwhile. It comes up
as a follower until the controller, caught up, says otherwise: /api/v1/cluster never
shows two masters."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from tests.ha.cluster import Group, cluster, wait_for

WATCH_S = 6.0


def test_a_killed_master_restarted_comes_up_as_a_follower(tmp_path: Path) -> None:
    g = Group(tmp_path, 3, "--replication", "sync", "--min-insync", "2").start()
    try:
        m = g.master(20)
        wait_for(lambda: len(g.insync(m)) == 3, 15, "all three in sync")
        epoch = cluster(g.nodes[m])["epoch"]
        g.nodes[m].kill()
        new = g.master(15)
        assert new != m and cluster(g.nodes[new])["epoch"] > epoch

        seen: list[tuple[float, list[str | None]]] = []
        stop = threading.Event()

        def watch() -> None:  # every node's role, as fast as they answer
            while not stop.is_set():
                seen.append((time.monotonic(), g.roles()))
                time.sleep(0.02)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        g.nodes[m].start()
        restarted = time.monotonic()
        wait_for(lambda: cluster(g.nodes[m])["role"] == "replica", 15,
                 "the old master following the new one")
        time.sleep(max(0.0, restarted + WATCH_S - time.monotonic()))
        stop.set()
        watcher.join(10)
        after = [roles for t, roles in seen if t >= restarted]
        two = [roles for roles in after if roles.count("master") > 1]
        old = [roles for roles in after if roles[m] == "master"]
        print(f"{len(after)} looks at the roles in {WATCH_S} s after the restart")
        assert len(after) > 20
        assert not two, two[:3]
        assert not old, old[:3]
        assert g.master(5) == new
    finally:
        g.stop()
