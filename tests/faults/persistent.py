"""What the crash tests share: kill -9 a server under load in rounds, drain a persistent
subscriber, check each publisher's order."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

from gateway import mqtt
from tests.mqtt.raw import RawClient


def kill_during(srv: Any, rounds: int, rng: random.Random, pause: tuple[float, float],
                workers: Callable[[int, threading.Event], list[threading.Thread]]) -> None:
    """`rounds` times: start round r's worker threads, let them run for a random pause,
    kill -9 the server, stop and join them, restart it and see it recover."""
    for r in range(rounds):
        stop = threading.Event()
        threads = workers(r, stop)
        for t in threads:
            t.start()
        time.sleep(rng.uniform(*pause))
        srv.kill()  # kill -9 at a random moment
        stop.set()
        for t in threads:
            t.join(10)
        srv.start()
        assert srv.wait_log("commitlog recovered after a crash", count=r + 1)


def drain(port: int, client_id: str, idle_s: float = 5.0, count: int | None = None
          ) -> list[bytes]:
    """Resume `client_id`'s session and take every message (acked) until `idle_s` of quiet
    (or `count` came)."""
    sub = RawClient(port)
    assert sub.connect(client_id, clean=False).session_present
    found: list[bytes] = []
    sub.sock.settimeout(idle_s)
    try:
        while count is None or len(found) < count:
            p = sub.recv()
            if isinstance(p, mqtt.Publish):
                found.append(p.payload)
                sub.send(mqtt.Puback(p.packet_id))
    except TimeoutError:
        pass
    sub.close()
    return found


def assert_each_in_order(found: list[bytes], publishers: set[bytes]) -> None:
    """Payloads are b"NAME-SEQ": QoS 1 may duplicate, but each publisher's first copies
    arrive in the order it sent them."""
    for name in publishers:
        prefix = name + b"-"
        mine = [int(f[len(prefix):]) for f in found if f.startswith(prefix)]
        firsts = list(dict.fromkeys(mine))
        assert firsts == sorted(firsts), name
