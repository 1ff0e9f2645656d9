"""The HTTP auth hook, against a real `lightgate serve`, paho clients and a real HTTP
service on loopback that plays the operator's auth service."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway import mqtt
from tests.conftest import ROOT, Server
from tests.mqtt.paho_client import Client
from tests.mqtt.raw import RawClient
from tests.security.helpers import ADMIN, add_user, allow, auth_server
from tests.security.http_service import Answer, HttpService, closed_port_url

BAD_CREDENTIALS_V5 = 0x86
SLOW_S = 2.0  # the "slow" user's answer; the server waits 0.5 s


def operator_service(method: str, path: str, body: Any) -> Answer:
    """What the operator's service says, by username (and action)."""
    user, action = body.get("username"), body.get("action")
    if action == "connect":
        if user == "good":
            return 200, {"result": "allow" if body["password"] == "pw" else "deny"}, 0
        if user == "plain":
            return 204, None, 0
        if user == "forbidden":
            return 403, None, 0
        if user == "slow":
            return 200, {"result": "allow"}, SLOW_S
        if user == "broken":
            return 500, b"oops", 0
        if user == "claims":
            return 200, {"result": "allow", "acl": {"pub": ["devices/%c/up"]}}, 0
        if user == "boss":
            return 200, {"result": "allow", "is_superuser": True}, 0
        if user in ("acl-dev", "anyone", "home-dev"):
            return 200, {"result": "allow"}, 0
        if user == "expiring":  # allowed for two seconds from now
            return 200, {"result": "allow", "expire_at": time.time() + 2}, 0
        if user == "bad-expiry":
            return 200, {"result": "allow", "expire_at": "tomorrow"}, 0
        return 200, {"result": "ignore"}, 0
    if user == "acl-dev":  # publish / subscribe: only under devices/<client id>/
        mine = body["topic"].startswith(f"devices/{body['clientid']}/")
        return 200, {"result": "allow" if mine else "deny"}, 0
    if user == "claims":
        return 200, {"result": "ignore"}, 0  # the ACL given on connect decides
    if user == "home-dev" and action == "subscribe":  # all of home/ but its secret
        return 200, {"result": "deny" if body["topic"] == "home/secret" else "allow"}, 0
    return 403, None, 0


@pytest.fixture(scope="module")
def hook() -> Iterator[HttpService]:
    svc = HttpService(operator_service).start()
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, hook: HttpService) -> Iterator[Server]:
    s = auth_server(tmp_path_factory.mktemp("hook"), "--auth-http-url", f"{hook.url}/auth",
                    "--auth-http-timeout-s", "0.5", "--auth-http-acl")
    yield s
    assert s.stop() == 0, s.logs()[-3000:]


def connack(port: int, client_id: str, username: str | None = None,
            password: str | None = None) -> int:
    raw = RawClient(port, 5, timeout=15)  # failed logins slow down (up to 5 s)
    try:
        kw: dict[str, Any] = {"username": username} if username is not None else {}
        if password is not None:
            kw["password"] = password.encode()
        return raw.connect(client_id, **kw).reason_code
    finally:
        raw.close()


def test_the_hook_allows_a_connect_and_gets_its_fields(srv: Server, hook: HttpService) -> None:
    c = Client(srv.port, "dev-good", version=5, username="good", password="pw")
    assert c.connack[1] == 0
    c.disconnect()
    [body] = hook.bodies(action="connect", clientid="dev-good")
    assert body == {"action": "connect", "clientid": "dev-good", "username": "good",
                    "password": "pw", "peerhost": "127.0.0.1", "cert_common_name": "",
                    "protocol": "mqtt"}
    assert srv.wait_log("[AUTHENTICATION] user=good ip=127.0.0.1 via=mqtt result=success "
                        "reason=http: allow")
    assert connack(srv.port, "dev-plain", "plain", "x") == 0  # 204: allow


