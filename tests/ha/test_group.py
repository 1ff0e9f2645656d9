"""A store group without gateways: replicas killed, restarted or wiped catch up (the
partitions are in test_partition.py)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from spark_streaming.native import StoreClient
from store.sdk import Producer
from tests.ha.cluster import Group, cluster, log_bytes, wait_for


def _send(addrs: str, n: int, tag: str) -> int:
    """Send n messages through the group (following the master), retrying refusals as a
    device would; returns how many were acknowledged."""
    done = 0
    with Producer(addrs, timeout=10) as prod:
        for i in range(n):
            for _ in range(100):
                try:
                    prod.send("grp", f"{tag}-{i}".encode())
                    done += 1
                    break
                except Exception:  # noqa: BLE001 - no master yet: retry
                    time.sleep(0.1)
    return done


@pytest.fixture
def group(tmp_path: Path):
    g = Group(tmp_path, 3, "--replication", "sync", "--min-insync", "2").start()
    m = g.master(20)
    wait_for(lambda: len(g.insync(m)) == 3, 15, "all three in sync")
    yield g
    g.stop()


def test_replica_killed_restarted_and_wiped_catches_up(group: Group) -> None:
    g = group
    m = g.master()
    r = (m + 1) % 3
    assert _send(g.addrs, 100, "a") == 100
    g.nodes[r].kill()
    assert _send(g.addrs, 100, "b") == 100  # min-insync 2: master + the other replica
    g.nodes[r].start()
    wait_for(lambda: log_bytes(g.dirs[r]) == log_bytes(g.dirs[m]), 15, "catch-up")
    wait_for(lambda: len(g.insync(m)) == 3, 15, "back in sync")
    g.nodes[r].kill()
    shutil.rmtree(g.dirs[r])  # its disk died: CommitLog, metadata, epochs, Raft journal
    assert _send(g.addrs, 100, "c") == 100
    g.nodes[r].start()
    wait_for(lambda: log_bytes(g.dirs[r]) == log_bytes(g.dirs[m]), 20, "resync from zero")
    assert cluster(g.nodes[r])["role"] == "replica"
    wait_for(lambda: cluster(g.nodes[r])["epochs"] == cluster(g.nodes[m])["epochs"], 5,
             "the master's epoch history")
    # The Spark source's client, given the group, talks to the master.
    with StoreClient(g.addrs) as c:
        assert len(c.describe("grp")) == 4
        assert c.port == g.nodes[m].native_port
