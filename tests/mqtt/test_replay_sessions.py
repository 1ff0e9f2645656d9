"""`$replay/...` subscriptions on servers of their own: persistent sessions that leave
mid-replay (a reconnect, a gateway restart), the ACL per message, a history cut by
retention, and a gateway in separated mode reading a remote store."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway import mqtt
from tests.conftest import RedisServer, Server
from tests.mqtt.paho_client import Client
from tests.mqtt.raw import RawClient
from tests.mqtt.test_replay import payloads, publish
from tests.security.helpers import add_user, allow, auth_server


def uid(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


def persistent(port: int, cid: str, receive_maximum: int) -> RawClient:
    raw = RawClient(port, version=5, timeout=3.0)
    raw.connect(cid, clean=False, properties={"session_expiry_interval": 600,
                                              "receive_maximum": receive_maximum})
    return raw


def take(raw: RawClient, n: int, ack: bool = True) -> list[mqtt.Publish]:
    """The next `n` PUBLISHes (acknowledged unless told not to)."""
    out = []
    while len(out) < n:
        p = raw.recv()
        if isinstance(p, mqtt.Publish):
            out.append(p)
            if ack:
                raw.send(mqtt.Puback(p.packet_id))
    return out


def test_a_reconnect_mid_replay_goes_on_where_it_stopped(server: Server) -> None:
    """Acknowledged messages are not sent again; what was in flight is, with DUP; the
    rest follows, then live."""
    base = uid("r")
    publish(server.port, [(f"{base}/{i % 2}", b"%d" % i) for i in range(600)], qos=1)
    cid = uid("dev-")
    raw = persistent(server.port, cid, receive_maximum=5)
    assert raw.subscribe(f"$replay/earliest/{base}/+", 1).reason_codes == [1]
    acked = take(raw, 300)
    held = take(raw, 5, ack=False)
    raw.close()
    raw = persistent(server.port, cid, receive_maximum=5)
    again = take(raw, 5)
    assert [p.payload for p in again] == [p.payload for p in held] and all(p.dup for p in again)
    rest = take(raw, 600 - 305)
    seqs = [int(p.payload) for p in acked + again + rest]
    assert seqs == list(range(600))
    publish(server.port, [(f"{base}/0", b"live")], qos=1)
    assert take(raw, 1)[0].payload == b"live"
    raw.close()


def test_a_dropped_connection_mid_replay_goes_on_past_a_snapshot_in_flight(
        server: Server) -> None:
    """A 3.1.1 client (the server's window of 32) drops TCP without DISCONNECT while the
    sends of a snapshot are unacknowledged: back, it gets what was in flight, the rest of
    the history and then live messages. (The snapshot waited for the new connection's
    socket to take as many bytes as the old one had: the replay stopped after one
    message.)"""
    base = uid("r")
    total = 2000
    publish(server.port, [(f"{base}/{i % 10}", b"%d" % i) for i in range(total)], qos=1)
    cid = uid("v3-")
    raw = RawClient(server.port, timeout=3.0)
    raw.connect(cid, clean=False)
    assert raw.subscribe(f"$replay/earliest/{base}/#", 1).reason_codes == [1]
    first = take(raw, 500) + take(raw, 5, ack=False)
    time.sleep(0.2)  # the rest of the window reaches the socket: nothing is unwritten
    raw.close()  # no DISCONNECT
    raw = RawClient(server.port, timeout=3.0)
    assert raw.connect(cid, clean=False).session_present
    second: list[mqtt.Publish] = []
    while not second or int(second[-1].payload) != total - 1:
        second += take(raw, 1)  # a stall is a timeout
    seqs = [int(p.payload) for p in first + second]
    assert set(seqs) == set(range(total))
    assert len(seqs) - total <= 32  # at most the window came twice
    publish(server.port, [(f"{base}/{i % 10}", b"live%d" % i) for i in range(20)], qos=1)
    assert sorted(p.payload for p in take(raw, 20)) == sorted(b"live%d" % i for i in range(20))
    raw.close()


def test_a_gateway_restart_mid_replay_resumes_from_the_saved_progress(server: Server) -> None:
    """After a restart the replay goes on from its last acknowledged snapshot: nothing
    missing, and what comes twice is at most the messages after that snapshot."""
    base = uid("g")
    total = 3000
    publish(server.port, [(f"{base}/{i % 7}", b"%d" % i) for i in range(total)], qos=1)
    cid = uid("dev-")
    raw = persistent(server.port, cid, receive_maximum=20)
    raw.subscribe(f"$replay/earliest/{base}/+", 1)
    first = take(raw, 1000)
    raw.send(mqtt.Disconnect())
    raw.close()
    time.sleep(0.3)
    server.stop()
    server.start()
    raw = persistent(server.port, cid, receive_maximum=20)
    second: list[mqtt.Publish] = []
    while not second or int(second[-1].payload) != total - 1:
        second += take(raw, 1)
    seqs = Counter(int(p.payload) for p in first + second)
    assert set(seqs) == set(range(total))
    twice = [k for k, c in seqs.items() if c > 1]
    assert len(twice) <= 256 + 20, len(twice)  # two snapshots of 128, a window of 20
    assert int(second[0].payload) <= 1000
    publish(server.port, [(f"{base}/1", b"live")], qos=1)
    assert take(raw, 1)[0].payload == b"live"
    raw.close()


def test_a_3_1_1_persistent_session_keeps_its_replay(server: Server) -> None:
    base = uid("v3")
    publish(server.port, [(f"{base}/x", b"%d" % i) for i in range(50)])
    cid = uid("v3-")
    sub = Client(server.port, cid, clean=False)
    sub.subscribe(f"$replay/earliest/{base}/#", 1)
    assert len(sub.expect(50)) == 50
    sub.disconnect()
    publish(server.port, [(f"{base}/x", b"offline")], qos=1)
    sub = Client(server.port, cid, clean=False)
    assert sub.connack[0] is True
    assert payloads(sub.expect(1)) == [b"offline"]  # live, from where it stopped
    sub.expect_none(0.3)
    sub.disconnect()


def test_the_acl_decides_per_message(tmp_path: Path) -> None:
    srv = auth_server(tmp_path)
    try:
        add_user(srv, "ops", "ops-pw")
        allow(srv, "ops", "Topic:plant/#", "SUB")
        allow(srv, "ops", "Topic:plant/secret/#", "SUB", deny=True)
        add_user(srv, "boiler", "pw")
        allow(srv, "boiler", "Topic:#", "PUB")
        dev = Client(srv.port, "boiler", username="boiler", password="pw")
        for i in range(6):
            dev.publish("plant/secret/k" if i % 3 == 0 else f"plant/{i}/temp", b"%d" % i, 1)
        dev.disconnect()
        ops = Client(srv.port, "ops-1", username="ops", password="ops-pw", version=5)
        assert [c.value for c in ops.subscribe("$replay/earliest/plant/#", 1)] == [1]
        assert payloads(ops.expect(4)) == [b"1", b"2", b"4", b"5"]
        ops.expect_none(0.3)
        assert [c.value for c in ops.subscribe("$replay/earliest/other/#", 1)] == [0x87]
        ops.disconnect()
        v3 = Client(srv.port, "ops-2", username="ops", password="ops-pw")
        assert v3.subscribe("$replay/-1h/other/#", 1) == [0x80]
        v3.disconnect()
    finally:
        assert srv.stop() == 0, srv.logs()[-3000:]


def test_a_history_cut_by_retention_starts_at_the_oldest_kept_and_says_so(
        tmp_path: Path) -> None:
    srv = Server(tmp_path / "data", "--segment-size", "65536", "--retention-bytes", "131072",
                 "--retention-check-s", "0.2").start()
    try:
        publish(srv.port, [("kept/t", b"old%d" % i) for i in range(3)], qos=1)
        publish(srv.port, [("kept/t", b"f" * 1000) for _ in range(400)], qos=1)
        assert srv.wait_log("retention: segment 00000000000000000000 removed"), srv.logs()[-2000:]
        raw = RawClient(srv.port, version=5)
        raw.connect(uid("cut-"))
        ack = raw.subscribe("$replay/earliest/kept/t", 0)
        assert ack.reason_codes == [0]
        assert ack.properties["user_property"] == [("replay-cut", "$replay/earliest/kept/t")]
        first = raw.recv()
        assert isinstance(first, mqtt.Publish) and first.payload == b"f" * 1000
        ack = raw.subscribe("$replay/last/kept/t", 0, packet_id=2)
        assert "user_property" not in ack.properties
        raw.close()
    finally:
        assert srv.stop() == 0, srv.logs()[-3000:]


@pytest.fixture
def separated(tmp_path: Path, redis_server: RedisServer) -> Iterator[Server]:
    store = Server(tmp_path / "store", "--notify", redis_server.url, command="store").start()
    gateway = Server(None, "--store", store.native, "--notify", redis_server.url,
                     command="gateway").start()
    yield gateway
    for srv in (gateway, store):
        assert srv.stop() == 0, srv.logs()[-2000:]


def test_separated_mode_replays_from_the_remote_store(separated: Server) -> None:
    base = uid("sep")
    publish(separated.port, [(f"{base}/{i % 3}", b"%d" % i) for i in range(30)])
    sub = Client(separated.port, uid("sub-"), version=5)
    sub.subscribe(f"$replay/earliest/{base}/+", 1)
    assert payloads(sub.expect(30)) == [b"%d" % i for i in range(30)]
    sub.subscribe(f"$replay/last/{base}/0", 0)
    assert payloads(sub.expect(1)) == [b"27"]
    publish(separated.port, [(f"{base}/1", b"live")], qos=1)
    assert payloads(sub.expect(1)) == [b"live"]
    sub.expect_none(0.3)
    assert [c.value for c in sub.subscribe(f"$replay/2999-01-01T00:00:00Z/{base}/+", 0)] \
        == [0x8F]
    sub.disconnect()
