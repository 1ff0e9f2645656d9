"""kill -9 `lightgate serve --flush sync` under QoS 1 load, several times: every message
whose PUBACK a publisher received reaches the persistent subscriber after the restarts."""

from __future__ import annotations

import random
import threading

from gateway import mqtt
from tests.conftest import Server
from tests.faults.persistent import assert_each_in_order, drain, kill_during
from tests.mqtt.raw import RawClient

PUBLISHERS = 4


def publisher(port: int, name: str, acked: list[bytes], stop: threading.Event) -> None:
    """Publish QoS 1 with a window of 8 in flight; record each PUBACKed payload."""
    try:
        c = RawClient(port, timeout=2.0)
        c.connect(name)
        inflight: dict[int, bytes] = {}
        i = 0
        while not stop.is_set():
            while len(inflight) < 8:
                pid = i % 65535 + 1
                payload = f"{name}-{i}".encode()
                c.send(mqtt.Publish("crash/load", payload, qos=1, packet_id=pid))
                inflight[pid] = payload
                i += 1
            ack = c.recv()
            if isinstance(ack, mqtt.Puback) and ack.packet_id in inflight:
                acked.append(inflight.pop(ack.packet_id))
    except (OSError, ConnectionError):
        pass  # the broker was killed: unacked messages are not promised


def test_kill_9_under_load_loses_no_acknowledged_message(tmp_path) -> None:
    srv = Server(tmp_path / "d", "--flush", "sync", "--max-offline-messages",
                 "10000000").start()
    sub = RawClient(srv.port)
    sub.connect("crash-sub", clean=False)
    sub.subscribe("crash/#", 1)
    sub.close()
    rng = random.Random(11)
    acked: list[bytes] = []
    kill_during(srv, 3, rng, (1.0, 2.0), lambda r, stop: [
        threading.Thread(target=publisher, args=(srv.port, f"p{r}{n}", acked, stop))
        for n in range(PUBLISHERS)])
    found = drain(srv.port, "crash-sub")
    missing = set(acked) - set(found)
    print(f"acked {len(acked)}, found {len(found)} ({len(set(found))} distinct), "
          f"missing {len(missing)}")
    assert len(acked) > 100
    assert not missing, sorted(missing)[:10]
    assert_each_in_order(found, {a.rsplit(b"-", 1)[0] for a in acked})
    assert srv.stop() == 0
