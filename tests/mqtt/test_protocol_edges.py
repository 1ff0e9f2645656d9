"""Protocol edge cases over raw sockets: QoS 2 exactly-once across reconnects, DUP
redelivery, malformed input, limits."""

from __future__ import annotations

import uuid

from gateway import mqtt
from tests.mqtt.paho_client import Client
from tests.mqtt.raw import RawClient


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def test_inbound_qos2_is_stored_once_across_a_reconnect(shared_server) -> None:
    topic = uid("eo")
    watcher = Client(shared_server.port, uid("w"))
    watcher.subscribe(topic, 2)
    cid = uid("dev")
    dev = RawClient(shared_server.port)
    dev.connect(cid, clean=False)
    dev.send(mqtt.Publish(topic, b"once", qos=2, packet_id=7))
    assert dev.recv() == mqtt.Pubrec(7)
    dev.close()  # the PUBREC may have been lost: the device resends after reconnecting
    dev = RawClient(shared_server.port)
    assert dev.connect(cid, clean=False).session_present
    dev.send(mqtt.Publish(topic, b"once", qos=2, packet_id=7, dup=True))
    assert dev.recv() == mqtt.Pubrec(7)
    dev.send(mqtt.Pubrel(7))
    assert dev.recv() == mqtt.Pubcomp(7)
    assert [m.payload for m in watcher.expect(1)] == [b"once"]
    watcher.expect_none(0.5)
    # The packet id is free again: a new message with id 7 is a new message.
    dev.send(mqtt.Publish(topic, b"twice", qos=2, packet_id=7))
    assert dev.recv() == mqtt.Pubrec(7)
    dev.send(mqtt.Pubrel(7))
    assert dev.recv() == mqtt.Pubcomp(7)
    assert [m.payload for m in watcher.expect(1)] == [b"twice"]
    dev.close()
    watcher.disconnect()


def test_unacked_qos1_is_resent_with_dup_on_reconnect(shared_server) -> None:
    topic = uid("dup")
    cid = uid("dev")
    dev = RawClient(shared_server.port)
    dev.connect(cid, clean=False)
    dev.subscribe(topic, 1)
    pub = Client(shared_server.port, uid("p"))
    pub.publish(topic, b"m1", 1)
    first = dev.recv()
    assert isinstance(first, mqtt.Publish) and not first.dup and first.qos == 1
    dev.close()  # no PUBACK
    dev = RawClient(shared_server.port)
    assert dev.connect(cid, clean=False).session_present
    again = dev.recv()
    assert (again.payload, again.dup, again.packet_id) == (b"m1", True, first.packet_id)
    dev.send(mqtt.Puback(again.packet_id))
    pub.publish(topic, b"m2", 1)
    nxt = dev.recv()
    assert (nxt.payload, nxt.dup) == (b"m2", False)
    dev.send(mqtt.Puback(nxt.packet_id))
    dev.close()
    pub.disconnect()


def test_outbound_qos2_resumes_with_pubrel_not_a_second_publish(shared_server) -> None:
    topic = uid("q2o")
    cid = uid("dev")
    dev = RawClient(shared_server.port)
    dev.connect(cid, clean=False)
    dev.subscribe(topic, 2)
    pub = Client(shared_server.port, uid("p"))
    pub.publish(topic, b"exactly", 2)
    p = dev.recv()
    assert p.qos == 2
    dev.send(mqtt.Pubrec(p.packet_id))
    assert dev.recv() == mqtt.Pubrel(p.packet_id)
    dev.close()  # PUBCOMP never sent
    dev = RawClient(shared_server.port)
    dev.connect(cid, clean=False)
    assert dev.recv() == mqtt.Pubrel(p.packet_id)
    dev.send(mqtt.Pubcomp(p.packet_id))
    pub.publish(topic, b"next", 2)
    nxt = dev.recv()
    assert nxt.payload == b"next"
    dev.close()
    pub.disconnect()


