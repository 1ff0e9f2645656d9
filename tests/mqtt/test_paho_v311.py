"""MQTT 3.1.1 end to end with paho-mqtt, an independent client, over real sockets."""

from __future__ import annotations

import socket
import time
import uuid

import pytest

from gateway import mqtt
from tests.mqtt.paho_client import Client


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("qos", [0, 1, 2])
def test_round_trip_at_each_qos(shared_server, qos: int) -> None:
    topic = uid("rt") + "/x"
    sub = Client(shared_server.port, uid("sub"))
    assert sub.subscribe(topic, qos)[0].value == qos
    pub = Client(shared_server.port, uid("pub"))
    for i in range(20):
        pub.publish(topic, b"m%d" % i, qos)
    got = sub.expect(20)
    assert [m.payload for m in got] == [b"m%d" % i for i in range(20)]
    assert {m.qos for m in got} == {qos}
    assert not any(m.retain for m in got)
    sub.expect_none(0.3)
    pub.disconnect()
    sub.disconnect()


def test_delivery_qos_is_the_minimum_of_publish_and_subscription(shared_server) -> None:
    topic = uid("minq")
    sub = Client(shared_server.port, uid("s"))
    sub.subscribe(topic, 1)
    pub = Client(shared_server.port, uid("p"))
    pub.publish(topic, b"two", 2)
    pub.publish(topic, b"zero", 0)
    got = sub.expect(2)
    assert [(m.payload, m.qos) for m in got] == [(b"two", 1), (b"zero", 0)]
    pub.disconnect()
    sub.disconnect()


def test_retained_set_replace_clear(shared_server) -> None:
    topic = uid("ret") + "/state"
    pub = Client(shared_server.port, uid("p"))
    pub.publish(topic, b"v1", 1, retain=True)
    pub.publish(topic, b"v2", 1, retain=True)
    s1 = Client(shared_server.port, uid("s1"))
    s1.subscribe(topic.split("/")[0] + "/#", 1)
    [m] = s1.expect(1)
    assert (m.payload, m.retain) == (b"v2", True)
    # A live subscriber gets new retained publishes with retain=0 (3.1.1 §3.3.1.3).
    pub.publish(topic, b"v3", 1, retain=True)
    [m] = s1.expect(1)
    assert (m.payload, m.retain) == (b"v3", False)
    pub.publish(topic, b"", 1, retain=True)  # clears it
    s1.expect(1)
    s2 = Client(shared_server.port, uid("s2"))
    s2.subscribe(topic, 1)
    s2.expect_none(0.5)
    for c in (pub, s1, s2):
        c.disconnect()


def test_will_is_sent_on_keepalive_expiry(shared_server) -> None:
    will_topic = uid("will") + "/gone"
    watcher = Client(shared_server.port, uid("w"))
    watcher.subscribe(will_topic, 1)
    # A raw client that connects with keepalive 1 s and then goes silent.
    sock = socket.create_connection(("127.0.0.1", shared_server.port))
    connect = mqtt.Connect(client_id=uid("dev"), keepalive=1,
                           will=mqtt.Will(will_topic, b"offline", 1, False))
    sock.sendall(mqtt.encode(connect, 4))
    assert sock.recv(4) == b"\x20\x02\x00\x00"
    t0 = time.monotonic()
    [m] = watcher.expect(1, timeout=6)
    waited = time.monotonic() - t0
    assert m.payload == b"offline"
    assert 1.0 <= waited < 4.0  # 1.5 x keepalive, then the will
    assert sock.recv(10) == b""  # and the server closed the connection
    sock.close()
    watcher.disconnect()


def test_will_on_abnormal_close_but_not_on_disconnect(shared_server) -> None:
    topic = uid("will2")
    watcher = Client(shared_server.port, uid("w"))
    watcher.subscribe(topic + "/#", 0)
    polite = Client(shared_server.port, uid("a"), will=(topic + "/polite", b"x", 0, False))
    polite.disconnect()
    rude = Client(shared_server.port, uid("b"), will=(topic + "/rude", b"y", 0, False))
    rude.drop()
    [m] = watcher.expect(1)
    assert m.topic == topic + "/rude"
    watcher.expect_none(0.5)
    watcher.disconnect()


def test_persistent_session_gets_what_was_published_while_offline(shared_server) -> None:
    topic = uid("off") + "/cmd"
    cid = uid("dev")
    dev = Client(shared_server.port, cid, clean=False)
    dev.subscribe(topic, 1)
    dev.disconnect()
    pub = Client(shared_server.port, uid("p"))
    for i in range(5):
        pub.publish(topic, b"c%d" % i, 1)
    dev = Client(shared_server.port, cid, clean=False)
    assert dev.connack[0] is True  # session present
    assert [m.payload for m in dev.expect(5)] == [b"c%d" % i for i in range(5)]
    dev.expect_none(0.3)
    dev.disconnect()
    # A clean session throws the state away.
    dev = Client(shared_server.port, cid, clean=True)
    assert dev.connack[0] is False
    pub.publish(topic, b"after", 1)
    dev.expect_none(0.5)
    dev.disconnect()
    pub.disconnect()


