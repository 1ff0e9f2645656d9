"""`$replay/<since>/<filter>` subscriptions against a real server, with paho-mqtt (3.1.1
and 5) and a raw client: every since form, a wildcard over many topics, history then
live with nothing missing and nothing twice while publishers keep going, the client's
Receive Maximum, `last`, and clear refusals of what cannot be replayed."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter, defaultdict
from datetime import UTC, datetime

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from gateway import mqtt
from tests.conftest import Server
from tests.mqtt.paho_client import Client, Received
from tests.mqtt.raw import RawClient


def uid(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


def publish(port: int, items: list[tuple[str, bytes]], qos: int = 0) -> None:
    """Publish in order on one connection; returns once the server stored them all (a
    QoS 1 publish outside every test's filter acknowledges after those before it)."""
    pub = Client(port, uid("pub-"))
    for topic, payload in items:
        pub.publish(topic, payload, qos, wait=False)
    pub.publish(uid("flush/"), b"", 1)
    pub.disconnect()


def payloads(msgs: list[Received]) -> list[bytes]:
    return [m.payload for m in msgs]


def store_now(port: int) -> int:
    """A store time (ms): the server runs on this machine's clock."""
    return time.time_ns() // 1_000_000


# -- where it starts -------------------------------------------------------------------------
def test_earliest_then_live_on_their_own_topics(shared_server: Server) -> None:
    base = uid("plant")
    publish(shared_server.port, [(f"{base}/{i % 3}/temp", b"%d" % i) for i in range(9)])
    sub = Client(shared_server.port, uid("sub-"))
    assert sub.subscribe(f"$replay/earliest/{base}/+/temp", 1) == [1]
    got = sub.expect(9)
    assert [(m.topic, m.payload) for m in got] == [
        (f"{base}/{i % 3}/temp", b"%d" % i) for i in range(9)]
    assert not any(m.retain for m in got)
    publish(shared_server.port, [(f"{base}/7/temp", b"live")], qos=1)
    assert payloads(sub.expect(1)) == [b"live"]
    sub.expect_none(0.2)
    sub.disconnect()


@pytest.mark.parametrize("version", [4, 5])
def test_a_time_a_duration_and_epoch_ms(shared_server: Server, version: int) -> None:
    base = uid("t")
    publish(shared_server.port, [(f"{base}/a", b"old-%d" % i) for i in range(3)], qos=1)
    time.sleep(1.2)
    cut = store_now(shared_server.port)
    publish(shared_server.port, [(f"{base}/a", b"new-%d" % i) for i in range(3)], qos=1)
    new = [b"new-0", b"new-1", b"new-2"]
    rfc = datetime.fromtimestamp(cut / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    for since in (str(cut), rfc, "-1s"):
        sub = Client(shared_server.port, uid("sub-"), version=version)
        sub.subscribe(f"$replay/{since}/{base}/#", 0)
        assert payloads(sub.expect(3)) == new, since
        sub.expect_none(0.2)
        sub.disconnect()
    sub = Client(shared_server.port, uid("sub-"), version=version)
    sub.subscribe(f"$replay/-1h/{base}/#", 0)  # both, in store order
    assert payloads(sub.expect(6)) == [b"old-0", b"old-1", b"old-2", *new]
    sub.disconnect()


def test_an_rfc3339_offset(shared_server: Server) -> None:
    """`+02:00` puts a '+' inside a level (paho will not send it; Lightgate takes it):
    still a replay, not a protocol error."""
    base = uid("tz")
    publish(shared_server.port, [(f"{base}/x", b"1")], qos=1)
    for since in ("2000-01-01T02:00:00+02:00", "1999-12-31T19:00:00-05:00"):
        raw = RawClient(shared_server.port, version=5)
        raw.connect(uid("tz-"))
        assert raw.subscribe(f"$replay/{since}/{base}/x", 0).reason_codes == [0]
        p = raw.recv()
        assert isinstance(p, mqtt.Publish) and p.payload == b"1" and p.topic == f"{base}/x"
        raw.close()


def test_last_gives_each_topics_newest_then_live(shared_server: Server) -> None:
    base = uid("last")
    publish(shared_server.port, [(f"{base}/{i % 4}", b"%d" % i) for i in range(20)])
    sub = Client(shared_server.port, uid("sub-"), version=5)
    sub.subscribe(f"$replay/last/{base}/+", 1)
    got = sub.expect(4)
    assert sorted((m.topic, m.payload) for m in got) == [
        (f"{base}/{k}", b"%d" % (16 + k)) for k in range(4)]
    assert not any(m.retain for m in got)  # the retained pattern, without the flag
    publish(shared_server.port, [(f"{base}/0", b"live")], qos=1)
    assert payloads(sub.expect(1)) == [b"live"]
    sub.expect_none(0.2)
    sub.disconnect()


# -- many topics, and the switch to live -------------------------------------------------------
def test_a_wildcard_over_many_topics_keeps_each_topics_order(shared_server: Server) -> None:
    base = uid("fleet")
    topics = 300
    publish(shared_server.port, [(f"{base}/d{i % topics}/v", b"%d" % i)
                                 for i in range(topics * 4)])
    sub = Client(shared_server.port, uid("sub-"))
    sub.subscribe(f"$replay/earliest/{base}/+/v", 0)
    got = sub.expect(topics * 4)
    per_topic: dict[str, list[int]] = defaultdict(list)
    for m in got:
        per_topic[m.topic].append(int(m.payload))
    assert len(per_topic) == topics
    assert all(seq == sorted(seq) and len(seq) == 4 for seq in per_topic.values())
    sub.expect_none(0.2)
    sub.disconnect()


@pytest.mark.parametrize("qos", [0, 1])
def test_no_gap_and_no_duplicate_while_publishers_go_on(shared_server: Server,
                                                        qos: int) -> None:
    """History and live meet while messages keep arriving: every message once, each
    topic in order."""
    base = uid("flow")
    topics = [f"{base}/{k}" for k in range(8)]
    before = 1500
    publish(shared_server.port, [(topics[i % 8], b"%d" % i) for i in range(before)])
    total = 4000
    stop = threading.Event()

    def keep_publishing() -> None:
        pub = Client(shared_server.port, uid("pub-"))
        for i in range(before, total):
            pub.publish(topics[i % 8], b"%d" % i, 0, wait=False)
            if i % 50 == 0:
                time.sleep(0.002)  # spread over the subscription's start
            if stop.is_set():
                break
        pub.publish(uid("flush/"), b"", 1)
        pub.disconnect()

    t = threading.Thread(target=keep_publishing, daemon=True)
    t.start()
    time.sleep(0.05)
    sub = Client(shared_server.port, uid("sub-"), version=5)
    sub.subscribe(f"$replay/earliest/{base}/+", qos)
    t.join(30)
    stop.set()
    got = sub.expect(total, timeout=30)
    sub.expect_none(0.3)
    seqs = [int(m.payload) for m in got]
    assert Counter(seqs) == Counter(range(total))
    for topic in topics:
        mine = [int(m.payload) for m in got if m.topic == topic]
        assert mine == sorted(mine)
    sub.disconnect()


def test_receive_maximum_bounds_what_is_in_flight(shared_server: Server) -> None:
    base = uid("rm")
    publish(shared_server.port, [(f"{base}/x", b"%d" % i) for i in range(30)], qos=1)
    raw = RawClient(shared_server.port, version=5, timeout=2.0)
    raw.connect(uid("rm-"), properties={"receive_maximum": 3})
    ack = raw.subscribe(f"$replay/earliest/{base}/#", 1)
    assert ack.reason_codes == [1]
    seen: list[bytes] = []
    while len(seen) < 30:
        window = [raw.recv() for _ in range(min(3, 30 - len(seen)))]
        assert all(isinstance(p, mqtt.Publish) and p.qos == 1 for p in window)
        raw.sock.settimeout(0.15)
        with pytest.raises(TimeoutError):  # nothing more until one is acknowledged
            raw.recv()
        raw.sock.settimeout(2.0)
        for p in window:
            seen.append(p.payload)
            raw.send(mqtt.Puback(p.packet_id))
    assert seen == [b"%d" % i for i in range(30)]
    raw.close()


def test_unsubscribe_stops_a_replay(shared_server: Server) -> None:
    base = uid("un")
    publish(shared_server.port, [(f"{base}/x", b"%d" % i) for i in range(5)], qos=1)
    sub = Client(shared_server.port, uid("sub-"))
    sub.subscribe(f"$replay/earliest/{base}/#", 0)
    assert len(sub.expect(5)) == 5
    sub.unsubscribe(f"$replay/earliest/{base}/#")
    publish(shared_server.port, [(f"{base}/x", b"after")], qos=1)
    sub.expect_none(0.3)
    sub.disconnect()


def test_a_replay_takes_the_place_of_the_live_subscription(shared_server: Server) -> None:
    """A session reads a filter once: `$replay/.../F` replaces `F` (one copy of each
    message, not two), and a second replay of F starts over."""
    base = uid("place")
    publish(shared_server.port, [(f"{base}/x", b"%d" % i) for i in range(3)], qos=1)
    sub = Client(shared_server.port, uid("sub-"), version=5)
    sub.subscribe(f"{base}/#", 0)
    sub.subscribe(f"$replay/earliest/{base}/#", 0)
    assert payloads(sub.expect(3)) == [b"0", b"1", b"2"]
    publish(shared_server.port, [(f"{base}/x", b"live")], qos=1)
    assert payloads(sub.expect(1)) == [b"live"]
    sub.subscribe(f"$replay/last/{base}/#", 0)
    assert payloads(sub.expect(1)) == [b"live"]
    sub.expect_none(0.3)
    sub.disconnect()


# -- refusals ------------------------------------------------------------------------------------
BAD = [
    ("$replay/yesterday/a/#", "not a time"),
    ("$replay/2999-01-01T00:00:00Z/a/#", "in the future"),
    ("$replay/-1h", "$replay/<since>/<filter>"),
    ("$share/g/$replay/-1h/a/#", "cannot replay"),
    ("$replay/-1h/$share/g/a", "plain topic filter"),
]


@pytest.mark.parametrize(("topic_filter", "why"), BAD)
def test_bad_input_is_refused_with_a_reason(shared_server: Server, topic_filter: str,
                                            why: str) -> None:
    raw = RawClient(shared_server.port, version=5)
    raw.connect(uid("bad-"))
    ack = raw.subscribe(topic_filter, 1)
    assert ack.reason_codes == [0x8F]
    assert why in ack.properties["reason_string"]
    ok = raw.subscribe(uid("still/"), 0, packet_id=2)  # the connection goes on
    assert ok.reason_codes == [0]
    raw.close()


# Times no store can hold and no date can show: each filter is refused on its own.
OUT_OF_RANGE = ["999999999999999", "9999-12-31T23:59:59-23:59", "0001-01-01T00:00:00+23:59"]


@pytest.mark.parametrize("version", [4, 5])
def test_a_since_out_of_range_is_refused_alone(shared_server: Server, version: int) -> None:
    base = uid("range")
    publish(shared_server.port, [(f"{base}/a", b"kept")], qos=1)
    raw = RawClient(shared_server.port, version=version)
    raw.connect(uid("range-"))
    filters = [f"$replay/{since}/{base}/#" for since in OUT_OF_RANGE]
    filters.insert(1, f"$replay/earliest/{base}/#")
    raw.send(mqtt.Subscribe(1, [(f, mqtt.SubscriptionOptions(1)) for f in filters]))
    ack = raw.recv()
    refused = 0x8F if version == 5 else 0x80
    assert isinstance(ack, mqtt.Suback)
    assert ack.reason_codes == [refused, 1, refused, refused]
    if version == 5:
        assert "past year 9999" in ack.properties["reason_string"]
    got = raw.recv()  # the good filter replays; the connection goes on
    assert isinstance(got, mqtt.Publish) and got.payload == b"kept"
    raw.close()
    assert "Traceback" not in shared_server.logs()


def test_3_1_1_refusals_are_0x80(shared_server: Server) -> None:
    sub = Client(shared_server.port, uid("sub-"))
    assert sub.subscribe("$replay/soon/a/#", 0) == [128]
    assert sub.subscribe("$replay/-1h/ok/#", 0) == [0]
    sub.disconnect()


def test_a_client_asking_for_no_problem_information_gets_no_reason(
        shared_server: Server) -> None:
    raw = RawClient(shared_server.port, version=5)
    raw.connect(uid("quiet-"), properties={"request_problem_information": 0})
    ack = raw.subscribe("$replay/never/a", 0)
    assert ack.reason_codes == [0x8F] and "reason_string" not in ack.properties
    raw.close()


def test_subscription_identifier_and_options_carry_over(shared_server: Server) -> None:
    base = uid("sid")
    publish(shared_server.port, [(f"{base}/x", b"1")], qos=1)
    sub = Client(shared_server.port, uid("sub-"), version=5)
    props = Properties(PacketTypes.SUBSCRIBE)
    props.SubscriptionIdentifier = 42
    sub.subscribe(f"$replay/earliest/{base}/#", options=SubscribeOptions(qos=1),
                  properties=props)
    [m] = sub.expect(1)
    assert m.properties.SubscriptionIdentifier == [42] and m.qos == 1
    sub.disconnect()
