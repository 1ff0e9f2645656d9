"""Separated mode: one `lightgate store`, two `lightgate gateway`s and a real Redis."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from gateway import mqtt
from store import protocol as p
from tests.conftest import RedisServer, Server
from tests.mqtt.paho_client import Client
from tests.mqtt.raw import RawClient
from tests.mqtt.test_paho_v5 import connect_props
from tests.native.test_protocol import Raw
from tests.proc import pause
from tests.separated.conftest import uid


def test_device_on_a_reaches_wildcard_subscriber_on_b(cluster) -> None:
    store, (a, b), _ = cluster
    base = uid("plant")
    sub = Client(b.port, uid("sub"))
    sub.subscribe(f"{base}/+/temp", 1)
    pub = Client(a.port, uid("pub"))
    for i in range(20):
        pub.publish(f"{base}/m{i % 3}/temp", b"%02d" % i, 1)
    assert [m.payload for m in sub.expect(20)] == [b"%02d" % i for i in range(20)]
    sub.disconnect()
    pub.disconnect()


def test_only_gateways_subscribe_to_redis(cluster) -> None:
    """The store publishes what grew and reads nothing back: every batch of every node
    would otherwise be read, decoded and handed to its event loop for nothing."""
    import redis

    _, gateways, redis_server = cluster
    raw = redis.Redis.from_url(redis_server.url)
    try:
        assert raw.pubsub_numsub("lightgate:notify") == [(b"lightgate:notify", len(gateways))]
    finally:
        raw.close()


def test_a_gateways_own_publishes_reach_its_subscribers_without_the_bus(tmp_path) -> None:
    """A gateway whose append the store acknowledged delivers it to its own subscribers
    from its cache at once, not when the store's notify comes back through Redis: here
    the store tells another Redis than the gateway's, so nothing ever comes back."""
    theirs, ours = RedisServer().start(), RedisServer().start()
    store = Server(tmp_path / "store", "--notify", theirs.url, command="store").start()
    gw = Server(None, "--store", store.native, "--notify", ours.url, command="gateway").start()
    try:
        base = uid("here")
        sub = Client(gw.port, uid("sub"))
        sub.subscribe(f"{base}/+", 1)
        pub = Client(gw.port, uid("pub"))
        for i in range(5):
            pub.publish(f"{base}/d{i}", b"%d" % i, 1)
        assert sorted(m.payload for m in sub.expect(5, timeout=5)) == [b"%d" % i
                                                                       for i in range(5)]
        sub.disconnect()
        pub.disconnect()
    finally:
        for srv in (gw, store):
            if srv.proc is not None:
                srv.stop()
        theirs.stop()
        ours.stop()


def test_persistent_session_moves_from_a_to_b_without_loss(cluster) -> None:
    store, (a, b), _ = cluster
    topic = uid("cmd") + "/dev1"
    cid = uid("dev")
    dev = Client(a.port, cid, clean=False)
    dev.subscribe(topic, 1)
    pub = Client(a.port, uid("pub"))
    pub.publish(topic, b"on-a", 1)
    assert dev.expect(1)[0].payload == b"on-a"
    dev.disconnect()
    for i in range(5):
        pub.publish(topic, b"offline-%d" % i, 1)
    dev = Client(b.port, cid, clean=False)  # the device comes back on the other gateway
    assert dev.connack[0] is True
    assert [m.payload for m in dev.expect(5)] == [b"offline-%d" % i for i in range(5)]
    pub.publish(topic, b"live-on-b", 1)
    assert dev.expect(1)[0].payload == b"live-on-b"
    dev.expect_none(0.3)
    dev.disconnect()
    pub.disconnect()


def test_a_session_that_moves_before_its_gateway_took_its_end_in(cluster) -> None:
    """The device acknowledges a message on gateway A and leaves; A is stopped before it
    takes that in, and the device comes back on B at once. B waits for A to release the
    session (what A kept once it took the acknowledgement and the DISCONNECT in), so the
    acknowledged message does not come again, and nothing is lost."""
    _, (a, b), _ = cluster
    topic = uid("cmd") + "/dev1"
    cid = uid("dev")
    dev = Client(a.port, cid, clean=False)
    dev.subscribe(topic, 1)
    pub = Client(b.port, uid("pub"))
    pub.publish(topic, b"on-a", 1)
    assert dev.expect(1)[0].payload == b"on-a"
    assert a.proc is not None
    pause(a.proc.pid)  # its PUBACK and DISCONNECT wait in A's socket
    try:
        dev.disconnect()
        for i in range(3):
            pub.publish(topic, b"offline-%d" % i, 1)
        threading.Timer(0.5, os.kill, (a.proc.pid, signal.SIGCONT)).start()
        dev = Client(b.port, cid, clean=False)
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    assert dev.connack[0] is True
    assert [m.payload for m in dev.expect(3)] == [b"offline-%d" % i for i in range(3)]
    dev.expect_none(0.3)
    dev.disconnect()
    pub.disconnect()