def test_definite_answers_are_cached(srv: Server, hook: HttpService) -> None:
    for _ in range(3):
        assert connack(srv.port, "dev-cached", "good", "pw") == 0
    assert len(hook.bodies(action="connect", clientid="dev-cached")) == 1


def test_the_hook_denies(srv: Server) -> None:
    assert connack(srv.port, "dev-bad", "good", "wrong") == BAD_CREDENTIALS_V5
    assert srv.wait_log("user=good ip=127.0.0.1 via=mqtt result=failure reason=http: deny")
    assert connack(srv.port, "dev-403", "forbidden", "x") == BAD_CREDENTIALS_V5
    assert srv.wait_log("user=forbidden ip=127.0.0.1 via=mqtt result=failure reason=http: 403")
    assert connack(srv.port, "reset", "plain", "x") == 0  # a success resets the login delay


def test_a_slow_or_broken_hook_means_deny(srv: Server) -> None:
    start = time.monotonic()
    assert connack(srv.port, "dev-slow", "slow", "x") == BAD_CREDENTIALS_V5
    assert time.monotonic() - start < SLOW_S  # the server gave up after 0.5 s
    assert srv.wait_log("user=slow ip=127.0.0.1 via=mqtt result=failure reason=http: no "
                        "answer within 0.5 s (--auth-http-on-error deny)")
    assert connack(srv.port, "dev-500", "broken", "x") == BAD_CREDENTIALS_V5
    assert srv.wait_log("reason=http: answered 500 (--auth-http-on-error deny)")
    assert connack(srv.port, "reset", "plain", "x") == 0


def test_ignore_asks_the_next_backend_and_builtin_users_never_reach_the_hook(
        srv: Server, hook: HttpService) -> None:
    admin = Client(srv.port, "adm", version=5, username=ADMIN[0], password=ADMIN[1])
    admin.disconnect()
    assert not hook.bodies(username=ADMIN[0])  # builtin comes first and knows admin
    assert connack(srv.port, "dev-who", "stranger", "x") == BAD_CREDENTIALS_V5
    assert hook.bodies(username="stranger")
    assert srv.wait_log("user=stranger ip=127.0.0.1 via=mqtt result=failure reason=bad "
                        "username or password; http: ignore")
    assert connack(srv.port, "reset", "plain", "x") == 0


def test_the_hook_decides_each_publish_and_subscribe(srv: Server, hook: HttpService) -> None:
    dev = Client(srv.port, "d1", version=5, username="acl-dev", password="x")
    watcher = Client(srv.port, "watch-hook", username=ADMIN[0], password=ADMIN[1])
    watcher.subscribe("devices/#", 1)
    own = dev.publish("devices/d1/up", b"mine", qos=1)
    other = dev.publish("devices/d2/up", b"sneaky", qos=1)
    assert dev.pub_codes[own] == 0 and dev.pub_codes[other] == 0x87
    [got] = watcher.expect(1)
    assert (got.topic, got.payload) == ("devices/d1/up", b"mine")
    codes = dev.subscribe([("devices/d1/#", 1), ("devices/#", 1)])
    assert [c.value for c in codes] == [1, 0x87]
    watcher.publish("devices/d1/cmd", b"go", qos=1)
    [got] = dev.expect(1)
    assert got.topic == "devices/d1/cmd"
    assert hook.bodies(action="publish", clientid="d1", topic="devices/d2/up") == [
        {"action": "publish", "clientid": "d1", "username": "acl-dev",
         "peerhost": "127.0.0.1", "topic": "devices/d2/up"}]
    assert hook.bodies(action="subscribe", clientid="d1", topic="devices/#")
    assert srv.wait_log("[AUTHORIZATION] user=acl-dev ip=127.0.0.1 action=PUB "
                        "resource=Topic:devices/d2/up result=deny reason=http: deny")
    for c in (dev, watcher):
        c.disconnect()


