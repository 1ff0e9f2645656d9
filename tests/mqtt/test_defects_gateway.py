"""Regressions for defects found in the gateway, each driven over a real socket (or, where a
message that the store would now refuse must be injected, over an in-memory stream in
front of a real Broker and EmbeddedStore)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import trio
import trio.testing

from gateway import mqtt
from gateway.broker import Broker, GatewayConfig
from gateway.connection import Connection
from gateway.mqtt import reason as rc
from store.record import Message
from store.service import EmbeddedStore, StoreConfig
from tests.mqtt.raw import RawClient

# -- 2: everything sent before DISCONNECT is processed completely ---------------------


def _one_write(port: int, packets: list[object], version: int) -> None:
    """CONNECT, ..., DISCONNECT in a single write, then wait for the server's close."""
    data = b"".join(mqtt.encode(p, version) for p in packets)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(data)
        try:
            while sock.recv(65536):
                pass
        except (ConnectionResetError, TimeoutError):
            pass


def _retained_topics(port: int, topic_filter: str, expect: int, version: int = 4) -> set[str]:
    sub = RawClient(port, version=version, timeout=1.0)
    sub.connect("retained-reader")
    sub.subscribe(topic_filter, 1)
    got: set[str] = set()
    deadline = time.monotonic() + 5
    while len(got) < expect and time.monotonic() < deadline:
        try:
            p = sub.recv()
        except TimeoutError:
            continue
        if isinstance(p, mqtt.Publish):
            if p.retain:  # (a live copy may follow a message stored a moment ago)
                got.add(p.topic)
            if p.qos == 1:
                sub.send(mqtt.Puback(p.packet_id))
    sub.close()
    return got


def test_retained_publish_followed_at_once_by_disconnect_is_kept(server) -> None:
    """What `mosquitto_pub -r` does at QoS 0: CONNECT + PUBLISH(retain) + DISCONNECT in
    one write. Every topic's retained message must be kept, whatever its QoS."""
    topics = []
    for i in range(30):
        qos = i % 3
        topic = f"ret/{qos}/{i}"
        topics.append(topic)
        version = 5 if i % 2 else 4
        pub = mqtt.Publish(topic, f"v{i}".encode(), qos, True, False, 1 if qos else None)
        _one_write(server.port, [mqtt.Connect(f"pub-{i}", protocol_level=version), pub,
                                 mqtt.Disconnect()], version)
    assert _retained_topics(server.port, "ret/#", len(topics)) == set(topics)


# -- 5: server topic aliases only where a resend cannot carry them to a new connection --


def test_qos1_message_with_expiry_is_resent_with_its_topic_after_reconnect(server) -> None:
    sub = RawClient(server.port, version=5)
    sub.connect("alias-sub", clean=False, properties={"session_expiry_interval": 600,
                                                      "topic_alias_maximum": 10})
    sub.subscribe("alias/t", 1)
    pub = RawClient(server.port, version=5)
    pub.connect("alias-pub")
    for i in range(3):
        pub.send(mqtt.Publish("alias/t", b"m%d" % i, 1, False, False, i + 1,
                              {"message_expiry_interval": 300}))
        assert isinstance(pub.recv(), mqtt.Puback)
    first = [sub.recv() for _ in range(3)]  # not acknowledged
    assert all(isinstance(p, mqtt.Publish) and p.qos == 1 for p in first)
    sub.close()
    again = RawClient(server.port, version=5)
    ack = again.connect("alias-sub", clean=False,
                        properties={"session_expiry_interval": 600})
    assert ack.session_present
    resent = [again.recv() for _ in range(3)]
    for p in resent:
        assert isinstance(p, mqtt.Publish) and p.dup
        assert p.topic == "alias/t", p
        assert "topic_alias" not in p.properties, p
        again.send(mqtt.Puback(p.packet_id))
    again.send(mqtt.Disconnect(properties={"session_expiry_interval": 0}))
    again.close()
    pub.close()


