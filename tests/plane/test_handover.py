"""One connection, two owners in turn, against a real `lightgate serve` with
LIGHTGATE_NATIVE=1 and real clients (paho-mqtt, amqtt, raw sockets): quiet plain-TCP
clients are promoted to the native plane after CONNACK, carry QoS 0/1 there, are handed
back to Python for what needs a rule (and promoted again after), and come back for a
takeover, a kick, a lost socket (its will) and a subscriber that falls behind, without
a gap, a duplicate or a reordering."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from amqtt.client import MQTTClient
from prometheus_client.parser import text_string_to_metric_families

from gateway import mqtt
from gateway.handover import MAX_TOPICS
from serving import plane
from tests.conftest import Server
from tests.mqtt.paho_client import Client
from tests.mqtt.raw import RawClient
from tests.plane.conftest import native_server
from tests.security.helpers import ADMIN, add_user, allow

PROMOTED = "promoted to the native plane"

pytestmark = pytest.mark.skipif(plane.NATIVE is None or not hasattr(plane.NATIVE, "Engine"),
                                reason="the native data plane is not built")


@pytest.fixture
def srv1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    """One reactor thread: no connection moves between threads (a move is a handover),
    for tests that count what the native side carried."""
    s = native_server(tmp_path / "data", monkeypatch, "--io-threads", "1")
    yield s
    if s.proc is not None:
        assert s.stop() == 0, s.logs()[-3000:]


def promotions(srv: Server, client_id: str) -> int:
    return sum(1 for line in srv.log if f"client {client_id!r} (" in line and PROMOTED in line)


def wait_promoted(srv: Server, client_id: str, count: int = 1, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while promotions(srv, client_id) < count:
        assert time.monotonic() < deadline, \
            f"{client_id} not promoted {count} times: {srv.logs()[-3000:]}"
        time.sleep(0.02)


def wait_native(srv: Server, client_id: str, subscriptions: int = 0,
                timeout: float = 10) -> None:
    """Until the native plane carries `client_id` with that many subscriptions (its
    last handover says so; a client that does not wait for its CONNACK to be promoted
    may have subscribed or published before its first promotion)."""
    deadline = time.monotonic() + timeout
    seen = -1
    while True:
        said = [line for line in srv.log if f"client {client_id!r} (" in line
                and (PROMOTED in line or "back from the native plane" in line)]
        if said and f"{PROMOTED} ({subscriptions} subscriptions)" in said[-1]:
            if len(said) == seen:  # and nothing more said a moment later (the log
                return  # is read by a thread: a line may come just after the event)
            seen = len(said)
            time.sleep(0.2)
            continue
        assert time.monotonic() < deadline, \
            f"{client_id} not native: {srv.logs()[-3000:]}"
        time.sleep(0.02)


def thread_of(srv: Server, client_id: str) -> int:
    """The reactor thread of the client's last promotion."""
    said = [line for line in srv.log if f"client {client_id!r} (" in line and PROMOTED in line]
    return int(said[-1].rsplit("thread ", 1)[1].split()[0])


def demotions(srv: Server, client_id: str, why: str) -> int:
    return sum(1 for line in srv.log
               if f"client {client_id!r} (" in line and f"back from the native plane: {why}"
               in line)


def until(raw: RawClient, packets: list, kind: type) -> list:
    """Read into `packets` until one of `kind` is among them."""
    while not any(isinstance(p, kind) for p in packets):
        packets.append(raw.recv())
    return packets


def said_back(srv: Server, client_id: str, why: str, count: int = 1) -> bool:
    """Whether the log says `count` times that the client came back for `why` (read by
    a thread: a line may come a moment after what the client saw)."""
    deadline = time.monotonic() + 5
    while demotions(srv, client_id, why) < count:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def metric_samples(srv: Server) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://{srv.addrs['http']}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def native_counters(srv: Server) -> dict[str, float]:
    return {name: v for (name, _), v in metric_samples(srv).items()
            if name.startswith("lightgate_native_")}


def per_qos(srv: Server) -> list[float]:
    """lightgate_messages_received and _sent by QoS 0 and 1 (both planes)."""
    samples = metric_samples(srv)
    return [samples[(f"lightgate_messages_{way}_total", (("qos", q),))]
            for way in ("received", "sent") for q in ("0", "1")]