def test_an_acl_in_the_connect_answer_and_a_superuser(srv: Server) -> None:
    dev = Client(srv.port, "d7", version=5, username="claims", password="x")
    ok = dev.publish("devices/d7/up", b"x", qos=1)
    no = dev.publish("devices/d8/up", b"x", qos=1)
    assert dev.pub_codes[ok] == 0 and dev.pub_codes[no] == 0x87
    assert srv.wait_log("reason=http: ignore, then http acl pub devices/d7/up")
    boss = Client(srv.port, "b1", version=5, username="boss", password="x")
    mid = boss.publish("anywhere/at/all", b"x", qos=1)
    assert boss.pub_codes[mid] == 0
    for c in (dev, boss):
        c.disconnect()


def test_a_connection_ends_at_the_hooks_expire_at(srv: Server, hook: HttpService) -> None:
    raw = RawClient(srv.port, 5, timeout=10)
    try:
        assert raw.connect("dev-expiring", keepalive=0, username="expiring",
                           password=b"x").reason_code == 0
        started = time.monotonic()
        bye = raw.recv()
        assert isinstance(bye, mqtt.Disconnect), bye
        assert bye.reason_code == 0xA0  # Maximum connect time
        assert time.monotonic() - started < 4
    finally:
        raw.close()
    # The answer is not cached past its expire_at: the next CONNECT asks the hook again.
    asked = len(hook.bodies(action="connect", username="expiring"))
    assert connack(srv.port, "dev-expiring", "expiring", "x") == 0
    assert len(hook.bodies(action="connect", username="expiring")) == asked + 1
    # An expire_at that is no time is a confused hook: --auth-http-on-error (deny).
    assert connack(srv.port, "dev-bad-expiry", "bad-expiry", "x") == BAD_CREDENTIALS_V5
    assert srv.wait_log("reason=http: answered expire_at='tomorrow' (expected epoch seconds)")
    assert connack(srv.port, "reset", "plain", "x") == 0


def test_the_hook_decides_each_delivered_topic_too(srv: Server, hook: HttpService) -> None:
    """A filter the hook allowed may catch topics it denies: each delivery is asked
    about (answers cached), as a policy client's deliveries are checked."""
    dev = Client(srv.port, "home-1", version=5, username="home-dev", password="x")
    assert [c.value for c in dev.subscribe([("home/#", 1)])] == [1]
    admin = Client(srv.port, "home-admin", username=ADMIN[0], password=ADMIN[1])
    admin.subscribe("home/#", 1)  # something that gets both, to know both went out
    for topic in ("home/secret", "home/open", "home/secret"):
        admin.publish(topic, topic.encode(), qos=1)
    admin.expect(3)
    assert [m.topic for m in dev.expect(1)] == ["home/open"]
    dev.expect_none(0.5)
    assert hook.bodies(action="subscribe", clientid="home-1", topic="home/secret")
    assert srv.wait_log("[AUTHORIZATION] user=home-dev ip=127.0.0.1 action=SUB "
                        "resource=Topic:home/secret result=deny reason=http: deny")
    for c in (dev, admin):
        c.disconnect()


def _connack_code(port: int, client_id: str, version: int, username: str,
                  password: str, clean: bool, **kw: Any) -> int:
    raw = RawClient(port, version, timeout=5)
    try:
        ack = raw.connect(client_id, clean=clean, username=username,
                          password=password.encode(), **kw)
        return ack.reason_code if version == 5 else ack.return_code
    finally:
        raw.close()