def test_alias_of_a_dropped_oversize_message_is_not_used(server) -> None:
    """A message too large for the client is dropped; the alias it would have set up
    must not be used for the next message on that topic."""
    sub = RawClient(server.port, version=5)
    sub.connect("alias-small", properties={"topic_alias_maximum": 5,
                                           "maximum_packet_size": 200})
    sub.subscribe("big/t", 0)
    pub = RawClient(server.port, version=5)
    pub.connect("alias-big-pub")
    pub.send(mqtt.Publish("big/t", b"x" * 500, 0))
    pub.send(mqtt.Publish("big/t", b"small", 0))
    p = sub.recv()
    assert isinstance(p, mqtt.Publish) and p.payload == b"small"
    assert p.topic == "big/t", p  # the client never learnt an alias for it
    sub.close()
    pub.close()


# -- 6: Receive Maximum counts a QoS 2 exchange once, until PUBCOMP ---------------------


def _receive_maximum(ack: object) -> int:
    return ack.properties.get("receive_maximum", 65535)


def test_receive_maximum_holds_after_complete_qos2_exchanges(server) -> None:
    c = RawClient(server.port, version=5)
    limit = _receive_maximum(c.connect("rm-qos2"))
    for i in range(100):
        pid = i % 1000 + 1
        c.send(mqtt.Publish("rm/t", b"x", 2, False, False, pid))
        assert isinstance(c.recv(), mqtt.Pubrec)
        c.send(mqtt.Pubrel(pid))
        assert isinstance(c.recv(), mqtt.Pubcomp)
    # A burst of limit + 1 QoS 1 publishes in one write: more than the server allows
    # unacknowledged, since it acknowledges none before the batch is stored.
    c.send_raw(b"".join(mqtt.encode(mqtt.Publish("rm/t", b"y", 1, False, False, 2000 + i), 5)
                        for i in range(limit + 1)))
    seen = []
    try:
        while True:
            p = c.recv()
            seen.append(p)
            if isinstance(p, mqtt.Disconnect):
                break
    except ConnectionError:
        pass
    assert any(isinstance(p, mqtt.Disconnect) and p.reason_code == rc.RECEIVE_MAXIMUM_EXCEEDED
               for p in seen), seen[-3:]


def test_unreleased_qos2_publishes_count_against_receive_maximum(server) -> None:
    """MQTT 5 §4.9: a QoS 2 PUBLISH counts until the server's PUBCOMP, so a client that
    never sends PUBREL is cut off at Receive Maximum + 1."""
    c = RawClient(server.port, version=5)
    limit = _receive_maximum(c.connect("rm-norel"))
    for pid in range(1, limit + 1):
        c.send(mqtt.Publish("rm/q2", b"x", 2, False, False, pid))
        assert isinstance(c.recv(), mqtt.Pubrec)
    c.send(mqtt.Publish("rm/q2", b"x", 2, False, False, limit + 1))
    p = c.recv()
    assert isinstance(p, mqtt.Disconnect) and p.reason_code == rc.RECEIVE_MAXIMUM_EXCEEDED, p


# -- resend after a reconnect respects the new Receive Maximum ------------------------


def test_resend_after_reconnect_respects_new_receive_maximum(server) -> None:
    sub = RawClient(server.port, version=5)
    sub.connect("rm-resend", clean=False, properties={"session_expiry_interval": 600})
    sub.subscribe("rs/t", 1)
    pub = RawClient(server.port, version=5)
    pub.connect("rm-resend-pub")
    for i in range(10):
        pub.send(mqtt.Publish("rs/t", b"%d" % i, 1, False, False, i + 1))
        assert isinstance(pub.recv(), mqtt.Puback)
    got = [sub.recv() for _ in range(10)]  # none acknowledged
    assert len(got) == 10
    sub.close()
    again = RawClient(server.port, version=5, timeout=1.0)
    again.connect("rm-resend", clean=False, properties={"session_expiry_interval": 600,
                                                        "receive_maximum": 3})
    first = [again.recv() for _ in range(3)]
    try:
        extra = again.recv()
    except TimeoutError:
        extra = None
    assert extra is None, f"a 4th unacknowledged PUBLISH with Receive Maximum 3: {extra}"
    payloads = [p.payload for p in first]
    for p in first:
        again.send(mqtt.Puback(p.packet_id))
    while len(payloads) < 10:
        p = again.recv()
        payloads.append(p.payload)
        again.send(mqtt.Puback(p.packet_id))
    assert payloads == [b"%d" % i for i in range(10)]
    again.send(mqtt.Disconnect(properties={"session_expiry_interval": 0}))
    again.close()
    pub.close()


