"""What a store group tells gateways through Redis: that a queue grew, once per append,
by the master, when its readers can read it (in sync mode: once the in-sync set holds
it). A replica's copy, or a write not yet acknowledged, tells nobody: every gateway
would pull for nothing."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import orjson
import redis

from store.sdk import Producer
from tests.conftest import RedisServer
from tests.ha.cluster import Group, read_topic, wait_for
from tests.proc import pause

TOPIC = "told"


def _told(ps: redis.client.PubSub, timeout: float) -> list[str] | None:
    """The next batch of names on the channel (None: none within `timeout`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = ps.get_message(timeout=0.05)
        if msg is not None and msg["type"] == "message":
            return list(orjson.loads(msg["data"]))
    return None


def test_the_master_tells_once_per_append_when_it_is_readable(tmp_path: Path,
                                                             redis_server: RedisServer
                                                             ) -> None:
    g = Group(tmp_path, 3, "--replication", "sync", "--min-insync", "2", "--notify",
              redis_server.url).start()
    raw = redis.Redis.from_url(redis_server.url)
    ps = raw.pubsub(ignore_subscribe_messages=True)
    ps.subscribe("lightgate:notify")
    try:
        m = g.master(20)
        wait_for(lambda: len(g.insync(m)) == 3, 15, "all three in sync")
        master = g.nodes[m].native
        n = 10
        with Producer(g.addrs, idempotent=False) as prod:
            # the master may not hold its lease yet: the first until it does
            wait_for(lambda: prod.send(TOPIC, b"m0", key="k"), 15, "a first append")
            for i in range(1, n):
                prod.send(TOPIC, b"m%d" % i, key="k")
        time.sleep(0.5)  # the batches of every node have gone out
        batches = []
        while (names := _told(ps, 0.1)) is not None:
            batches.append(names)
        told = sum(1 for b in batches for q in b if q.startswith(f"{TOPIC}#"))
        assert 1 <= told <= n, batches  # the master's alone, one per append at most
        # A replica stopped: the next append is written but not acknowledged (it waits
        # for the stopped one until it leaves the in-sync set), and nobody is told of it
        # until then; when told, readers of the master read it.
        stopped = g.nodes[g.replicas_leader_last(m)[0]]
        pause(stopped.proc.pid)  # (every thread: a native copy thread too)
        def late() -> None:
            with Producer(master, idempotent=False) as prod:
                prod.send(TOPIC, b"late", key="k")

        sender = threading.Thread(target=late)
        sender.start()
        names = _told(ps, 10)
        assert names is not None and any(q.startswith(f"{TOPIC}#") for q in names)
        assert b"late" in read_topic(master, TOPIC)
        sender.join(10)
    finally:
        for node in g.nodes:
            if node.proc is not None:
                node.proc.send_signal(signal.SIGCONT)
        ps.close()
        raw.close()
        g.stop()