@pytest.mark.parametrize("version", [4, 5])
def test_a_session_still_connected_on_a_is_taken_over_by_its_client_on_b(
        cluster, version: int) -> None:
    """The device's old connection on A is still up (a device that roamed leaves it
    half-open) when it connects on B: A closes it as a takeover (MQTT 5: DISCONNECT
    0x8E), B resumes the session at once rather than after A's keepalive or B's wait,
    and what is published next reaches the device once, on B."""
    _, (a, b), _ = cluster
    topic = uid("cmd") + "/dev1"
    cid = uid("dev")
    old = Client(a.port, cid, clean=False, clean_start=False, version=version,
                 properties=connect_props(SessionExpiryInterval=600) if version == 5 else None)
    old.subscribe(topic, 1)
    pub = Client(b.port, uid("pub"))
    pub.publish(topic, b"on-a", 1)
    assert old.expect(1)[0].payload == b"on-a"
    started = time.monotonic()
    new = Client(b.port, cid, clean=False, clean_start=False, version=version,
                 properties=connect_props(SessionExpiryInterval=600) if version == 5 else None)
    took = time.monotonic() - started
    assert new.connack[0] is True  # the session, with its subscription
    assert old.disconnected.wait(5), "A kept the old connection"
    if version == 5:
        assert old.disconnect_reason == 0x8E  # Session taken over
    assert took < 1.5, f"B waited {took:.2f} s for A to release the session"
    assert a.wait_log("connected on another gateway")
    pub.publish(topic, b"on-b", 1)
    assert new.expect(1)[0].payload == b"on-b"
    new.expect_none(0.3)
    assert old.messages.empty()
    new.disconnect()
    pub.disconnect()


@pytest.mark.parametrize("version", [4, 5])
def test_a_clean_sessions_connection_on_a_is_closed_when_its_client_connects_on_b(
        cluster, version: int) -> None:
    """A clean session keeps nothing, but its client id still names one connection:
    the device's new connection on B makes A close the old one (MQTT 5: DISCONNECT
    0x8E) and publish its will, at once rather than at A's keepalive. Both stayed up
    before, and the old one's end on A later deleted whatever B then held under the
    client id."""
    store, (a, b), _ = cluster
    cid, will_topic = uid("dev"), uid("will") + "/dev"
    watcher = Client(b.port, uid("watch"))
    watcher.subscribe(will_topic, 1)
    old = Client(a.port, cid, version=version, will=(will_topic, b"gone", 1, False))
    started = time.monotonic()
    new = Client(b.port, cid, version=version)
    took = time.monotonic() - started
    assert new.connack[0] is False  # clean: nothing resumed
    assert old.disconnected.wait(5), "A kept the old connection"
    if version == 5:
        assert old.disconnect_reason == 0x8E  # Session taken over
    assert took < 1.5, f"B waited {took:.2f} s for A to close the old connection"
    assert watcher.expect(1)[0].payload == b"gone"
    # The new connection is the one left: it works, and A's end of the old one did not
    # take B's claim away (a third connection on A closes B's, as MQTT says).
    new.subscribe(will_topic, 1)
    watcher.publish(will_topic, b"after", 1)
    assert new.expect(1)[0].payload == b"after"
    again = Client(a.port, cid, version=version)
    assert new.disconnected.wait(5), "B kept the replaced connection"
    raw = Raw(store.native)
    assert raw.call(p.META_GET, {"cf": "sessions", "key": cid}).header["value"]["expiry"] == 0
    again.disconnect()
    deadline = time.monotonic() + 5
    while raw.call(p.META_GET, {"cf": "sessions", "key": cid}).header.get("value"):
        assert time.monotonic() < deadline, "a clean session's record outlived it"
        time.sleep(0.05)
    watcher.disconnect()


