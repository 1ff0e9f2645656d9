"""Shared subscriptions: each message to one member, balanced, acknowledged on PUBACK,
and redelivered to another member when its first member dies without acknowledging."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter

from gateway import mqtt
from tests.mqtt.paho_client import Client
from tests.mqtt.raw import RawClient


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def test_three_members_3000_messages_exactly_once_and_none_lost_on_a_kill(shared_server):
    base = uid("sh")
    share = f"$share/workers/{base}/+"
    a = Client(shared_server.port, uid("a"), version=5)
    b = Client(shared_server.port, uid("b"), version=5)
    a.subscribe(share, 1)
    b.subscribe(share, 1)
    # Member C acknowledges its first 200 messages, then hangs and is killed.
    c = RawClient(shared_server.port, version=5)
    c.connect(uid("c"))
    c.subscribe(share, 1)
    c_acked: list[bytes] = []
    c_unacked: list[bytes] = []

    def member_c() -> None:
        while len(c_acked) < 200:
            p = c.recv()
            c.send(mqtt.Puback(p.packet_id))
            c_acked.append(p.payload)
        c.sock.settimeout(1.0)
        try:
            while True:  # take messages but never acknowledge them
                c_unacked.append(c.recv().payload)
        except (TimeoutError, ConnectionError):
            pass
        c.close()  # killed with messages in flight

    worker = threading.Thread(target=member_c)
    worker.start()
    pub = Client(shared_server.port, uid("p"), version=5)
    total = 3000
    for i in range(total):
        pub.publish(f"{base}/{i % 5}", b"%04d" % i, 1, wait=(i % 100 == 99))
    pub.publish(f"{base}/0", b"last", 1)
    worker.join(30)
    got_a = [m.payload for m in a.expect(1, timeout=30)]
    got_b: list[bytes] = []
    deadline = time.monotonic() + 30
    expected = {b"%04d" % i for i in range(total)} | {b"last"}
    while time.monotonic() < deadline:
        while not a.messages.empty():
            got_a.append(a.messages.get_nowait().payload)
        while not b.messages.empty():
            got_b.append(b.messages.get_nowait().payload)
        if set(got_a) | set(got_b) | set(c_acked) >= expected:
            break
        time.sleep(0.05)
    delivered = Counter(got_a + got_b + c_acked)
    assert set(delivered) == expected, f"lost: {sorted(expected - set(delivered))[:10]}"
    assert max(delivered.values()) == 1, "a message was processed twice"
    assert c_unacked, "member C should have died with messages in flight"
    assert set(c_unacked) <= set(got_a) | set(got_b)  # its in-flight ones went to others
    # Roughly balanced between the two survivors (C left early).
    assert min(len(got_a), len(got_b)) > 0.25 * len(delivered)
    a.expect_none(0.3)
    for x in (a, b, pub):
        x.disconnect()