# -- clients may not publish to $SYS ---------------------------------------------------


def test_client_cannot_overwrite_sys_topics(server) -> None:
    pub = RawClient(server.port, version=5)
    pub.connect("sys-writer")
    pub.send(mqtt.Publish("$SYS/broker/uptime", b"hacked", 1, True, False, 1))
    ack = pub.recv()
    assert isinstance(ack, mqtt.Puback) and ack.reason_code == rc.NOT_AUTHORIZED, ack
    v3 = RawClient(server.port, version=4)
    v3.connect("sys-writer-3")
    v3.send(mqtt.Publish("$SYS/broker/uptime", b"hacked", 0, True))
    v3.send(mqtt.Publish("$SYS/broker/uptime", b"hacked", 1, True, False, 2))
    assert isinstance(v3.recv(), mqtt.Puback)  # 3.1.1 has no negative ack: dropped
    time.sleep(1.2)  # a $SYS round (--sys-interval 1) would have overwritten it anyway
    sub = RawClient(server.port, version=4, timeout=2.0)
    sub.connect("sys-reader")
    sub.subscribe("$SYS/broker/uptime", 0)
    p = sub.recv()
    assert isinstance(p, mqtt.Publish) and p.payload != b"hacked"
    pub.close()
    v3.close()
    sub.close()


# -- 4 (gateway side): a delivery loop never dies on one message ------------------------


async def _read_packets(stream: trio.abc.Stream, decoder: mqtt.Decoder, want: int,
                        timeout: float = 5.0) -> list[object]:
    got: list[object] = []
    with trio.move_on_after(timeout):
        while len(got) < want:
            data = await stream.receive_some(65536)
            if not data:
                break
            got.extend(decoder.feed(data))
    return got


async def test_delivery_survives_a_message_it_cannot_encode(tmp_path: Path) -> None:
    cfg = StoreConfig(data_dir=tmp_path / "data")
    broker: Broker | None = None

    def notify(names: set[str]) -> None:
        if broker is not None:
            token.run_sync_soon(broker.on_queues_changed, names)

    token = trio.lowlevel.current_trio_token()
    async with EmbeddedStore.open(cfg, notify=notify) as store, trio.open_nursery() as n:
        broker = Broker(store, GatewayConfig())
        await n.start(broker.run_connections)
        await n.start(broker.run_housekeeping)
        client, server = trio.testing.memory_stream_pair()
        conn = Connection(broker, server, "test:1")
        n.start_soon(conn.run_stream)
        dec = mqtt.Decoder(server=False, version=5)
        await client.send_all(mqtt.encode(mqtt.Connect("bad-msg", protocol_level=5), 5))
        await client.send_all(mqtt.encode(
            mqtt.Subscribe(1, [("bad/t", mqtt.SubscriptionOptions(1))]), 5))
        got = await _read_packets(client, dec, 2)
        assert isinstance(got[-1], mqtt.Suback), got
        # Messages the store's own validation would refuse today, written below it: an
        # invalid QoS and a property no PUBLISH can carry.
        bad = [Message("bad/t", b"q3", qos=3),
               Message("bad/t", b"props", qos=1, properties={"payload_format_indicator": 9})]
        for m in bad:
            await trio.to_thread.run_sync(store.publish_start([m]).result)
        await trio.to_thread.run_sync(
            store.publish_start([Message("bad/t", b"good", qos=1)]).result)
        got = await _read_packets(client, dec, 1)
        assert [p.payload for p in got if isinstance(p, mqtt.Publish)] == [b"good"], got
        assert conn.alive
        await client.send_all(mqtt.encode(mqtt.Disconnect(), 5))
        n.cancel_scope.cancel()


# -- an unexpected error is not reported as a shutdown ----------------------------------