@pytest.mark.parametrize("version", [4, 5])
def test_promoted_clients_carry_qos0_and_qos1_natively(srv1: Server, version: int) -> None:
    srv = srv1
    sub = Client(srv.port, f"sub{version}", version=version)
    sub.subscribe("dev/+/t", 1)
    pub = Client(srv.port, f"pub{version}", version=version)
    pub.publish("dev/1/t", b"first", qos=1)  # a topic new to its ACL cache: Python's
    assert [m.payload for m in sub.expect(1)] == [b"first"]
    wait_native(srv, f"sub{version}", 1)
    wait_native(srv, f"pub{version}")  # the topic in its ACL cache
    promoted = promotions(srv, f"pub{version}")
    before, qos_before = native_counters(srv), per_qos(srv)
    appends_before = metric_samples(srv)[("lightgate_store_append_latency_seconds_count", ())]
    for i in range(100):
        pub.publish("dev/1/t", b"q1-%d" % i, qos=1)
        pub.publish("dev/1/t", b"q0-%d" % i, qos=0, wait=False)
    got = sub.expect(200)
    assert [m.payload for m in got] == [p for i in range(100)
                                        for p in (b"q1-%d" % i, b"q0-%d" % i)]
    assert [m.qos for m in got[:2]] == [1, 0]
    after = native_counters(srv)
    # Every one of them went in and out on the native side.
    assert after["lightgate_native_messages_in_total"] \
        - before["lightgate_native_messages_in_total"] == 200
    assert after["lightgate_native_messages_out_total"] \
        - before["lightgate_native_messages_out_total"] == 200
    # ... and the counters by QoS count them too: 100 of each, in and out; the append
    # latency histogram has their appends.
    assert [b - a for a, b in zip(qos_before, per_qos(srv), strict=True)] == [100, 100, 100, 100]
    appends = ("lightgate_store_append_latency_seconds_count", ())
    assert metric_samples(srv)[appends] - appends_before >= 100  # QoS 1: one at a time
    assert promotions(srv, f"pub{version}") == promoted, "nothing handed it back meanwhile"
    # The overview ($SYS too) counts both planes' messages.
    with urllib.request.urlopen(f"http://{srv.addrs['http']}/api/v1/overview") as r:
        overview = json.load(r)
    assert overview["messages_in"] >= 201 and overview["messages_out"] >= 201
    sub.expect_none(0.3)
    pub.disconnect()
    sub.disconnect()


def test_amqtt_round_trip_on_the_native_plane(srv: Server) -> None:
    topic = f"am-{uuid.uuid4().hex[:8]}/t"
    url = f"mqtt://127.0.0.1:{srv.port}/"

    async def scenario() -> list[bytes]:
        sub, pub = MQTTClient(client_id="am-sub"), MQTTClient(client_id="am-pub")
        await sub.connect(url)
        await pub.connect(url)
        assert await sub.subscribe([(topic, 1)]) == [1]
        await pub.publish(topic, b"warm-up", qos=1)
        got = [bytes((await sub.deliver_message(timeout_duration=5)).data)]
        await asyncio.to_thread(wait_native, srv, "am-pub")
        for i in range(20):
            await pub.publish(topic, b"am%d" % i, qos=1)
        for _ in range(20):
            got.append(bytes((await sub.deliver_message(timeout_duration=5)).data))
        await pub.disconnect()
        await sub.disconnect()
        return got

    got = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert got == [b"warm-up", *(b"am%d" % i for i in range(20))]


