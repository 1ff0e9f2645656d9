"""A forked tail, forced rather than left to chance: the master of a sync group
(min-insync 2) appends messages its replicas never get (both are SIGSTOPped), so no
acknowledgement goes out; it is killed with those bytes only on its disk. The replicas
resume, elect a new master, which takes (and acknowledges) more writes at the same
offsets. The old master, restarted, must cut its unacknowledged tail, rejoin as a
replica and end byte-identical to the new master; a reader finds every acknowledged
message and none of the unacknowledged ones."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import trio

from store.replication.follower import FETCH_WAIT_MS
from store.sdk import AsyncProducer
from tests.ha.cluster import Group, cluster, log_bytes, read_topic, wait_for
from tests.proc import pause

TOPIC = "fork"
WINDOW_S = 10.0


def _send_acked(addrs: str, bodies: list[bytes]) -> None:
    """Send each body through the group and require its acknowledgement (retrying a
    refusal while the group has no master, as a device would)."""
    async def main() -> None:
        async with AsyncProducer(addrs, timeout=10) as prod:
            for b in bodies:
                for attempt in range(50):
                    try:
                        await prod.send(TOPIC, b, key=b.decode())
                        break
                    except Exception:  # noqa: BLE001 - no master yet: again
                        if attempt == 49:
                            raise
                        await trio.sleep(0.2)
    trio.run(main)


def _send_unacked(addr: str, bodies: list[bytes], wait_s: float) -> bool:
    """Send the bodies in one request (one append) to one node only (no failover to
    another); True if it was acknowledged within wait_s (the test wants False)."""
    async def main() -> bool:
        # Not idempotent: its id would wait, as metadata, for the frozen replicas.
        async with AsyncProducer(addr, timeout=wait_s, idempotent=False) as prod:
            try:
                await prod.send_batch(TOPIC, bodies, timeout=wait_s)
            except Exception:  # noqa: BLE001 - timed out or failed: not acknowledged
                return False
            return True
    return trio.run(main)


def test_forced_fork_old_master_cuts_unacked_tail(tmp_path: Path) -> None:
    # A wider window than the defaults (lease 3 s, max lag 2 s) for the frozen phase, so
    # a slow machine still appends the unacked messages before the master steps down or
    # drops the frozen replicas from the in-sync set (which would refuse them instead).
    g = Group(tmp_path, 3, "--replication", "sync", "--min-insync", "2",
              "--controller-lease-s", str(WINDOW_S), "--max-lag-s", str(WINDOW_S),
              "--failover-after-s", str(WINDOW_S + 1)).start()
    frozen: list[int] = []
    try:
        m = g.master(20)
        wait_for(lambda: len(g.insync(m)) == 3, 15, "all three in sync")
        before = [f"before-{i}".encode() for i in range(50)]
        _send_acked(g.addrs, before)
        replicas = [i for i in range(3) if i != m]
        # log_end over HTTP, not the files' length: a write may sit in a buffer a moment.
        common = wait_for(lambda: len({cluster(g.nodes[i])["log_end"] for i in range(3)}) == 1
                          and cluster(g.nodes[m])["log_end"], 10,
                          "replicas holding the acknowledged log")
        epoch = cluster(g.nodes[m])["epoch"]

        # Freeze both replicas: the master appends, but no replica fetches, so no ack.
        for r in replicas:
            pause(g.nodes[r].proc.pid)  # (every thread: a native copy thread too)
            frozen.append(r)
        froze = time.monotonic()
        # Each replica had a fetch waiting at the master (long poll, FETCH_WAIT_MS): let
        # those end empty first, or the master would answer one with the new bytes into
        # the frozen replica's socket, and that replica would write them once thawed.
        time.sleep(FETCH_WAIT_MS / 1000 + 1.0)  # + a margin for a loaded machine
        # Sent now, inside the window where the master still counts the frozen replicas
        # in sync (--max-lag-s) and has not stepped down (--controller-lease-s): appended,
        # not acked.
        unacked = [f"unacked-{i}".encode() for i in range(20)]
        assert not _send_unacked(g.nodes[m].native, unacked, wait_s=1.5)
        st = wait_for(lambda: (s := cluster(g.nodes[m]))["log_end"] > common and s, 5,
                      "the master to append the unacknowledged messages")
        tail = st["log_end"] - common
        assert st["replicated_offset"] == common, st  # held by the master alone
        wait_for(lambda: len(log_bytes(g.dirs[m])) == common + tail, 5, "the tail on disk")
        assert st["role"] == "master" and time.monotonic() - froze < WINDOW_S - 2
        g.nodes[m].kill()  # SIGKILL with the tail only on its disk
        for r in replicas:
            os.kill(g.nodes[r].proc.pid, signal.SIGCONT)
        frozen.clear()

        killed = time.monotonic()
        # The controller elects once the master has been silent --failover-after-s (from
        # its last report, which may be as late as the kill): that, and a margin.
        new = wait_for(lambda: next((i + 1 for i in replicas
                                     if cluster(g.nodes[i])["role"] == "master"), None),
                       WINDOW_S + 10, "a new master") - 1
        elected = time.monotonic() - killed
        assert cluster(g.nodes[new])["epoch"] > epoch
        after = [f"after-{i}".encode() for i in range(50)]
        _send_acked(",".join(g.nodes[i].native for i in replicas), after)

        g.nodes[m].start()  # the old master comes back
        wait_for(lambda: cluster(g.nodes[m])["role"] == "replica", 15, "a replica")
        wait_for(lambda: log_bytes(g.dirs[m]) == log_bytes(g.dirs[new]), 15,
                 "the old master byte-identical to the new one")
        st = cluster(g.nodes[m])
        assert st["truncated_bytes"] == tail, (st["truncated_bytes"], tail)
        # The epoch history comes with the fetch answers after the bytes (adopt_epochs):
        # the logs can match a fetch before the old master says the new epoch.
        wait_for(lambda: cluster(g.nodes[m])["epoch"] == cluster(g.nodes[new])["epoch"], 10,
                 "the old master on the new master's epoch")
        assert g.nodes[m].wait_log(f"cut {tail} bytes of a forked log tail at offset {common}")
        wait_for(lambda: len(g.insync(new)) == 3, 15, "the old master back in sync")
        # The cut tail is kept aside (quarantine), and it is what the master never acked.
        [q] = (g.dirs[m] / "commitlog" / "quarantine").iterdir()
        assert q.name.startswith(f"{common:020d}") and q.stat().st_size == tail
        assert all(b in q.read_bytes() for b in unacked)
        assert not any(b in log_bytes(g.dirs[new]) for b in unacked)

        # Readers (on the new master and on the old one, now a replica) find every
        # acknowledged message once and no unacknowledged one.
        for node in (g.nodes[new], g.nodes[m]):
            got = read_topic(node.native, TOPIC)
            assert sorted(got) == sorted(before + after), node.native
            assert not set(got) & set(unacked)
        print(f"fork: tail {tail} bytes cut after {common} common bytes; new master "
              f"after {elected:.2f} s; logs {len(log_bytes(g.dirs[new]))} bytes identical")
    finally:
        for r in frozen:
            os.kill(g.nodes[r].proc.pid, signal.SIGCONT)
        g.stop()