async def test_internal_error_is_not_answered_as_server_shutting_down(tmp_path: Path) -> None:
    cfg = StoreConfig(data_dir=tmp_path / "data")
    async with EmbeddedStore.open(cfg) as store, trio.open_nursery() as n:
        broker = Broker(store, GatewayConfig())
        await n.start(broker.run_connections)
        await n.start(broker.run_housekeeping)

        async def broken(*_a: object) -> bool:
            raise KeyError("a bug")

        broker.unsubscribe = broken  # type: ignore[method-assign]
        client, server = trio.testing.memory_stream_pair()
        conn = Connection(broker, server, "test:2")
        n.start_soon(conn.run_stream)
        dec = mqtt.Decoder(server=False, version=5)
        await client.send_all(mqtt.encode(mqtt.Connect("oops", protocol_level=5), 5))
        await client.send_all(mqtt.encode(mqtt.Unsubscribe(1, ["x"]), 5))
        got = await _read_packets(client, dec, 2)
        assert isinstance(got[-1], mqtt.Disconnect), got
        assert got[-1].reason_code == rc.UNSPECIFIED_ERROR, got[-1]
        n.cancel_scope.cancel()


# -- 7: simultaneous CONNECTs with one client id: only the last survives ------------------


def test_simultaneous_connects_with_one_client_id_leave_exactly_one(server) -> None:
    import httpx

    for round_ in range(5):
        cid = f"twin-{round_}"
        socks = []
        for i in range(6):
            version = 5 if i % 2 else 4
            s = socket.create_connection(("127.0.0.1", server.port), timeout=3)
            socks.append((s, version))
        # All CONNECTs as close together as the sockets allow.
        for s, version in socks:
            s.sendall(mqtt.encode(mqtt.Connect(cid, protocol_level=version,
                                               clean_start=round_ % 2 == 0), version))
        time.sleep(1.0)
        alive = []
        for s, version in socks:
            s.settimeout(0.3)
            dec = mqtt.Decoder(server=False, version=version)
            got: list[object] = []
            closed = False
            try:
                while True:
                    data = s.recv(65536)
                    if not data:
                        closed = True
                        break
                    got.extend(dec.feed(data))
            except TimeoutError:
                pass
            except ConnectionResetError:
                closed = True
            if not closed:
                s.sendall(mqtt.encode(mqtt.Pingreq(), version))
                try:
                    data = s.recv(65536)
                    closed = not data
                except (TimeoutError, ConnectionResetError):
                    closed = True
            if not closed:
                alive.append(s)
        assert len(alive) == 1, f"round {round_}: {len(alive)} connections stayed"
        clients = httpx.get(f"http://{server.addrs['http']}/api/v1/clients",
                            params={"q": cid}).json()
        assert [c["client_id"] for c in clients["items"]] == [cid], clients
        for s, _ in socks:
            s.close()


# -- suspicion: a shared group's loop and its failed pushes --------------------------------


async def _member(broker: Broker, nursery: trio.Nursery, cid: str, name: str
                  ) -> tuple[trio.abc.Stream, mqtt.Decoder, Connection]:
    client, server = trio.testing.memory_stream_pair()
    conn = Connection(broker, server, f"test:{cid}")
    nursery.start_soon(conn.run_stream)
    dec = mqtt.Decoder(server=False, version=5)
    await client.send_all(mqtt.encode(mqtt.Connect(cid, protocol_level=5), 5))
    await client.send_all(mqtt.encode(
        mqtt.Subscribe(1, [(f"$share/{name}/sh/t", mqtt.SubscriptionOptions(1))]), 5))
    got = await _read_packets(client, dec, 2)
    assert isinstance(got[-1], mqtt.Suback), got
    return client, dec, conn


async def _payloads(members: list[tuple[trio.abc.Stream, mqtt.Decoder, Connection]],
                    want: int, timeout: float = 6.0) -> list[bytes]:
    """Publishes received by any member (each acknowledged), until `want` or timeout."""
    out: list[bytes] = []
    with trio.move_on_after(timeout):
        while len(out) < want:
            for client, dec, _ in members:
                with trio.move_on_after(0.05):
                    data = await client.receive_some(65536)
                    for pk in dec.feed(data):
                        if isinstance(pk, mqtt.Publish):
                            out.append(pk.payload)
                            await client.send_all(mqtt.encode(mqtt.Puback(pk.packet_id), 5))
    return out


async def _store_and_broker(tmp_path: Path, nursery: trio.Nursery) -> tuple[Broker, object]:
    token = trio.lowlevel.current_trio_token()
    holder: list[Broker] = []

    def notify(names: set[str]) -> None:
        if holder:
            token.run_sync_soon(holder[0].on_queues_changed, names)

    store = await nursery.start(_run_store, tmp_path, notify)
    broker = Broker(store, GatewayConfig())
    holder.append(broker)
    await nursery.start(broker.run_connections)
    await nursery.start(broker.run_housekeeping)
    return broker, store