def test_persistent_session_survives_a_broker_restart(server) -> None:
    topic = uid("rs") + "/+/t"
    cid = uid("dev")
    dev = Client(server.port, cid, clean=False)
    dev.subscribe(topic, 2)
    pub = Client(server.port, uid("p"))
    pub.publish(topic.replace("+", "a"), b"before", 1)
    assert dev.expect(1)[0].payload == b"before"
    dev.disconnect()
    pub.publish(topic.replace("+", "b"), b"offline-1", 2)
    pub.disconnect()
    assert server.stop() == 0
    server.start()
    pub = Client(server.port, uid("p"))
    pub.publish(topic.replace("+", "c"), b"offline-2", 1)
    dev = Client(server.port, cid, clean=False)
    assert dev.connack[0] is True
    got = dev.expect(2)
    # paho hands a QoS 2 message to the app only at PUBREL, so order across QoS may differ.
    assert sorted((m.payload, m.qos) for m in got) == [(b"offline-1", 2), (b"offline-2", 1)]
    dev.expect_none(0.3)
    dev.disconnect()
    pub.disconnect()


def test_client_takeover_closes_the_first_connection(shared_server) -> None:
    cid = uid("twin")
    first = Client(shared_server.port, cid)
    second = Client(shared_server.port, cid)
    assert first.disconnected.wait(5)
    topic = uid("tk")
    second.subscribe(topic, 0)
    pub = Client(shared_server.port, uid("p"))
    pub.publish(topic, b"to-second", 0)
    assert second.expect(1)[0].payload == b"to-second"
    for c in (second, pub):
        c.disconnect()


def test_overlapping_subscriptions_deliver_one_copy_at_the_highest_qos(shared_server) -> None:
    base = uid("ov")
    sub = Client(shared_server.port, uid("s"))
    sub.subscribe(f"{base}/+/t", 0)
    sub.subscribe(f"{base}/#", 2)
    sub.subscribe(f"{base}/a/t", 1)
    pub = Client(shared_server.port, uid("p"))
    pub.publish(f"{base}/a/t", b"one", 2)
    pub.publish(f"{base}/b/t", b"two", 1)
    got = sub.expect(2)
    assert sorted((m.payload, m.qos) for m in got) == [(b"one", 2), (b"two", 1)]
    sub.expect_none(0.5)
    for c in (sub, pub):
        c.disconnect()


def test_dollar_topics_are_not_matched_by_hash(shared_server) -> None:
    sub = Client(shared_server.port, uid("s"))
    sub.subscribe("#", 0)
    sys_sub = Client(shared_server.port, uid("sys"))
    sys_sub.subscribe("$SYS/broker/uptime", 0)
    # $SYS values are published every second (--sys-interval 1) and retained.
    assert sys_sub.expect(1, timeout=5)[0].topic == "$SYS/broker/uptime"
    time.sleep(1.5)
    while not sub.messages.empty():
        assert not sub.messages.get_nowait().topic.startswith("$")
    for c in (sub, sys_sub):
        c.disconnect()


def test_unsubscribe_stops_delivery(shared_server) -> None:
    topic = uid("un")
    sub = Client(shared_server.port, uid("s"))
    sub.subscribe(topic, 1)
    pub = Client(shared_server.port, uid("p"))
    pub.publish(topic, b"a", 1)
    sub.expect(1)
    sub.unsubscribe(topic)
    pub.publish(topic, b"b", 1)
    sub.expect_none(0.5)
    for c in (sub, pub):
        c.disconnect()


def test_sys_topics_report_broker_state(shared_server) -> None:
    sub = Client(shared_server.port, uid("s"))
    sub.subscribe("$SYS/broker/#", 0)
    pub = Client(shared_server.port, uid("p"))
    pub.publish(uid("stored"), b"x", 1)  # something in the store, whatever ran before
    pub.disconnect()
    got: dict[str, bytes] = {}

    def counted() -> bool:
        return (len(got) >= 9 and int(got["$SYS/broker/clients/connected"]) >= 1
                and int(got["$SYS/broker/store/bytes"]) > 0)

    # Retained values first (the last update's: it may predate this client and the
    # publish), then the next updates, which count them.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not counted():
        m = sub.expect(1, timeout=deadline - time.monotonic())[0]
        got[m.topic] = m.payload
    assert got["$SYS/broker/uptime"].endswith(b"seconds")
    assert int(got["$SYS/broker/clients/connected"]) >= 1
    assert int(got["$SYS/broker/store/bytes"]) > 0
    sub.disconnect()


def test_mqtt_31_connect(shared_server) -> None:
    c = Client(shared_server.port, uid("old"), version=3)
    topic = uid("v31")
    c.subscribe(topic, 1)
    c.publish(topic, b"legacy", 1)
    assert c.expect(1)[0].payload == b"legacy"
    c.disconnect()
