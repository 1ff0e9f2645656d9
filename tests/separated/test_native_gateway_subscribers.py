"""`lightgate gateway`'s subscribers on the native plane: a clean session's subscriber
is carried by the engine, which delivers this gateway's stored publishes from the
store's answers and the rest (another gateway's, Python's QoS 2) from raw pulls of the
queue, each message once, in queue order, from the subscriber's position. Both planes
(LIGHTGATE_NATIVE=0: Python delivers, as before). Real processes, real Redis, real
sockets, a real SIGKILL of the store."""

from __future__ import annotations

import socket
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from functools import partial

import pytest

from gateway import mqtt
from tests.conftest import RedisServer, Server
from tests.faults.test_slow_consumer import _drain_socket, _read_qos1
from tests.mqtt.paho_client import Client
from tests.mqtt.raw import RawClient
from tests.plane.test_handover import native_counters
from tests.separated import test_native_gateway as gateway_tests
from tests.separated.test_native_gateway import (
    PROMOTED,
    burst,
    kill_mid_burst,
    publisher,
    uid,
)

# The native and the Python plane, and a store with one gateway on it.
plane_name = gateway_tests.plane_name
shape = gateway_tests.shape

BACK = "back from the native plane"
FLOOD = 20_000  # messages past a 64 KiB --max-unsent-bytes, many times over


def by_publisher(payloads: list[bytes]) -> dict[bytes, list[int]]:
    """b"<publisher>:<n>" payloads: each publisher's numbers, in the order received."""
    seen: dict[bytes, list[int]] = defaultdict(list)
    for p in payloads:
        who, n = p.split(b":")
        seen[who].append(int(n))
    return seen


def tagged_burst(gw: Server, which: str, topic: str, tag: str, count: int) -> None:
    """A native publisher (on the native plane) sends b"<tag>:<i>" at QoS 1, 8 in flight."""
    dev, _ = publisher(gw, which)
    sent: dict[int, int] = {}
    i = acked = 0
    while acked < count:
        while i < count and len(sent) < 8:
            pid = i % 60000 + 1
            dev.send(mqtt.Publish(topic, f"{tag}:{i}".encode(), 1, packet_id=pid))
            sent[pid] = i
            i += 1
        ack = dev.recv()
        assert isinstance(ack, mqtt.Puback) and ack.reason_code == 0, ack
        sent.pop(ack.packet_id)
        acked += 1
    dev.close()


def subscriber(gw: Server, which: str, flt: str | list[str], qos: int = 1,
               version: int = 4) -> tuple[Client, str]:
    """A clean session subscribed to `flt` (or to each of them): carried with its
    subscriptions (native plane)."""
    cid = uid("sub")
    sub = Client(gw.port, cid, version=version)
    filters = [flt] if isinstance(flt, str) else flt
    sub.subscribe([(f, qos) for f in filters])
    if which == "native":
        carried_at(gw, cid, len(filters))
    return sub, cid


def carried_at(gw: Server, cid: str, subscriptions: int = 1, timeout: float = 10) -> int:
    """The gateway's log line where `cid` was promoted with its subscriptions."""
    deadline = time.monotonic() + timeout
    promoted = f"{PROMOTED} ({subscriptions} subscriptions)"
    while True:
        for i, line in enumerate(list(gw.log)):
            if f"client {cid!r} (" in line and promoted in line:
                return i
        assert time.monotonic() < deadline, f"{cid} not carried: {gw.logs()[-3000:]}"
        time.sleep(0.02)


def run_all(*targets: Callable[[], None]) -> None:
    """Run these at once, each in a thread; return once all are done."""
    runs = [threading.Thread(target=t) for t in targets]
    for r in runs:
        r.start()
    for r in runs:
        r.join(60)
    assert not any(r.is_alive() for r in runs), "a publisher did not finish"


def assert_once_in_order(got: list[bytes], expected: dict[str, int]) -> None:
    seen = by_publisher(got)
    assert set(seen) == {t.encode() for t in expected}, set(seen)
    for tag, count in expected.items():
        nums = seen[tag.encode()]
        assert nums == list(range(count)), (
            f"{tag}: {len(nums)} of {count}, first wrong at "
            f"{next((k for k, n in enumerate(nums) if n != k), None)}")


def test_carried_subscriber_gets_native_publishers_messages_once_in_order(shape) -> None:
    which, _, gw = shape
    base = uid("fanin")
    # 3.1.1, 5.0, and one whose filters overlap (a message of d0 is in both queues).
    subs = [subscriber(gw, which, f"{base}/#", version=v) for v in (4, 5)]
    subs.append(subscriber(gw, which, [f"{base}/#", f"{base}/d0"]))
    run_all(*(partial(tagged_burst, gw, which, f"{base}/d{n}", f"d{n}", 200)
              for n in range(4)))
    for sub, _ in subs:
        got = [m.payload for m in sub.expect(800, timeout=30)]
        sub.expect_none(0.3)
        assert_once_in_order(got, {f"d{n}": 200 for n in range(4)})
    if which == "native":  # delivered by the engine: never back in Python
        for (_, cid), n in zip(subs, (1, 1, 2), strict=True):
            since = carried_at(gw, cid, n)
            assert not any(f"client {cid!r} (" in line and BACK in line
                           for line in list(gw.log)[since:]), gw.logs()[-3000:]
        counters = native_counters(gw)
        assert counters["lightgate_native_messages_out_qos1_total"] >= 2400, counters
    for sub, _ in subs:
        sub.disconnect()