async def _run_store(tmp_path: Path, notify: object, task_status=trio.TASK_STATUS_IGNORED
                     ) -> None:
    async with EmbeddedStore.open(StoreConfig(data_dir=tmp_path / "data"),
                                  notify=notify) as store:
        task_status.started(store)
        await trio.sleep_forever()


async def _publish(store: object, body: bytes) -> None:
    await trio.to_thread.run_sync(
        store.publish_start([Message("sh/t", body, qos=1)]).result)


async def test_shared_message_refused_by_a_live_member_is_not_left_pending(
        tmp_path: Path, monkeypatch) -> None:
    async with trio.open_nursery() as n:
        broker, store = await _store_and_broker(tmp_path, n)
        a = await _member(broker, n, "sh-a", "g1")
        b = await _member(broker, n, "sh-b", "g1")
        original = Connection.push_shared
        failures = []

        async def flaky(self: Connection, group, msg, buffered: bool = False) -> bool:
            if self is a[2] and not failures:
                failures.append(msg.body)
                raise RuntimeError("push failed")
            return await original(self, group, msg, buffered)

        monkeypatch.setattr(Connection, "push_shared", flaky)
        await _publish(store, b"m1")
        await trio.sleep(0.2)
        await _publish(store, b"m2")  # a wake-up: the refused one goes out first
        got = await _payloads([a, b], 2)
        assert failures and sorted(got) == [b"m1", b"m2"], (failures, got)
        group = next(iter(broker.groups.values()))
        with trio.fail_after(3):
            while group.pending:
                await trio.sleep(0.05)
        n.cancel_scope.cancel()


async def test_an_unexpected_error_in_a_shared_group_does_not_end_the_broker(
        tmp_path: Path, monkeypatch) -> None:
    async with trio.open_nursery() as n:
        broker, store = await _store_and_broker(tmp_path, n)
        a = await _member(broker, n, "sh-c", "g2")
        original = type(broker.cache).pull
        calls = []

        async def broken_once(self, queue, offset, count):
            if queue == "sh/t" and not calls:
                calls.append(1)
                raise RuntimeError("a bug in the cache")
            return await original(self, queue, offset, count)

        monkeypatch.setattr(type(broker.cache), "pull", broken_once)
        await _publish(store, b"after-bug")
        got = await _payloads([a], 1, timeout=5)
        assert calls and got == [b"after-bug"], (calls, got)
        n.cancel_scope.cancel()


# -- the connect timeout shares the connection's scope ----------------------------------


async def test_a_socket_that_sends_no_connect_is_closed_in_time(tmp_path: Path) -> None:
    async with EmbeddedStore.open(StoreConfig(data_dir=tmp_path / "data")) as store, \
            trio.open_nursery() as n:
        broker = Broker(store, GatewayConfig(connect_timeout=0.3))
        await n.start(broker.run_connections)
        await n.start(broker.run_housekeeping)
        client, server = trio.testing.memory_stream_pair()
        t0 = trio.current_time()  # the CONNECT timeout runs from the connection's start
        silent = Connection(broker, server, "test:silent")
        with trio.fail_after(5):
            await silent.run_stream()
        assert 0.3 <= trio.current_time() - t0 < 2.0
        assert await client.receive_some(10) == b""  # closed, nothing said: no CONNECT

        # One that connects in time (keepalive 0: no deadline at all) outlives it.
        client2, server2 = trio.testing.memory_stream_pair()
        ok = Connection(broker, server2, "test:ok")
        n.start_soon(ok.run_stream)
        await client2.send_all(mqtt.encode(mqtt.Connect("in-time", keepalive=0), 4))
        got = await _read_packets(client2, mqtt.Decoder(server=False, version=4), 1)
        assert isinstance(got[0], mqtt.Connack) and got[0].return_code == 0, got
        await trio.sleep(0.6)
        assert ok.alive
        await client2.send_all(mqtt.encode(mqtt.Pingreq(), 4))
        got = await _read_packets(client2, mqtt.Decoder(server=False, version=4), 1)
        assert isinstance(got[0], mqtt.Pingresp), got
        n.cancel_scope.cancel()