def test_inflight_window_bounds_unacked_messages(shared_server) -> None:
    topic = uid("win")
    dev = RawClient(shared_server.port)
    dev.connect(uid("dev"))
    dev.subscribe(topic, 1)
    pub = Client(shared_server.port, uid("p"))
    for i in range(40):
        pub.publish(topic, b"%d" % i, 1)
    got = [dev.recv() for _ in range(32)]  # the default window
    dev.sock.settimeout(0.5)
    try:
        extra = dev.recv()
    except TimeoutError:
        extra = None
    assert extra is None, "more than max-inflight unacked messages were sent"
    dev.sock.settimeout(5)
    for p in got:
        dev.send(mqtt.Puback(p.packet_id))
    rest = [dev.recv() for _ in range(8)]
    assert [p.payload for p in got + rest] == [b"%d" % i for i in range(40)]
    dev.close()
    pub.disconnect()


def test_subscribe_with_a_full_window_still_reads_the_acks(shared_server) -> None:
    """Found by tests/fuzz/fuzz_connection.py: a SUBSCRIBE whose retained message had to
    wait for an in-flight slot blocked the reading task, so the PUBACKs that would free
    the slot were never read (nor PINGREQ, nor DISCONNECT)."""
    topic = uid("win")
    pub = Client(shared_server.port, uid("p"))
    pub.publish(topic + "/kept", b"retained", 1, retain=True)
    dev = RawClient(shared_server.port)
    dev.connect(uid("dev"))
    dev.subscribe(topic + "/flow", 1)
    for i in range(32):  # fill the default window with unacked messages
        pub.publish(topic + "/flow", b"%d" % i, 1)
    got = [dev.recv() for _ in range(32)]
    dev.subscribe(topic + "/kept", 1, packet_id=2)
    dev.send(mqtt.Pingreq())
    assert isinstance(dev.recv(), mqtt.Pingresp)  # the server still reads
    for p in got:
        dev.send(mqtt.Puback(p.packet_id))
    retained = dev.recv()
    assert isinstance(retained, mqtt.Publish) and retained.payload == b"retained"
    assert retained.retain
    dev.close()
    pub.disconnect()


def test_connect_and_a_bad_packet_in_one_read(shared_server) -> None:
    """Found by the connection fuzzer: a CONNECT followed, in the same segment, by a
    SUBSCRIBE with an invalid filter crashed the connection (a CONNACK with reason 0x8F,
    which CONNACK has not). Now the CONNECT is answered, then DISCONNECT 0x8F."""
    dev = RawClient(shared_server.port, version=5)
    bad = mqtt.encode(mqtt.Subscribe(1, [("ok/#", mqtt.SubscriptionOptions(0))]), 5)
    bad = bad.replace(b"ok/#", b"ok.#")  # '#' not a whole level: TOPIC_FILTER_INVALID
    dev.send_raw(mqtt.encode(mqtt.Connect(client_id=uid("c"), protocol_level=5), 5) + bad)
    connack = dev.recv()
    assert isinstance(connack, mqtt.Connack) and connack.reason_code == 0
    disconnect = dev.recv()
    assert isinstance(disconnect, mqtt.Disconnect) and disconnect.reason_code == 0x8F
    assert dev.closed_by_server()
    dev.close()


def test_malformed_bytes_close_only_that_connection(shared_server) -> None:
    bystander = Client(shared_server.port, uid("b"))
    topic = uid("mal")
    bystander.subscribe(topic, 0)
    for garbage in (
        b"\x10\xff\xff\xff\xff\x7f",  # remaining length of 5 bytes
        b"\x30\x04\x00\x10ab",  # topic length beyond the packet
        b"\xf0\x00",  # reserved packet type 15 in v3.1.1 (AUTH is v5 only)
        b"\x80\x06\x00\x01\x00\x01a\x00",  # SUBSCRIBE with flags 0000, not 0010
    ):
        dev = RawClient(shared_server.port)
        dev.connect(uid("bad"))
        dev.send_raw(garbage)
        assert dev.closed_by_server(), garbage
        dev.close()
    # Not a CONNECT first: closed without CONNACK.
    dev = RawClient(shared_server.port)
    dev.send(mqtt.Pingreq())
    assert dev.closed_by_server()
    # The server is fine and still serving everyone else.
    pub = Client(shared_server.port, uid("p"))
    pub.publish(topic, b"still-up", 0)
    assert bystander.expect(1)[0].payload == b"still-up"
    bystander.disconnect()
    pub.disconnect()