def test_a_session_back_on_a_after_b_is_what_b_left(cluster) -> None:
    """A→B→A: A kept its copy of the session when the device left it; on B the device
    subscribed to more. Back on A it gets the session as B left it (the store's), not
    A's older copy: a message to B's subscription reaches it."""
    _, (a, b), _ = cluster
    base, cid = uid("roam"), uid("dev")
    dev = Client(a.port, cid, clean=False)
    dev.subscribe(f"{base}/on-a", 1)
    dev.disconnect()
    dev = Client(b.port, cid, clean=False)
    assert dev.connack[0] is True
    dev.subscribe(f"{base}/on-b", 1)
    dev.disconnect()
    dev = Client(a.port, cid, clean=False)
    assert dev.connack[0] is True
    pub = Client(b.port, uid("pub"))
    pub.publish(f"{base}/on-b", b"b", 1)
    pub.publish(f"{base}/on-a", b"a", 1)
    assert sorted(m.payload for m in dev.expect(2)) == [b"a", b"b"]
    dev.disconnect()
    pub.disconnect()


def test_a_gateways_old_copy_expiring_leaves_the_session_its_client_resumed_elsewhere(
        cluster) -> None:
    """A session with a 2 s expiry leaves A and is resumed on B at once. When A's copy
    expires it is only dropped: it used to be discarded from the store, deleting the
    session B serves (its subscriptions and positions)."""
    _, (a, b), _ = cluster
    topic, cid = uid("exp") + "/cmd", uid("dev")
    dev = Client(a.port, cid, clean=False, clean_start=False, version=5,
                 properties=connect_props(SessionExpiryInterval=2))
    dev.subscribe(topic, 1)
    dev.disconnect()
    dev = Client(b.port, cid, clean=False, clean_start=False, version=5,
                 properties=connect_props(SessionExpiryInterval=2))
    assert dev.connack[0] is True
    time.sleep(3)  # A's copy expires meanwhile
    dev.disconnect()
    dev = Client(a.port, cid, clean=False, clean_start=False, version=5,
                 properties=connect_props(SessionExpiryInterval=2))
    assert dev.connack[0] is True  # kept: resumed from the store's record
    pub = Client(b.port, uid("pub"))
    pub.publish(topic, b"still-subscribed", 1)
    assert dev.expect(1)[0].payload == b"still-subscribed"
    dev.disconnect()
    pub.disconnect()


def test_a_delayed_will_is_not_sent_once_its_device_is_back_on_another_gateway(
        cluster) -> None:
    """A v5 device with a 2 s will delay vanishes from A and is back on B within it:
    A's will timer finds the session resumed elsewhere (the record's claim is B's) and
    sends nothing, as one broker would not [MQTT-3.1.3-9]. Gone for good, a device's
    will comes as before."""
    _, (a, b), _ = cluster
    topic, cid = uid("wd"), uid("dev")
    watcher = Client(b.port, uid("w"), version=5)
    watcher.subscribe(topic, 1)
    will = mqtt.Will(topic, b"gone", 1, False, {"will_delay_interval": 2})
    dev = RawClient(a.port, version=5)
    dev.connect(cid, clean=False, will=will, properties={"session_expiry_interval": 60})
    dev.close()  # abnormal: A's will waits 2 s ...
    time.sleep(0.5)
    dev = RawClient(b.port, version=5)  # ... and the device is back in time, on B
    dev.connect(cid, clean=False, will=will, properties={"session_expiry_interval": 60})
    watcher.expect_none(3)
    dev.close()  # gone for good: B's will comes
    [m] = watcher.expect(1, timeout=6)
    assert m.payload == b"gone"
    watcher.disconnect()


def test_redis_down_falls_back_to_polling_and_push_resumes(cluster) -> None:
    store, (a, b), redis = cluster
    topic = uid("rd") + "/x"
    sub = Client(b.port, uid("sub"))
    sub.subscribe(topic, 1)
    pub = Client(a.port, uid("pub"))
    sent = 0
    for _ in range(10):
        pub.publish(topic, b"%03d" % sent, 1)
        sent += 1
    redis.stop()  # mid-stream
    for _ in range(30):
        pub.publish(topic, b"%03d" % sent, 1)
        sent += 1
        time.sleep(0.02)
    got = [m.payload for m in sub.expect(sent, timeout=20)]
    assert got == [b"%03d" % i for i in range(sent)]  # none lost, in order, while polling
    assert b.wait_log("polling queue ends")
    redis.start()  # same port
    assert b.wait_log("notify is back", timeout=15)
    for _ in range(10):
        pub.publish(topic, b"%03d" % sent, 1)
        sent += 1
    got = [m.payload for m in sub.expect(10, timeout=10)]
    assert got == [b"%03d" % i for i in range(sent - 10, sent)]
    sub.disconnect()
    pub.disconnect()


