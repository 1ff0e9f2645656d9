"""An idempotent SDK producer under a store group's failover: three `lightgate store`
nodes (sync replication, min-insync 2), a Producer given all three addresses sending
numbered messages one by one while the master is killed with SIGKILL. Each send whose
answer was lost goes to the new master with the same sequence: at the end the topic
holds every message once, in the order sent, and the three logs are byte-identical.

LIGHTGATE_HA_ROUNDS sets the kills (1 here; `make soak` runs more)."""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

from lightgate import Producer
from tests.ha.cluster import Group, log_bytes, read_topic, wait_for

ROUNDS = max(1, int(os.environ.get("LIGHTGATE_HA_ROUNDS", "3")) // 3)


def test_producer_across_failovers_stores_each_message_once_in_order(tmp_path: Path) -> None:
    g = Group(tmp_path, 3, "--replication", "sync", "--min-insync", "2").start()
    sent: list[bytes] = []
    errors: list[BaseException] = []
    stop = threading.Event()
    try:
        m = g.master(20)
        wait_for(lambda: len(g.insync(m)) == 3, 15, "all three in sync")
        producer = Producer(g.addrs, timeout=30.0)

        def run() -> None:
            i = 0
            try:
                while not stop.is_set() and i < 100_000:
                    body = b"%06d" % i
                    producer.send("ha", body, key="one-queue")  # one queue: a total order
                    sent.append(body)
                    i += 1
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        rng = random.Random(38)
        for _ in range(ROUNDS):
            time.sleep(rng.uniform(1.0, 2.5))
            m = g.master(10)
            before = len(sent)
            g.nodes[m].kill()
            wait_for(lambda n=before: len(sent) > n + 50 or errors, 30, "sending to resume")
            g.nodes[m].start()  # back as a replica, cutting what the group never acked
            wait_for(lambda: len(g.insync(g.master(10))) == 3, 30, "the old master in sync")
        time.sleep(0.5)
        stop.set()
        thread.join(40)
        assert not errors, errors
        resent = producer._portal.obj.resent
        producer.close()
        m = g.master(10)
        wait_for(lambda: all(log_bytes(d) == log_bytes(g.dirs[m]) for d in g.dirs), 20,
                 "three byte-identical CommitLogs")
        got = read_topic(g.nodes[m].native, "ha")
        assert len(got) == len(set(got)), "a message stored twice"
        assert got == sent, (len(got), len(sent))
        print(f"{len(sent)} messages over {ROUNDS} failovers, {resent} sends sent again")
    finally:
        stop.set()
        g.stop()