def test_unsupported_protocol_level_gets_return_code_1(shared_server) -> None:
    dev = RawClient(shared_server.port)
    dev.send_raw(b"\x10\x0c\x00\x04MQTT\x07\x02\x00\x3c\x00\x00")  # level 7
    assert dev.sock.recv(4) == b"\x20\x02\x00\x01"
    assert dev.closed_by_server()


def test_zero_length_client_id(shared_server) -> None:
    dev = RawClient(shared_server.port)
    assert dev.connect("", clean=True).reason_code == 0
    dev.close()
    dev = RawClient(shared_server.port)
    dev.send(mqtt.Connect(client_id="", clean_start=False))
    assert dev.recv() == mqtt.Connack(False, 2)  # identifier rejected
    assert dev.closed_by_server()


def test_oversize_packet_closes_the_connection(tmp_path) -> None:
    from tests.conftest import Server

    srv = Server(tmp_path / "d", "--max-packet-size", "1024").start()
    try:
        dev = RawClient(srv.port)
        dev.connect(uid("big"))
        dev.send(mqtt.Publish("big/t", b"x" * 2000, qos=1, packet_id=1))
        assert dev.closed_by_server()
        ok = RawClient(srv.port)
        ok.connect(uid("ok"))
        ok.send(mqtt.Publish("big/t", b"x" * 500, qos=1, packet_id=1))
        assert ok.recv() == mqtt.Puback(1)
        ok.close()
    finally:
        assert srv.stop() == 0


def test_offline_queue_is_bounded_and_keeps_the_newest(tmp_path) -> None:
    from tests.conftest import Server

    srv = Server(tmp_path / "d", "--max-offline-messages", "5").start()
    try:
        cid = uid("dev")
        dev = Client(srv.port, cid, clean=False)
        dev.subscribe("fleet/+/cmd", 1)
        dev.disconnect()
        pub = Client(srv.port, uid("p"))
        for i in range(12):
            pub.publish("fleet/a/cmd", b"%02d" % i, 1)
        dev = Client(srv.port, cid, clean=False)
        got = [m.payload for m in dev.expect(5)]
        assert got == [b"%02d" % i for i in range(7, 12)]
        dev.expect_none(0.3)
        dev.disconnect()
        pub.disconnect()
        assert srv.wait_log("7 offline messages on 'fleet/+/cmd' dropped (limit 5 messages")
    finally:
        assert srv.stop() == 0


def test_outbound_qos2_in_flight_survives_a_restart_without_a_second_copy(server) -> None:
    topic = uid("q2r")
    cid = uid("dev")
    dev = RawClient(server.port)
    dev.connect(cid, clean=False)
    dev.subscribe(topic, 2)
    pub = Client(server.port, uid("p"))
    pub.publish(topic, b"only-once", 2)
    pub.publish(topic, b"second", 1)
    first = dev.recv()
    second = dev.recv()
    assert (first.payload, first.qos, second.payload) == (b"only-once", 2, b"second")
    dev.send(mqtt.Puback(second.packet_id))  # the QoS 2 one stays unanswered
    dev.close()
    pub.disconnect()
    assert server.stop() == 0
    server.start()
    dev = RawClient(server.port)
    assert dev.connect(cid, clean=False).session_present
    again = dev.recv()
    assert (again.payload, again.dup, again.packet_id) == (b"only-once", True, first.packet_id)
    dev.send(mqtt.Pubrec(again.packet_id))
    assert dev.recv() == mqtt.Pubrel(again.packet_id)
    dev.send(mqtt.Pubcomp(again.packet_id))
    dev.sock.settimeout(1.0)
    try:
        extra = dev.recv()
    except TimeoutError:
        extra = None
    assert extra is None, f"sent again after the restart: {extra}"
    dev.close()