def test_another_user_may_not_take_a_client_id(srv: Server) -> None:
    """Same client id, another identity: refused (v5 0x87, 3.1.1 5), whether it asks to
    resume or to start clean, while the owner is connected or away; the owner's session
    (its subscriptions, what it had in flight, what it missed) stays its own."""
    add_user(srv, "alice", "alice-pw")
    allow(srv, "alice", "Topic:private/#", "SUB")
    add_user(srv, "bob", "bob-pw")  # no rights at all
    props = {"session_expiry_interval": 300}
    admin = Client(srv.port, "private-admin", username=ADMIN[0], password=ADMIN[1])
    for who, password in (("bob", "bob-pw"), ("anyone", "x")):  # built-in, then hook
        cid = f"handover-{who}"
        alice = RawClient(srv.port, 5)
        assert alice.connect(cid, clean=False, username="alice", password=b"alice-pw",
                             properties=props).reason_code == 0
        alice.subscribe("private/#", 1)
        # While alice is connected: no takeover, and her connection goes on.
        assert _connack_code(srv.port, cid, 5, who, password, False,
                             properties=props) == 0x87
        admin.publish("private/a", b"in flight", qos=1)
        got = alice.recv()
        assert isinstance(got, mqtt.Publish) and got.payload == b"in flight"
        alice.close()  # gone without PUBACK: in flight, resent on resume
        admin.publish("private/b", b"missed", qos=1)
        for version, clean, code in ((5, False, 0x87), (5, True, 0x87), (4, False, 5),
                                     (4, True, 5)):
            kw = {"properties": props} if version == 5 else {}
            assert _connack_code(srv.port, cid, version, who, password, clean, **kw) \
                == code, (who, version, clean)
        assert srv.wait_log(f"with client id '{cid}' refused: its session belongs to "
                            "builtin:alice")
        again = RawClient(srv.port, 5, timeout=5)  # alice's session is all there
        try:
            ack = again.connect(cid, clean=False, username="alice", password=b"alice-pw",
                                properties=props)
            assert ack.reason_code == 0 and ack.session_present
            first, second = again.recv(), again.recv()
            assert (first.payload, first.dup) == (b"in flight", True)
            assert second.payload == b"missed"
        finally:
            again.close()
    admin.disconnect()


@pytest.mark.parametrize("on_error", [None, "next", "allow"])
def test_when_the_service_is_down(tmp_path: Path, on_error: str | None) -> None:
    """Down: deny by default (even a built-in user, the hook being asked first); `next`
    asks the built-in users instead; `allow` lets everyone in."""
    extra = ["--auth-http-on-error", on_error] if on_error else []
    s = auth_server(tmp_path, "--auth-http-url", closed_port_url(), "--auth-order",
                    "http,builtin", *extra)
    try:
        admin = connack(s.port, "adm", *ADMIN)
        stranger = connack(s.port, "who", "stranger", "x")
        if on_error is None:
            assert (admin, stranger) == (BAD_CREDENTIALS_V5, BAD_CREDENTIALS_V5)
            assert s.wait_log("result=failure reason=http: ConnectError")
            assert "(--auth-http-on-error deny)" in s.logs()
        elif on_error == "next":
            assert (admin, stranger) == (0, BAD_CREDENTIALS_V5)
            assert s.wait_log("user=stranger ip=127.0.0.1 via=mqtt result=failure reason=http:"
                              " ConnectError")
        else:
            assert (admin, stranger) == (0, 0)
            assert s.wait_log("user=stranger ip=127.0.0.1 via=mqtt result=success reason=http:"
                              " ConnectError")
        assert s.wait_log("auth hook http://127.0.0.1")  # the outage is logged (once)
    finally:
        assert s.stop() == 0, s.logs()[-3000:]


@pytest.mark.parametrize(("args", "message"), [
    (["--auth-order", "builtin,http"], "the http backend needs --auth-http-url"),
    (["--auth-http-url", "ftp://x"], "--auth-http-url must be an http:// or https:// URL"),
    (["--auth-http-url", "http://x", "--auth-http-on-error", "maybe"],
     "--auth-http-on-error must be deny, allow or next, not 'maybe'"),
])
def test_a_bad_hook_setting_stops_start_up_with_one_line(tmp_path: Path, args: list[str],
                                                         message: str) -> None:
    r = subprocess.run([sys.executable, "-m", "lightgate", "serve", "--data-dir",
                        str(tmp_path / "d"), "--mqtt", "127.0.0.1:0", "--ws", "off",
                        "--native", "127.0.0.1:0", "--http", "127.0.0.1:0", *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and message in r.stderr, r.stderr
