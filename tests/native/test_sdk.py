"""Server applications through the SDK: consumer groups over MQTT devices' messages,
rebalance, redelivery and dead letters, and commands from a server app to a device."""

from __future__ import annotations

import time
import uuid
from collections import Counter

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from lightgate import Consumer, Producer
from store.common import StoreUnavailable
from store.sdk import ReceivedMessage
from tests.mqtt.paho_client import Client


def uid(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


def drain(consumers: list[Consumer], want: int, seconds: float = 30) -> dict[int, list]:
    got: dict[int, list[ReceivedMessage]] = {i: [] for i in range(len(consumers))}
    deadline = time.monotonic() + seconds
    while sum(len(v) for v in got.values()) < want and time.monotonic() < deadline:
        for i, c in enumerate(consumers):
            for m in c.poll(timeout=0.1):
                got[i].append(m)
                c.ack(m)
    return got


def test_group_of_three_consumes_device_messages_exactly_once(shared_server) -> None:
    topic = uid("fleet")
    devices = [Client(shared_server.port, uid("dev")) for _ in range(5)]
    for i in range(300):
        devices[i % 5].publish(f"{topic}/d{i % 5}/temp", b"%03d" % i, 1)
    group = uid("g")
    consumers = [Consumer(shared_server.native, group, topic) for _ in range(3)]
    try:
        time.sleep(0.3)  # let every member's heartbeat land before the first poll
        for c in consumers:
            c._portal.call(c._portal.obj._heartbeat)
        assigned = [set(c.assigned) - {f"{group}#retry"} for c in consumers]
        assert set().union(*assigned) == {f"{topic}#{p}" for p in range(4)}
        assert sum(len(a) for a in assigned) == 4  # each partition to exactly one member
        got = drain(consumers, 300)
        bodies = Counter(m.body for ms in got.values() for m in ms)
        assert set(bodies) == {b"%03d" % i for i in range(300)}
        assert max(bodies.values()) == 1
        m = got[next(i for i in got if got[i])][0]
        assert m.mqtt_topic.startswith(f"{topic}/d") and m.qos == 1
        assert m.client_id.startswith("dev") and m.msg_id and m.store_time > 0
    finally:
        for c in consumers:
            c.close()
        for d in devices:
            d.disconnect()
    # Offsets were committed: the group resumes after them, nothing is read again.
    again = Consumer(shared_server.native, group, topic)
    try:
        assert again.poll(timeout=0.5) == []
    finally:
        again.close()


def test_rebalance_when_a_member_leaves(shared_server) -> None:
    topic, group = uid("rb"), uid("g")
    with Producer(shared_server.native) as producer:
        a = Consumer(shared_server.native, group, topic)
        b = Consumer(shared_server.native, group, topic)
        a._portal.call(a._portal.obj._heartbeat)
        before = set(a.assigned)
        assert 0 < len(before - {f"{group}#retry"}) < 4  # shared with b
        producer.send_batch(topic, [b"x%d" % i for i in range(40)], key="k1")
        for i in range(40):
            producer.send(topic, b"y%d" % i, key=f"key-{i}")
        first = drain([a, b], 80)
        assert sum(len(v) for v in first.values()) == 80
        b.close()  # leaves the group (commits and says goodbye)
        a._portal.call(a._portal.obj._heartbeat)
        assert {q for q in a.assigned if "#retry" not in q} == {f"{topic}#{p}" for p in range(4)}
        for i in range(20):
            producer.send(topic, b"z%d" % i, key=f"key-{i}")
        rest = drain([a], 20)
        assert sorted(m.body for m in rest[0]) == sorted(b"z%d" % i for i in range(20))
        a.close()


def test_failing_message_is_redelivered_then_dead_lettered(shared_server) -> None:
    topic, group = uid("dl"), uid("g")
    with Producer(shared_server.native) as producer:
        producer.send(topic, b"poison", key="p")
        producer.send(topic, b"fine", key="f")
    c = Consumer(shared_server.native, group, topic, max_attempts=2)
    try:
        attempts = []
        fine = []
        deadline = time.monotonic() + 20
        dead = False
        while not dead and time.monotonic() < deadline:
            for m in c.poll(timeout=0.2):
                if m.body == b"poison":
                    attempts.append(m.attempt)
                    dead = c.nack(m)
                else:
                    fine.append(m.body)
                    c.ack(m)
        assert fine == [b"fine"]
        assert attempts == [0, 1] and dead  # first try, one retry after backoff, then DLQ
        c.poll(timeout=0.5)  # nothing more comes back
    finally:
        c.close()
    # The dead letter is kept and readable.
    dlq = Consumer(shared_server.native, uid("dlqreader"), topic)
    try:
        res = dlq._portal.call(_read_queue, dlq._portal.obj, f"{group}#dlq")
        assert [m.body for m in res] == [b"poison"]
        assert res[0].properties["lg_attempt"] == 2 and res[0].properties["lg_origin"]
    finally:
        dlq.close()


async def _read_queue(consumer, queue: str) -> list:
    from store import protocol as p

    header, body = await consumer.client.request(p.PULL, {"queue": queue, "offset": 0,
                                                           "max": 10})
    return p.unpack_messages(header["messages"], body)


def test_server_app_commands_a_device_over_mqtt(shared_server) -> None:
    device = Client(shared_server.port, "dev-42", version=5)
    device.subscribe("dev/42/cmd", 1)
    with Producer(shared_server.native) as producer:
        res = producer.send("dev", b'{"cmd":"reboot"}', mqtt_topic="dev/42/cmd", qos=1,
                            properties={"user_property": [("by", "ops")],
                                        "correlation_data": b"\x07"})
        assert res.msg_id and res.queues[0] == ("dev/42/cmd", res.queues[0][1])
    [m] = device.expect(1)
    assert (m.topic, m.payload, m.qos) == ("dev/42/cmd", b'{"cmd":"reboot"}', 1)
    assert m.properties.UserProperty == [("by", "ops")]
    assert m.properties.CorrelationData == b"\x07"
    device.disconnect()


def test_device_user_properties_reach_server_apps(shared_server) -> None:
    topic = uid("upx")
    dev = Client(shared_server.port, uid("d"), version=5)
    props = Properties(PacketTypes.PUBLISH)
    props.UserProperty = [("fw", "1.2")]
    dev.publish(f"{topic}/a", b"v", 1, properties=props)
    c = Consumer(shared_server.native, uid("g"), topic)
    try:
        [m] = drain([c], 1)[0]
        assert [tuple(x) for x in m.properties["user_property"]] == [("fw", "1.2")]
    finally:
        c.close()
        dev.disconnect()


def test_the_delivery_timeout_bounds_a_send_when_the_store_is_gone(tmp_path) -> None:
    """An idempotent send tries until its delivery_timeout, then says so; without
    idempotence `timeout` bounds the whole call."""
    from lightgate import DeliveryTimeout
    from tests.conftest import Server

    srv = Server(tmp_path / "d").start()
    producer = Producer(srv.native, timeout=1.0, delivery_timeout=2.0)
    plain = Producer(srv.native, timeout=1.0, idempotent=False)
    try:
        producer.send("t", b"ok")
        srv.kill()
        for sender, bound, error in ((producer, 2.0, DeliveryTimeout),
                                     (plain, 1.0, StoreUnavailable)):
            t0 = time.monotonic()
            with pytest.raises(error):
                sender.send("t", b"lost")
            assert time.monotonic() - t0 < bound + 2
    finally:
        producer.close()
        plain.close()


def _keys_by_partition(topic: str, partitions: int = 4) -> dict[int, str]:
    """A message key for each partition of `topic` (the store's own choice of queue)."""
    from lightqueue.routing import Router, split_partition_queue

    router, out, i = Router(partitions), {}, 0
    while len(out) < partitions:
        q = split_partition_queue(router.partition_for(topic, f"k{i}"))
        assert q is not None
        out.setdefault(q[1], f"k{i}")
        i += 1
    return out


def _send_across(native: str, topic: str, per_partition: dict[int, int]) -> None:
    """One SEND whose messages land in several partitions at once."""
    import trio

    from store import protocol as p
    from store.client import NativeClient
    from store.record import Message

    keys = _keys_by_partition(topic)
    msgs = [Message("", b"p%d-%d" % (q, i), key=keys[q])
            for q, n in per_partition.items() for i in range(n)]
    metas, body = p.pack_messages(msgs)

    async def send() -> None:
        async with NativeClient.open(native) as client:
            await client.request(p.SEND, {"topic": topic, "messages": metas}, body)

    trio.run(send)


def test_a_poll_returns_what_is_there_up_to_its_max(shared_server) -> None:
    """100 messages over four partitions: each poll hands out at most its max, and the
    polls together each message once, in order within a partition."""
    topic = uid("many")
    _send_across(shared_server.native, topic, {0: 40, 1: 30, 2: 20, 3: 10})
    with Consumer(shared_server.native, uid("g"), topic) as c:
        polls = [c.poll(timeout=1.0, max_messages=32) for _ in range(4)]
        assert [len(x) for x in polls] == [32, 32, 32, 4]
        assert c.poll(timeout=0.2) == []
    bodies = [m.body for x in polls for m in x]
    assert len(bodies) == len(set(bodies)) == 100
    for q, n in {0: 40, 1: 30, 2: 20, 3: 10}.items():
        assert [b for b in bodies if b.startswith(b"p%d-" % q)] == \
            [b"p%d-%d" % (q, i) for i in range(n)]


def test_a_waiting_poll_wakes_for_any_partition_and_takes_all_there(shared_server) -> None:
    """A poll waiting on an empty topic: messages landing in several partitions at once
    come back together and at once, whichever partitions they are."""
    import threading

    topic = uid("live")
    for partitions in ({2: 3, 3: 2}, {0: 1, 1: 2, 3: 3}):
        with Consumer(shared_server.native, uid("g"), topic, start="latest") as c:
            assert c.poll(timeout=0.3) == []
            sender = threading.Timer(0.1, _send_across,
                                     (shared_server.native, topic, partitions))
            started = time.monotonic()
            sender.start()
            got = c.poll(timeout=5.0)
            waited = time.monotonic() - started
            sender.join()
        assert sorted(m.body for m in got) == sorted(
            b"p%d-%d" % (q, i) for q, n in partitions.items() for i in range(n)), got
        # (Before, it long-polled one queue and looked at the others every 0.5 s.)
        assert waited < 0.4, f"the poll took {waited:.2f} s for messages sent at 0.1 s"