def test_another_gateways_and_a_qos2_publishers_messages_reach_the_carried_subscriber(
        plane_name: str, tmp_path, redis_server: RedisServer, monkeypatch) -> None:
    """Two gateways over one store, a subscriber on each: each gets what a device on the
    other publishes (its engine pulls it when the store's notify says the queue grew)
    and a QoS 2 publisher's on the first (Python stores those), with its own gateway's
    device's in between: every message once, each publisher's in order."""
    which = plane_name
    monkeypatch.setenv("LIGHTGATE_NATIVE", "1" if which == "native" else "0")
    store = Server(tmp_path / "store", "--notify", redis_server.url, command="store").start()
    gws = [Server(None, "--store", store.native, "--notify", redis_server.url,
                  "--io-threads", "1", command="gateway").start() for _ in range(2)]
    try:
        gw, other = gws
        base = uid("two")
        subs = [subscriber(g, which, f"{base}/#")[0] for g in gws]  # one on each
        q2 = Client(gw.port, uid("q2"))

        def qos2() -> None:
            for i in range(100):
                q2.publish(f"{base}/q2", f"q2:{i}".encode(), qos=2)

        run_all(partial(tagged_burst, gw, which, f"{base}/here", "here", 300),
                partial(tagged_burst, other, which, f"{base}/there", "there", 300),
                qos2)
        for sub in subs:
            got = [m.payload for m in sub.expect(700, timeout=30)]
            sub.expect_none(0.5)
            assert_once_in_order(got, {"here": 300, "there": 300, "q2": 100})
        if which == "native":
            for g in gws:
                counters = native_counters(g)
                assert counters["lightgate_native_store_pulled_records_total"] > 0, counters
        q2.disconnect()
        for sub in subs:
            sub.disconnect()
    finally:
        for srv in (*gws, store):
            if srv.proc is not None:
                assert srv.stop() == 0, srv.logs()[-3000:]


def test_a_carried_subscriber_at_the_end_makes_no_pull(shape) -> None:
    """The store's notify says each grown queue's end: a queue whose carried readers are
    there already (this gateway's publishes, delivered from the store's answers) is not
    pulled. Before, every notify batch cost a raw pull of the queue, most of them empty."""
    which, _, gw = shape
    base = uid("atend")
    sub, _ = subscriber(gw, which, f"{base}/#")
    count = 100
    if which == "native":
        wait_pulls_settle(gw)
    before = native_counters(gw) if which == "native" else {}
    dev, _ = publisher(gw, which)
    for i in range(count):  # a device's pace: each message a notify batch of its own
        dev.send(mqtt.Publish(f"{base}/d", f"d:{i}".encode(), 1, packet_id=i + 1))
        ack = dev.recv()
        assert isinstance(ack, mqtt.Puback) and ack.reason_code == 0, ack
        time.sleep(0.01)
    dev.close()
    got = [m.payload for m in sub.expect(count, timeout=30)]
    sub.expect_none(0.5)  # (the notify of the last ones has come meanwhile)
    assert_once_in_order(got, {"d": count})
    if which == "native":
        after = native_counters(gw)
        pulls = (after["lightgate_native_store_pulls_total"]
                 - before["lightgate_native_store_pulls_total"])
        # A notify that overtakes the store's answer still pulls: a few, not one a batch.
        assert pulls <= 10, (pulls, after["lightgate_native_store_pulled_records_total"])
    sub.disconnect()


def wait_pulls_settle(gw: Server, timeout: float = 10) -> None:
    """Until the gateway's pulls stop moving (a promoted reader's queue is pulled once)."""
    deadline = time.monotonic() + timeout
    last = native_counters(gw).get("lightgate_native_store_pulls_total")
    while True:
        time.sleep(0.3)
        now = native_counters(gw).get("lightgate_native_store_pulls_total")
        if now == last:
            return
        assert time.monotonic() < deadline, "the gateway's pulls never settle"
        last = now


def test_a_subscriber_demoted_mid_stream_loses_nothing_and_gets_nothing_twice(shape) -> None:
    """A carried subscriber SUBSCRIBEs to another filter while messages stream to it (the
    packet hands it back to Python, which delivers from its positions, and it is carried
    again once quiet), and gets a QoS 2 message at QoS 2 (handed back before it)."""
    which, _, gw = shape
    base = uid("demote")
    sub, cid = subscriber(gw, which, f"{base}/a/#", qos=2)
    run = threading.Thread(target=tagged_burst, args=(gw, which, f"{base}/a/x", "x", 600))
    run.start()
    got = [m.payload for m in sub.expect(100, timeout=20)]
    sub.subscribe(f"{base}/b", 1)  # mid-stream: back to Python for it
    q2 = Client(gw.port, uid("q2"))
    q2.publish(f"{base}/a/y", b"y:0", qos=2)
    run.join(60)
    got += [m.payload for m in sub.expect(501, timeout=30)]
    sub.expect_none(0.5)
    assert_once_in_order(got, {"x": 600, "y": 1})
    if which == "native":
        since = carried_at(gw, cid)
        assert any(f"client {cid!r} (" in line and BACK in line
                   for line in list(gw.log)[since:]), "the subscriber was never handed back"
    q2.disconnect()
    sub.disconnect()