def test_python_answers_what_needs_it_and_promotes_again(srv: Server) -> None:
    raw = RawClient(srv.port, version=5)
    raw.connect("raw5")
    wait_promoted(srv, "raw5")
    # SUBSCRIBE: Python's SUBACK, then native again.
    ack = raw.subscribe("r/#", 1)
    assert ack.reason_codes == [1]
    wait_promoted(srv, "raw5", 2)
    # QoS 2: Python carries the exchange, and it comes back to this subscriber.
    raw.send(mqtt.Publish("r/q2", b"two", qos=2, packet_id=7))
    packets = until(raw, [], mqtt.Pubrec)
    assert [(p.packet_id, p.reason_code) for p in packets if isinstance(p, mqtt.Pubrec)] \
        == [(7, 0)]
    raw.send(mqtt.Pubrel(7))
    until(raw, packets, mqtt.Pubcomp)
    until(raw, packets, mqtt.Publish)
    [delivered] = [p for p in packets if isinstance(p, mqtt.Publish)]
    assert (delivered.topic, delivered.payload, delivered.qos) == ("r/q2", b"two", 1)
    raw.send(mqtt.Puback(delivered.packet_id))
    wait_promoted(srv, "raw5", 3)
    # A retained publish: stored as retained (a new subscriber gets it).
    raw.send(mqtt.Publish("r/kept", b"kept", qos=1, packet_id=8, retain=True))
    answers = until(raw, until(raw, [], mqtt.Puback), mqtt.Publish)
    assert [p.packet_id for p in answers if isinstance(p, mqtt.Puback)] == [8]
    [copy] = [p for p in answers if isinstance(p, mqtt.Publish)]
    raw.send(mqtt.Puback(copy.packet_id))
    later = Client(srv.port, "later")
    later.subscribe("r/kept", 0)
    [kept] = later.expect(1)
    assert (kept.payload, kept.retain) == (b"kept", True)
    later.disconnect()
    wait_promoted(srv, "raw5", 4)
    # A malformed packet: Python's reason code (v5 DISCONNECT 0x81), and the socket ends.
    raw.send_raw(bytes([0x30, 0x02, 0xFF, 0xFF]))
    bye = raw.recv()
    assert isinstance(bye, mqtt.Disconnect) and bye.reason_code == 0x81
    assert raw.closed_by_server()
    assert said_back(srv, "raw5", "packet", 4)


