"""The backends' small parts on their own: claims ACLs, the chain's settings, and the hook
and JWT backends driven directly under trio (a real HTTP service, real tokens)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import jwt
import pytest
import trio

from gateway.auth.chain import BackendConfig
from gateway.auth.http_hook import HttpHook
from gateway.auth.jwt_backend import JwtBackend
from store.auth.backends import ALLOW, DENY, IGNORE, Credentials
from store.auth.topic_acl import TopicAcl
from tests.security.http_service import HttpService


def test_placeholders_are_filled_and_never_widen() -> None:
    acl = TopicAcl.parse({"pub": ["devices/%c/up"], "sub": "users/%u/#",
                          "all": ["shared/#"]}, "dev1", "carol")
    assert acl == TopicAcl(("devices/dev1/up", "shared/#"), ("users/carol/#", "shared/#"))
    assert acl.decide("PUB", "devices/dev1/up", False)[0]
    assert not acl.decide("PUB", "devices/dev2/up", False)[0]
    assert acl.decide("SUB", "users/carol/inbox/+", True)[0]
    assert not acl.decide("SUB", "users/#", True)[0]  # wider than the grant
    assert not acl.decide("GET", "devices/dev1/up", False)[0]
    for cid in ("+", "#", "a/b", ""):  # such ids would widen or shift the pattern: dropped
        assert TopicAcl.parse({"pub": ["devices/%c/up"]}, cid, "u").pub == ()


@pytest.mark.parametrize("bad", [["x"], {"pub": "a/#/b"}, {"pub": [1]}, {"publish": ["a"]}])
def test_a_malformed_acl_is_refused(bad: object) -> None:
    with pytest.raises(ValueError):
        TopicAcl.parse(bad, "c", "u")


def test_the_default_order_follows_what_is_configured() -> None:
    assert BackendConfig().chain == ("builtin",)
    assert not BackendConfig().external
    cfg = BackendConfig(jwt_secret="s", http_url="http://h/")
    assert cfg.chain == ("builtin", "jwt", "http") and cfg.external
    assert cfg.algorithms == ("HS256",)
    assert BackendConfig(jwt_jwks="https://idp/jwks").algorithms == ("RS256", "ES256")
    with pytest.raises(ValueError, match="each once"):
        BackendConfig(order=("jwt", "jwt"), jwt_secret="s").check()


@pytest.fixture
def slow_hook() -> Iterator[HttpService]:
    svc = HttpService(lambda method, path, body: (200, {"result": "allow"}, 0.3)).start()
    yield svc
    svc.stop()


async def test_the_hook_call_leaves_the_event_loop_free(slow_hook: HttpService) -> None:
    hook = HttpHook(slow_hook.url, timeout_s=2, cache_s=0)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await trio.sleep(0.01)
            ticks += 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        d = await hook.authenticate(Credentials("c", "u", "p", "127.0.0.1", None))
        nursery.cancel_scope.cancel()
    assert d.outcome == ALLOW
    assert ticks >= 10  # the loop kept running while the service took 0.3 s


async def test_jwt_backend_answers() -> None:
    secret = b"s" * 64
    backend = JwtBackend(secret, None, ("HS256",))

    async def outcome(password: str | None, **kw: str) -> str:
        creds = Credentials(kw.get("client_id", "c"), kw.get("username"), password,
                            "127.0.0.1", None)
        return (await backend.authenticate(creds)).outcome

    assert await outcome(None) == IGNORE
    assert await outcome("a plain password") == IGNORE  # the next backend may know it
    assert await outcome(jwt.encode({"sub": "x"}, secret, "HS256")) == ALLOW
    assert await outcome(jwt.encode({"sub": "x"}, b"t" * 64, "HS256")) == DENY
    assert await outcome(jwt.encode({"sub": "x"}, secret, "HS384")) == DENY  # not accepted
    now = int(time.time())
    assert await outcome(jwt.encode({"exp": now - 1}, secret, "HS256")) == DENY
    assert await outcome(jwt.encode({"nbf": now + 60}, secret, "HS256")) == DENY
    # iat only says when it was made: an issuer's clock running ahead must not fail it
    assert await outcome(jwt.encode({"sub": "x", "iat": now + 60}, secret, "HS256")) == ALLOW
    bad_acl = jwt.encode({"sub": "x", "acl": {"pub": "a/#/b"}}, secret, "HS256")
    assert await outcome(bad_acl) == DENY
