"""Authentication, ACL and limits on MQTT, against a real server and paho clients."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from gateway import mqtt
from tests.conftest import Server
from tests.mqtt.paho_client import Client
from tests.mqtt.raw import RawClient
from tests.security.helpers import ADMIN, add_user, allow, auth_server, native


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = auth_server(tmp_path_factory.mktemp("auth"))
    add_user(s, "alice", "alice-pw")
    allow(s, "alice", "Topic:home/alice/", "PUB", match="prefixed")
    allow(s, "alice", "Topic:home/#", "SUB")
    allow(s, "alice", "Topic:home/secret", "SUB", deny=True)
    yield s
    assert s.stop() == 0, s.logs()[-3000:]


def connack(srv: Server, version: int, **kw) -> int:
    raw = RawClient(srv.port, version)
    try:
        return raw.connect("probe", **kw).reason_code
    finally:
        raw.close()


@pytest.mark.parametrize(("version", "no_user", "bad_password"), [(4, 5, 4), (5, 0x87, 0x86)])
def test_connect_needs_valid_credentials(srv: Server, version: int, no_user: int,
                                         bad_password: int) -> None:
    assert connack(srv, version) == no_user  # anonymous is off once auth is on
    assert connack(srv, version, username="alice", password=b"wrong") == bad_password
    assert connack(srv, version, username="nobody", password=b"x") == bad_password
    assert connack(srv, version, username="alice", password=b"alice-pw") == 0
    assert srv.wait_log("[AUTHENTICATION] user=alice")
    assert srv.wait_log("result=failure reason=bad username or password")


def test_denied_publish_is_not_stored(srv: Server) -> None:
    watcher = Client(srv.port, "watch-all", username=ADMIN[0], password=ADMIN[1])
    watcher.subscribe("home/#", 1)
    alice = Client(srv.port, "alice-1", version=5, username="alice", password="alice-pw")
    denied = alice.publish("home/bob/lamp", b"sneaky", qos=1)
    assert alice.pub_codes[denied] == 0x87  # v5: PUBACK Not authorized
    alice.publish("home/alice/lamp", b"mine", qos=1)
    [got] = watcher.expect(1)
    assert (got.topic, got.payload) == ("home/alice/lamp", b"mine")
    watcher.expect_none(0.5)
    # 3.1.1 has no negative ack: the client gets a plain PUBACK, the server drops it
    alice3 = Client(srv.port, "alice-3", version=4, username="alice", password="alice-pw")
    alice3.publish("home/bob/lamp", b"sneaky-too", qos=1)
    alice3.publish("home/alice/door", b"ok", qos=0)
    [got] = watcher.expect(1)
    assert got.topic == "home/alice/door"
    stats = native(srv, "STATS")
    assert srv.wait_log("[AUTHORIZATION] user=alice")
    assert "result=deny" in srv.logs()
    for c in (watcher, alice, alice3):
        c.disconnect()
    assert stats  # the store answered for a Super user


@pytest.mark.parametrize(("version", "failure"), [(4, 0x80), (5, 0x87)])
def test_denied_subscribe_gets_a_failure_code(srv: Server, version: int, failure: int) -> None:
    alice = Client(srv.port, f"alice-sub{version}", version=version, username="alice",
                   password="alice-pw")
    codes = alice.subscribe([("garden/#", 0), ("home/+/lamp", 1), ("#", 0)])
    values = [c if isinstance(c, int) else c.value for c in codes]
    assert values == [failure, 1, failure]
    alice.disconnect()


def test_wide_filter_does_not_deliver_denied_topics(srv: Server) -> None:
    alice = Client(srv.port, "alice-wide", username="alice", password="alice-pw")
    alice.subscribe("home/#", 1)
    admin = Client(srv.port, "admin-pub", username=ADMIN[0], password=ADMIN[1])
    admin.publish("home/secret", b"hidden", qos=1)
    admin.publish("home/kitchen/temp", b"21", qos=1)
    [got] = alice.expect(1)
    assert got.topic == "home/kitchen/temp"
    alice.expect_none(0.5)
    for c in (alice, admin):
        c.disconnect()


def test_disabled_user_is_disconnected_and_refused(srv: Server) -> None:
    add_user(srv, "carol", "carol-pw")
    carol = Client(srv.port, "carol-1", version=5, username="carol", password="carol-pw")
    native(srv, "USER_UPDATE", {"name": "carol", "enabled": False})
    assert carol.disconnected.wait(5), "a disabled user's session must end at once"
    assert connack(srv, 5, username="carol", password=b"carol-pw") == 0x87
    native(srv, "USER_UPDATE", {"name": "carol", "enabled": True})
    assert connack(srv, 5, username="carol", password=b"carol-pw") == 0


def test_policy_change_applies_to_live_connections(srv: Server) -> None:
    add_user(srv, "dave", "dave-pw")
    dave = Client(srv.port, "dave-1", version=5, username="dave", password="dave-pw")
    first = dave.publish("plant/line1", b"x", qos=1)
    assert dave.pub_codes[first] == 0x87
    allow(srv, "dave", "Topic:plant/#", "PUB")
    deadline = time.monotonic() + 5
    while True:  # the change reaches the gateway through the notify bus
        mid = dave.publish("plant/line1", b"y", qos=1)
        if dave.pub_codes[mid] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert dave.pub_codes[mid] == 0
    dave.disconnect()


def test_brute_force_is_slowed(srv: Server) -> None:
    times = []
    for _ in range(5):
        t0 = time.monotonic()
        assert connack(srv, 4, username="alice", password=b"guess") == 4
        times.append(time.monotonic() - t0)
    # 0, 0.2, 0.4, 0.8, 1.6 s of delay for the 1st..5th failure from one address
    assert times[4] >= 1.2, times
    assert times[4] > times[1] * 2, times
    assert connack(srv, 4, username="alice", password=b"alice-pw") == 0  # still gets in


def test_publish_before_connect_is_rejected(srv: Server) -> None:
    """A PUBLISH as the first packet (before CONNECT) must not be stored."""
    watcher = Client(srv.port, "watch-312", username=ADMIN[0], password=ADMIN[1])
    watcher.subscribe("early/#", 0)
    raw = RawClient(srv.port, 4)
    raw.send(mqtt.Publish("early/bird", b"x", 0))
    assert raw.closed_by_server()
    raw.close()
    watcher.expect_none(0.5)
    watcher.disconnect()


def test_paho_subscribe_failure_scenario(tmp_path) -> None:
    """The paho interoperability 'subscribe failure' test: an ACL denies
    test/nosubscribe to everyone; anonymous clients may do the rest."""
    s = auth_server(tmp_path, "--allow-anonymous")
    try:
        allow(s, "*", "Topic:*", "PUB,SUB", match="any")
        allow(s, "*", "Topic:test/nosubscribe", "SUB", deny=True)
        for version, failure in ((4, 0x80), (5, 0x87)):
            c = Client(s.port, f"myclientid{version}", version=version)
            codes = c.subscribe("test/nosubscribe", 2)
            assert [x if isinstance(x, int) else x.value for x in codes] == [failure]
            assert c.subscribe("test/fine", 2) not in ([0x80], [0x87])
            c.disconnect()
    finally:
        assert s.stop() == 0


def test_stateless_strategy(tmp_path) -> None:
    s = auth_server(tmp_path, "--auth-strategy", "stateless")
    try:
        add_user(s, "eve", "eve-pw")
        allow(s, "eve", "Topic:a/#", "PUB,SUB")
        c = Client(s.port, "eve-1", version=5, username="eve", password="eve-pw")
        c.subscribe("a/#", 1)
        c.publish("a/b", b"1", qos=1)
        assert c.expect(1)[0].payload == b"1"
        mid = c.publish("b/c", b"2", qos=1)
        assert c.pub_codes[mid] == 0x87
        c.disconnect()
    finally:
        assert s.stop() == 0