def test_a_client_that_may_publish_anywhere_stays_native_on_every_topic(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no authentication, a promoted publisher needs no ACL cache: more topics than
    the cache would hold are all carried natively, while a topic past the limits and a
    topic of the server's still get Python's answer."""
    srv = native_server(tmp_path / "data", monkeypatch, "--max-topic-levels", "4",
                        "--max-topic-length", "40")
    try:
        pub = Client(srv.port, "many", version=5)
        wait_native(srv, "many")
        promoted = promotions(srv, "many")
        before = native_counters(srv)
        topics = [f"fleet/{i}/cmd" for i in range(MAX_TOPICS + 100)]
        for topic in topics:
            assert pub.pub_codes[pub.publish(topic, b"go", qos=1)] == 0
        after = native_counters(srv)
        assert after["lightgate_native_messages_in_total"] \
            - before["lightgate_native_messages_in_total"] == len(topics)
        assert promotions(srv, "many") == promoted, "came back for a topic"
        for topic in ("a/b/c/d/e", "x" * 41):  # 4 separators; 41 characters
            promoted += 1
            assert pub.pub_codes[pub.publish(topic, b"no", qos=1)] == 0x90
            wait_promoted(srv, "many", promoted)  # Python answered; native again
        assert pub.pub_codes[pub.publish("$SYS/x", b"no", qos=1)] == 0x87
        assert pub.pub_codes[pub.publish("fleet/0/cmd", b"go", qos=1)] == 0
        pub.disconnect()
    finally:
        assert srv.stop() == 0, srv.logs()[-3000:]


def test_an_unauthorised_topic_is_refused_by_python_then_native_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    srv = native_server(tmp_path / "data", monkeypatch, "--auth", "--init-user",
                        f"{ADMIN[0]}:{ADMIN[1]}")
    try:
        add_user(srv, "alice", "alice-pw")
        allow(srv, "alice", "Topic:home/alice/", "PUB", match="prefixed")
        watcher = Client(srv.port, "watch", username=ADMIN[0], password=ADMIN[1])
        watcher.subscribe("home/#", 1)
        alice = Client(srv.port, "alice-1", version=5, username="alice", password="alice-pw")
        ok = alice.publish("home/alice/lamp", b"mine", qos=1)
        assert alice.pub_codes[ok] == 0
        wait_native(srv, "alice-1")
        promoted = promotions(srv, "alice-1")
        denied = alice.publish("home/bob/lamp", b"sneaky", qos=1)
        assert alice.pub_codes[denied] == 0x87  # Python's answer, as without the plane
        wait_promoted(srv, "alice-1", promoted + 1)
        again = alice.publish("home/alice/lamp", b"again", qos=1)
        assert alice.pub_codes[again] == 0
        assert [m.payload for m in watcher.expect(2)] == [b"mine", b"again"]
        watcher.expect_none(0.3)
        alice.disconnect()
        watcher.disconnect()
    finally:
        assert srv.stop() == 0, srv.logs()[-3000:]


def test_takeover_kick_and_shutdown_of_promoted_connections(srv: Server) -> None:
    first = RawClient(srv.port, version=5)
    first.connect("twin")
    wait_promoted(srv, "twin")
    second = RawClient(srv.port, version=5)
    assert second.connect("twin").reason_code == 0
    bye = first.recv()
    assert isinstance(bye, mqtt.Disconnect) and bye.reason_code == 0x8E  # taken over
    assert first.closed_by_server()
    wait_promoted(srv, "twin", 2)  # the new connection
    req = urllib.request.Request(f"http://{srv.addrs['http']}/api/v1/clients/twin/kick",
                                 method="POST")
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 200
    bye = second.recv()
    assert isinstance(bye, mqtt.Disconnect) and bye.reason_code == 0x98  # administrative
    assert second.closed_by_server()
    third = RawClient(srv.port, version=5)
    third.connect("last")
    wait_promoted(srv, "last")
    assert srv.stop() == 0, srv.logs()[-3000:]
    bye = third.recv()
    assert isinstance(bye, mqtt.Disconnect) and bye.reason_code == 0x8B  # shutting down


def test_a_promoted_clients_lost_socket_publishes_its_will(srv: Server) -> None:
    watcher = Client(srv.port, "will-watch")
    watcher.subscribe("wills/#", 1)
    raw = RawClient(srv.port, version=4)
    raw.connect("doomed", will=mqtt.Will("wills/doomed", b"gone", 1, False))
    wait_promoted(srv, "doomed")
    raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    raw.close()  # a reset, no DISCONNECT
    [will] = watcher.expect(1)
    assert (will.topic, will.payload) == ("wills/doomed", b"gone")
    assert said_back(srv, "doomed", "lost")
    watcher.disconnect()


def test_a_slow_subscriber_stays_native_and_misses_nothing(srv1: Server) -> None:
    """Past its budget a slow subscriber is served from the store, on the native plane:
    it misses nothing and gets nothing twice."""
    srv = srv1
    slow = RawClient(srv.port, version=4, timeout=10)
    slow.connect("slow")
    slow.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    assert slow.subscribe("bulk/t", 1).reason_codes == [1]
    wait_native(srv, "slow", 1)
    pub = Client(srv.port, "bulk-pub")
    pub.publish("bulk/t", b"x", qos=1)  # its topic into the publisher's ACL cache
    wait_native(srv, "bulk-pub")
    body = b"." * 10_000
    count = 500  # 5 MB: past the 2 MiB backlog whatever the kernel's buffers take
    for i in range(count):
        pub.publish("bulk/t", b"%05d" % i + body, qos=1, wait=i % 50 == 49)
    got: list[bytes] = []
    while len(got) < count + 1:
        p = slow.recv()
        assert isinstance(p, mqtt.Publish), p
        got.append(p.payload[:5])
        if p.qos:
            slow.send(mqtt.Puback(p.packet_id))
    assert got == [b"x", *(b"%05d" % i for i in range(count))]  # in order, once each
    slow.sock.settimeout(0.5)
    with pytest.raises(TimeoutError):
        slow.recv()
    assert demotions(srv, "slow", "backlog") == 0, srv.logs()[-3000:]
    counters = native_counters(srv)
    assert counters["lightgate_native_fell_behind_total"] >= 1, counters
    # It reads its backlog out, then goes live: the next message comes live.
    deadline = time.monotonic() + 10
    while native_counters(srv)["lightgate_native_caught_up_total"] < 1:
        assert time.monotonic() < deadline, native_counters(srv)
        time.sleep(0.05)
    slow.sock.settimeout(10)
    pub.publish("bulk/t", b"live", qos=1)
    p = slow.recv()
    assert p.payload == b"live"
    slow.send(mqtt.Puback(p.packet_id))
    pub.disconnect()


def test_what_the_native_side_cannot_deliver_goes_through_python(srv: Server) -> None:
    sub = RawClient(srv.port, version=5)
    sub.connect("props-sub")
    assert sub.subscribe("p/#", 2).reason_codes == [2]
    wait_native(srv, "props-sub", 1)
    pub = RawClient(srv.port, version=5)
    pub.connect("props-pub")
    # User properties a v5 subscriber must get, and QoS 2: Python delivers both.
    pub.send(mqtt.Publish("p/a", b"with-props", qos=1, packet_id=1,
                          properties={"user_property": [("k", "v")]}))
    pub.send(mqtt.Publish("p/b", b"exactly-once", qos=2, packet_id=2))
    pub.send(mqtt.Publish("p/c", b"plain", qos=1, packet_id=3))
    packets = until(pub, until(pub, [], mqtt.Pubrec), mqtt.Puback)
    pub.send(mqtt.Pubrel(2))
    got = []
    while len(got) < 3:
        p = sub.recv()
        if isinstance(p, mqtt.Publish):
            got.append(p)
            if p.qos == 1:
                sub.send(mqtt.Puback(p.packet_id))
            elif p.qos == 2:
                sub.send(mqtt.Pubrec(p.packet_id))
        elif isinstance(p, mqtt.Pubrel):
            sub.send(mqtt.Pubcomp(p.packet_id))
    assert [(p.topic, p.payload, p.qos) for p in got] == [
        ("p/a", b"with-props", 1), ("p/b", b"exactly-once", 2), ("p/c", b"plain", 1)]
    assert got[0].properties.get("user_property") == [("k", "v")]
    assert said_back(srv, "props-sub", "released")
    assert packets


def test_a_shared_subscriber_stays_in_python_until_it_unsubscribes(srv: Server) -> None:
    raw = RawClient(srv.port, version=5)
    raw.connect("sharer")
    wait_native(srv, "sharer")
    assert raw.subscribe("$share/g/s/t", 1).reason_codes == [1]
    time.sleep(0.5)
    said = [line for line in srv.log if "client 'sharer' (" in line and "native plane" in line]
    assert "back from the native plane: packet" in said[-1], "a shared member stays"
    raw.send(mqtt.Unsubscribe(2, ["$share/g/s/t"]))
    assert isinstance(raw.recv(), mqtt.Unsuback)
    wait_native(srv, "sharer")


def test_a_promoted_client_that_goes_quiet_times_out_with_its_will(srv: Server) -> None:
    watcher = Client(srv.port, "ka-watch")
    watcher.subscribe("wills/#", 1)
    raw = RawClient(srv.port, version=5, timeout=10)
    raw.connect("sleeper", keepalive=1, will=mqtt.Will("wills/sleeper", b"timed out", 1))
    wait_native(srv, "sleeper")
    started = time.monotonic()
    bye = raw.recv()  # nothing sent: 1.5 keepalives later the native side hands it back
    assert isinstance(bye, mqtt.Disconnect) and bye.reason_code == 0x8D  # Keep Alive timeout
    assert time.monotonic() - started < 5
    [will] = watcher.expect(1)
    assert (will.topic, will.payload) == ("wills/sleeper", b"timed out")
    assert said_back(srv, "sleeper", "timeout")
    watcher.disconnect()


def test_an_extension_that_cannot_carry_connections_is_one_line(tmp_path: Path) -> None:
    from tests.plane.test_serve_native_writer import _one_line, _serve_with_stub

    stub = ("def encode_record(*args):\n    raise ValueError('stub')\n\n\n"
            "class Engine:  # it writes the log, but hands no connection back\n"
            "    def append_messages(self, *args):\n        pass\n")
    res = _serve_with_stub(tmp_path, stub)
    _one_line(res, "lightgate: the native data plane installed is older than this Lightgate")


def test_a_311_publish_the_store_refuses_ends_the_connection_unacked(
        small_fs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    srv = native_server(small_fs / "data", monkeypatch, "--segment-size", str(1 << 20))
    try:
        raw = RawClient(srv.port, version=4)
        raw.connect("filler")
        raw.send(mqtt.Publish("fill/t", b"w", qos=1, packet_id=1))  # the topic cached
        assert isinstance(raw.recv(), mqtt.Puback)
        wait_native(srv, "filler")
        body = b"z" * 60_000
        acked, pid = 0, 1
        with pytest.raises(ConnectionError):
            for _ in range(400):  # 24 MB into 8 MiB: the disk fills on the way
                pid = pid % 65535 + 1
                raw.send(mqtt.Publish("fill/t", body, qos=1, packet_id=pid))
                ack = raw.recv()
                assert isinstance(ack, mqtt.Puback) and ack.packet_id == pid
                acked += 1
        assert 0 < acked < 400
        assert said_back(srv, "filler", "lost")
        assert srv.wait_log("disconnected: store error: a publish was not stored")
    finally:
        srv.stop()


def test_a_subscriber_moves_to_its_publishers_thread_and_misses_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At light load, a subscriber whose deliveries all come from a publisher on the
    other reactor thread moves to that thread (one thread then reads and writes each
    message): once, within the native plane, with nothing lost, repeated or reordered."""
    srv = native_server(tmp_path / "data", monkeypatch, "--io-threads", "2")
    try:
        sub = Client(srv.port, "mover")
        sub.subscribe("move/t", 1)
        wait_native(srv, "mover", 1)
        shifts = []
        for attempt in range(3):  # until the publisher lands on the other thread
            pub = Client(srv.port, "mover-pub")
            pub.publish("move/t", b"first", qos=1)
            assert [m.payload for m in sub.expect(1)] == [b"first"]
            wait_native(srv, "mover-pub")
            apart = thread_of(srv, "mover") != thread_of(srv, "mover-pub")
            if apart:
                break
            pub.disconnect()
            shifts.append(Client(srv.port, f"shift{attempt}"))  # one promotion: next id
            wait_native(srv, f"shift{attempt}")
        assert apart
        time.sleep(1.1)  # both settled on their threads
        before = native_counters(srv)
        handed_back = demotions(srv, "mover", "")
        sent = []
        for i in range(400):  # ~2 s at light load
            sent.append(b"m%d" % i)
            pub.publish("move/t", sent[-1], qos=i % 2, wait=i % 2 == 1)
            time.sleep(0.005)
        assert [m.payload for m in sub.expect(400)] == sent
        sub.expect_none(0.3)
        after = native_counters(srv)
        assert after["lightgate_native_moved_total"] - before["lightgate_native_moved_total"] == 1
        # All of it in and out natively: the move hands nothing to Python.
        assert after["lightgate_native_messages_out_total"] \
            - before["lightgate_native_messages_out_total"] == 400
        assert demotions(srv, "mover", "") == handed_back
        for c in (pub, *shifts):
            c.disconnect()
        sub.disconnect()
    finally:
        assert srv.stop() == 0, srv.logs()[-3000:]


def test_a_python_subscriber_of_native_publishes_gets_each_once(srv: Server) -> None:
    """A persistent session stays in Python; its reads catch the index up with the
    engine's appends inline, and the notify that dispatch makes must not deliver again
    what the read in progress is delivering."""
    sub = Client(srv.port, "py-sub", clean=False)
    sub.subscribe("mix/t", 0)
    pub = Client(srv.port, "native-pub")
    pub.publish("mix/t", b"first", qos=1)
    assert [m.payload for m in sub.expect(1)] == [b"first"]
    wait_native(srv, "native-pub")
    sent = [b"n%d" % i for i in range(300)]
    for body in sent:
        pub.publish("mix/t", body, qos=0, wait=False)
        time.sleep(0.003)
    assert [m.payload for m in sub.expect(300)] == sent
    sub.expect_none(0.3)
    pub.disconnect()
    sub.disconnect()


def test_a_client_that_publishes_without_a_pause_is_promoted_mid_flood(srv: Server) -> None:
    """A publisher is never quiet while it floods: the handover stops reading it for a
    moment, so what it has under way settles, and hands it over; the engine reads the
    rest from the socket. Nothing lost, repeated or reordered."""
    sub = Client(srv.port, "flood-sub")
    sub.subscribe("flood/t", 0)
    wait_native(srv, "flood-sub", 1)
    raw = RawClient(srv.port, version=4, timeout=10)
    raw.connect("flooder")
    # Flood until it was promoted mid-flood (a loaded machine may take a few tries),
    # then as much again natively.
    count, sent, promoted_at = 100_000, 0, None
    deadline = time.monotonic() + 30
    while sent < count:
        chunk = b"".join(mqtt.encode_publish("flood/t", b"%06d" % (sent + i), 0, False,
                                             False, None, 4) for i in range(100))
        raw.sock.sendall(chunk)
        sent += 100
        # Promoted after CONNACK, and (as a rule) handed back for its first PUBLISH, a
        # topic new to its ACL cache: native again now means promoted while it floods.
        if promoted_at is None and sent % 2000 == 0 \
                and promotions(srv, "flooder") > demotions(srv, "flooder", ""):
            promoted_at = sent
            count = max(count, sent + 20_000)
        elif promoted_at is None and sent == count and count < 300_000:
            count += 10_000
        assert time.monotonic() < deadline, "not promoted while it flooded"
    assert promoted_at is not None, "not promoted while it flooded: " + "".join(
        line for line in srv.log if "flooder" in line)[-3000:]
    got = [m.payload for m in sub.expect(count, timeout=30)]
    assert got == [b"%06d" % i for i in range(count)]
    sub.expect_none(0.3)
    raw.sock.close()
    sub.disconnect()