def test_store_killed_the_carried_subscriber_gets_every_acknowledged_message(shape) -> None:
    """The store killed with SIGKILL mid-stream and started again: every message its
    publisher had acknowledged reaches the subscriber once, in order; the gateway lives."""
    which, store, gw = shape
    base = uid("kill")
    sub, _ = subscriber(gw, which, f"{base}/#")
    dev, _ = publisher(gw, which)
    acked = kill_mid_burst(store, dev, f"{base}/t", 100)
    store.start()
    stored_ok = sorted(i for i, code in acked.items() if code == 0)
    assert stored_ok
    # After it, a second device's messages come too (the subscriber is served again).
    after, _ = publisher(gw, which)
    deadline = time.monotonic() + 20
    while burst(after, f"{base}/after", 1) != {0: 0}:
        assert time.monotonic() < deadline
        time.sleep(0.2)
        after.close()
        after, _ = publisher(gw, which)
    after.close()
    got: list[int] = []
    came_after = False
    want = set(stored_ok)
    deadline = time.monotonic() + 30
    while not (want <= set(got) and came_after):
        assert time.monotonic() < deadline, (
            f"{len(want - set(got))} acknowledged messages not delivered: "
            f"{sorted(want - set(got))[:5]}; the one after: {came_after}")
        try:
            msgs = sub.expect(1, timeout=0.5)
        except TimeoutError:
            continue
        for m in msgs:
            if m.topic.endswith("/after"):
                came_after = True
            else:
                got.append(int(m.payload))
    time.sleep(0.5)
    while not sub.messages.empty():  # (anything more: a duplicate)
        m = sub.messages.get_nowait()
        if not m.topic.endswith("/after"):
            got.append(int(m.payload))
    assert got == sorted(set(got)), "a message delivered twice, or out of order"
    sub.disconnect()
    assert gw.proc is not None and gw.proc.poll() is None, "the gateway died"


def test_a_subscriber_that_falls_behind_is_served_from_the_store_and_gets_everything_once(
        plane_name: str, tmp_path, redis_server: RedisServer, monkeypatch) -> None:
    """A carried QoS 1 subscriber with a small socket buffer reads nothing while a
    flood passes its --max-unsent-bytes, then reads: every message once, in order. On
    the native plane it stays there: its deliveries come in rounds pulled from the store
    (as `serve` reads them from its log), not from Python (no demotion "backlog")."""
    which = plane_name
    monkeypatch.setenv("LIGHTGATE_NATIVE", "1" if which == "native" else "0")
    store = Server(tmp_path / "store", "--notify", redis_server.url, command="store").start()
    gw = Server(None, "--store", store.native, "--notify", redis_server.url,
                "--io-threads", "1", "--max-unsent-bytes", "65536", command="gateway").start()
    try:
        base, cid = uid("flood"), uid("slow")
        slow = RawClient(gw.port, timeout=30)
        slow.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
        slow.connect(cid)
        slow.subscribe(f"{base}/#", 1, packet_id=1)
        if which == "native":
            carried_at(gw, cid)
        pub, _ = publisher(gw, which)
        said = len(gw.log)
        acks = threading.Thread(target=_drain_socket, args=(pub.sock, FLOOD * 4), daemon=True)
        acks.start()
        for start in range(0, FLOOD, 1000):  # ... while the subscriber reads nothing
            pub.send_raw(b"".join(
                mqtt.encode(mqtt.Publish(f"{base}/a", b"%07d" % i, qos=1,
                                         packet_id=i % 65535 + 1), 4)
                for i in range(start, min(start + 1000, FLOOD))))
        acks.join(60)
        got = _read_qos1(slow.sock, FLOOD, time.monotonic() + 60)
        assert got == list(range(FLOOD)), len(got)  # once each, in order
        slow.sock.settimeout(0.5)
        with pytest.raises(TimeoutError):  # and nothing more
            slow.sock.recv(1 << 16)
        if which == "native":
            back = [line for line in list(gw.log)[said:]
                    if f"client {cid!r} (" in line and BACK in line]
            assert back == [], back[:3]
            counters = native_counters(gw)
            assert counters["lightgate_native_fell_behind_total"] >= 1, counters
            assert counters["lightgate_native_rounds_from_store_total"] >= 1, counters
        pub.close()
        slow.close()
    finally:
        for srv in (gw, store):
            if srv.proc is not None:
                assert srv.stop() == 0, srv.logs()[-3000:]