def test_gateways_find_each_other_through_the_store(cluster) -> None:
    store, gateways, _ = cluster
    c = Raw(store.native)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        listed = c.call(p.GATEWAY_LIST, {}).header["gateways"]
        if len(listed) == 2:
            break
        time.sleep(0.2)
    mqtt_addrs = sorted(info["mqtt"] for info in listed.values())
    assert mqtt_addrs == sorted(g.addrs["mqtt"] for g in gateways)


def test_store_restart_is_survived_by_gateways(cluster) -> None:
    """Devices keep their gateway connections; QoS 1 publishes during the outage get a
    clear error (v5 PUBACK 0x80), and once the store is back everything flows again."""
    store, (a, b), _ = cluster
    topic = uid("sr")
    sub = Client(b.port, uid("sub"))
    sub.subscribe(topic, 1)
    pub = RawClient(a.port, version=5)
    pub.connect(uid("pub"))
    pub.send(mqtt.Publish(topic, b"before", qos=1, packet_id=1))
    assert pub.recv().reason_code == 0
    assert sub.expect(1)[0].payload == b"before"
    assert store.stop() == 0
    pub.send(mqtt.Publish(topic, b"during", qos=1, packet_id=2))
    refused = pub.recv()
    assert isinstance(refused, mqtt.Puback) and refused.reason_code == 0x80
    assert "store" in refused.properties["reason_string"].lower()
    store.start()  # same port, same data
    deadline = time.monotonic() + 15
    pid = 3
    while time.monotonic() < deadline:
        pub.send(mqtt.Publish(topic, b"after", qos=1, packet_id=pid))
        if pub.recv().reason_code == 0:
            break
        pid += 1
        time.sleep(0.3)
    assert [m.payload for m in sub.expect(1, timeout=15)] == [b"after"]
    sub.disconnect()
    pub.close()


def test_qos2_resend_checks_the_store_over_the_network(cluster) -> None:
    """A DUP QoS 2 resend is checked against the store's key index (the packet id the
    record carries) through the native protocol: a stored one is not stored again."""
    store, (a, b), _ = cluster
    topic = uid("q2") + "/x"
    watcher = RawClient(b.port)
    watcher.connect(uid("watch"))
    watcher.subscribe(topic, 1)
    cid = uid("q2pub")
    c = RawClient(a.port)
    c.connect(cid, clean=False)
    c.send(mqtt.Publish(topic, b"once", qos=2, dup=True, packet_id=3))  # new: stored
    assert isinstance(c.recv(), mqtt.Pubrec)
    c.close()  # the session (on b now) has the exchange; a resend of it is a duplicate
    c = RawClient(b.port)
    c.connect(cid, clean=False)
    c.send(mqtt.Publish(topic, b"once", qos=2, dup=True, packet_id=3))
    assert isinstance(c.recv(), mqtt.Pubrec)
    c.send(mqtt.Pubrel(3))
    assert isinstance(c.recv(), mqtt.Pubcomp)
    got = watcher.recv()
    assert isinstance(got, mqtt.Publish) and got.payload == b"once"
    watcher.send(mqtt.Puback(got.packet_id))
    watcher.sock.settimeout(1.0)
    with pytest.raises(TimeoutError):
        watcher.recv()
    c.close()


def test_gateway_started_before_its_store_waits_and_then_serves(tmp_path,
                                                               redis_server: RedisServer) -> None:
    """As a compose file starting everything at once does: the gateway waits for its
    store, says so, and serves once the store is up, without a restart."""
    store = Server(tmp_path / "store", "--notify", redis_server.url, command="store")
    gw = Server(None, "--store", f"127.0.0.1:{store.native_port}", "--notify",
                redis_server.url, command="gateway")
    failed: list[BaseException] = []

    def start() -> None:
        try:
            gw.start()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failed.append(exc)

    starter = threading.Thread(target=start, daemon=True)
    starter.start()
    try:
        time.sleep(3.0)
        assert gw.proc is not None and gw.proc.poll() is None, failed
        assert starter.is_alive(), "ready without a store"
        store.start()
        starter.join(30)
        assert not starter.is_alive() and not failed, failed
        assert gw.wait_log("waiting for the store")  # read by a thread: a moment later
        sub = Client(gw.port, uid("sub"))
        sub.subscribe("late/+", 1)
        pub = Client(gw.port, uid("pub"))
        pub.publish("late/1", b"x", 1)
        assert sub.expect(1)[0].payload == b"x"
        sub.disconnect()
        pub.disconnect()
    finally:
        for srv in (gw, store):
            if srv.proc is not None:
                assert srv.stop() == 0, srv.logs()[-2000:]
