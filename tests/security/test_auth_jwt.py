"""JWT authentication beside the built-in users, against a real `lightgate serve`, paho
clients and a real JWKS endpoint on loopback; tokens signed here with PyJWT."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from gateway import mqtt
from tests.conftest import ROOT, Server
from tests.mqtt.paho_client import Client
from tests.mqtt.raw import RawClient
from tests.security.helpers import ADMIN, auth_server
from tests.security.http_service import HttpService

SECRET = "a-shared-secret-of-at-least-32-bytes!!"
BAD_CREDENTIALS_V5 = 0x86


def make_rsa() -> Any:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def jwk(private_key: Any, kid: str) -> dict[str, Any]:
    algo = jwt.algorithms.RSAAlgorithm if isinstance(private_key, rsa.RSAPrivateKey) \
        else jwt.algorithms.ECAlgorithm
    out = algo.to_jwk(private_key.public_key(), as_dict=True)
    return {**out, "kid": kid, "use": "sig"}


def token(key: Any, alg: str = "HS256", kid: str | None = None, ttl: float = 300,
          **claims: Any) -> str:
    now = int(time.time())
    body = {"iat": now, "exp": now + ttl, **claims}
    return jwt.encode(body, key, algorithm=alg, headers={"kid": kid} if kid else None)


class Keys:
    def __init__(self) -> None:
        self.rsa = make_rsa()
        self.ec = ec.generate_private_key(ec.SECP256R1())
        self.published = [jwk(self.rsa, "rsa1"), jwk(self.ec, "ec1")]


@pytest.fixture(scope="module")
def keys() -> Keys:
    return Keys()


@pytest.fixture(scope="module")
def jwks(keys: Keys) -> Iterator[HttpService]:
    svc = HttpService(lambda method, path, body: (200, {"keys": keys.published}, 0)).start()
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, jwks: HttpService) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("jwt")
    secret_file = tmp / "secret"
    secret_file.write_text(SECRET + "\n")  # the trailing newline an editor adds is dropped
    s = auth_server(tmp, "--auth-jwt-secret", f"@{secret_file}",
                    "--auth-jwt-jwks", f"{jwks.url}/jwks.json", "--auth-jwt-jwks-refresh-s", "1",
                    "--auth-jwt-algorithms", "HS256,RS256,ES256")
    yield s
    assert s.stop() == 0, s.logs()[-3000:]


def refused(srv: Server, client_id: str, username: str | None, password: str) -> int:
    raw = RawClient(srv.port, 5, timeout=15)  # failed logins slow down (up to 5 s)
    try:
        kw = {"username": username} if username else {}
        return raw.connect(client_id, password=password.encode(), **kw).reason_code
    finally:
        raw.close()


def test_hs256_token_logs_in_beside_the_builtin_users(srv: Server) -> None:
    dev = Client(srv.port, "dev-1", version=5, username="dev-1",
                 password=token(SECRET, sub="dev-1"))
    assert dev.connack[1] == 0
    assert srv.wait_log("[AUTHENTICATION] user=dev-1 ip=127.0.0.1 via=mqtt result=success "
                        "reason=jwt token")
    # No acl claim: only the '*' policies apply, and there are none: default deny.
    mid = dev.publish("anything/at/all", b"x", qos=1)
    assert dev.pub_codes[mid] == 0x87
    assert srv.wait_log("reason=jwt client without acl")
    admin = Client(srv.port, "admin-1", username=ADMIN[0], password=ADMIN[1])
    for c in (dev, admin):
        c.disconnect()
    # The username may come from the token alone (an empty CONNECT username).
    anon = Client(srv.port, "dev-2", version=5, username="",
                  password=token(SECRET, username="dev-2"))
    assert anon.connack[1] == 0
    assert srv.wait_log("[AUTHENTICATION] user=dev-2 ")
    anon.disconnect()


def test_rs256_and_es256_with_keys_from_the_jwks_url(srv: Server, keys: Keys,
                                                     jwks: HttpService) -> None:
    for alg, key, kid in (("RS256", keys.rsa, "rsa1"), ("ES256", keys.ec, "ec1")):
        c = Client(srv.port, f"dev-{alg}", version=5, username=f"dev-{alg}",
                   password=token(key, alg, kid, sub=f"dev-{alg}"))
        assert c.connack[1] == 0, alg
        c.disconnect()
    assert any(path == "/jwks.json" for _, path, _ in jwks.requests)


def test_expired_and_not_yet_valid_tokens_are_refused(srv: Server) -> None:
    expired = token(SECRET, ttl=-60, sub="late")
    assert refused(srv, "late", "late", expired) == BAD_CREDENTIALS_V5
    assert srv.wait_log("user=late ip=127.0.0.1 via=mqtt result=failure reason=jwt: token "
                        "expired")
    early = token(SECRET, nbf=int(time.time()) + 3600, sub="early")
    assert refused(srv, "early", "early", early) == BAD_CREDENTIALS_V5
    assert srv.wait_log("reason=jwt: token not valid yet (nbf)")
    ok = Client(srv.port, "on-time", username="on-time", password=token(SECRET, sub="on-time"))
    ok.disconnect()  # a success resets the failed-login delay for the next tests


def test_a_token_signed_with_the_wrong_key_is_refused(srv: Server, keys: Keys) -> None:
    forged = token("not-the-shared-secret-but-just-as-long!!", sub="mallory")
    assert refused(srv, "m1", "mallory", forged) == BAD_CREDENTIALS_V5
    assert srv.wait_log("user=mallory ip=127.0.0.1 via=mqtt result=failure reason=jwt: bad "
                        "signature")
    other_rsa = make_rsa()  # claims a published key id, signed by a key nobody published
    assert refused(srv, "m2", "mallory", token(other_rsa, "RS256", "rsa1")) \
        == BAD_CREDENTIALS_V5
    assert srv.wait_log("jwt: bad signature", count=2)
    assert refused(srv, "m3", "mallory", token(other_rsa, "RS256", "nope")) \
        == BAD_CREDENTIALS_V5
    assert srv.wait_log("reason=jwt: no key for RS256 kid=nope")
    # 'none' and an HMAC token made with the RSA public key (algorithm confusion)
    unsigned = jwt.encode({"sub": "mallory"}, None, algorithm="none")
    assert refused(srv, "m4", "mallory", unsigned) == BAD_CREDENTIALS_V5
    assert srv.wait_log("reason=jwt: algorithm 'none' not accepted")
    ok = Client(srv.port, "after-forgery", username="x", password=token(SECRET, sub="x"))
    ok.disconnect()


def test_a_token_bound_to_another_username_or_client_is_refused(srv: Server) -> None:
    assert refused(srv, "c1", "eve", token(SECRET, username="bob")) == BAD_CREDENTIALS_V5
    assert srv.wait_log("reason=jwt: the token is for another username")
    assert refused(srv, "c2", "bob", token(SECRET, username="bob", clientid="c9")) \
        == BAD_CREDENTIALS_V5
    assert srv.wait_log("reason=jwt: the token is for another client id")
    ok = Client(srv.port, "c9", username="bob", password=token(SECRET, username="bob",
                                                                clientid="c9"))
    ok.disconnect()


@pytest.mark.parametrize("alg", ["HS256", "ES256"])
def test_the_acl_claim_allows_and_denies_publish_and_subscribe(srv: Server, keys: Keys,
                                                               alg: str) -> None:
    acl = {"pub": ["devices/%c/up"], "sub": ["devices/%c/down", "users/%u/#"]}
    key, kid = (SECRET, None) if alg == "HS256" else (keys.ec, "ec1")
    cid, user = f"dev-{alg.lower()}", f"carol{alg.lower()}"
    dev = Client(srv.port, cid, version=5, username=user,
                 password=token(key, alg, kid, sub=user, acl=acl))
    watcher = Client(srv.port, f"watch-{alg}", username=ADMIN[0], password=ADMIN[1])
    watcher.subscribe("devices/#", 1)

    own = dev.publish(f"devices/{cid}/up", b"mine", qos=1)
    other = dev.publish("devices/someone-else/up", b"sneaky", qos=1)
    assert dev.pub_codes[own] == 0 and dev.pub_codes[other] == 0x87
    [got] = watcher.expect(1)
    assert (got.topic, got.payload) == (f"devices/{cid}/up", b"mine")
    watcher.expect_none(0.3)

    codes = dev.subscribe([(f"devices/{cid}/down", 1), (f"users/{user}/inbox", 1),
                           ("devices/+/down", 1), ("users/dave/#", 1)])
    assert [c.value for c in codes] == [1, 1, 0x87, 0x87]
    watcher.publish(f"devices/{cid}/down", b"cmd", qos=1)
    [got] = dev.expect(1)
    assert (got.topic, got.payload) == (f"devices/{cid}/down", b"cmd")
    assert srv.wait_log(f"[AUTHORIZATION] user={user} ip=127.0.0.1 action=PUB "
                        f"resource=Topic:devices/{cid}/up result=allow reason=jwt acl pub "
                        f"devices/{cid}/up")
    assert srv.wait_log(f"[AUTHORIZATION] user={user} ip=127.0.0.1 action=SUB "
                        "resource=Topic:users/dave/# result=deny")
    for c in (dev, watcher):
        c.disconnect()


def test_a_placeholder_never_widens_the_acl(srv: Server) -> None:
    """A client id of '+' must not turn devices/%c/up into every device's topic."""
    dev = Client(srv.port, "+", version=5, username="plus",
                 password=token(SECRET, sub="plus", acl={"pub": ["devices/%c/up"]}))
    mid = dev.publish("devices/victim/up", b"x", qos=1)
    assert dev.pub_codes[mid] == 0x87
    dev.disconnect()


def test_a_rotated_key_is_picked_up_from_the_jwks_url(srv: Server, keys: Keys) -> None:
    new_key = make_rsa()
    keys.published = [*keys.published, jwk(new_key, "rsa2")]
    try:
        deadline = time.monotonic() + 15  # refresh every 1 s; an unknown kid after 5 s
        while True:
            raw = RawClient(srv.port, 5, timeout=15)
            try:
                code = raw.connect("rotated", username="rot",
                                   password=token(new_key, "RS256", "rsa2",
                                                  sub="rot").encode()).reason_code
            finally:
                raw.close()
            if code == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert code == 0
    finally:
        keys.published = keys.published[:2]


def test_a_jwt_backend_alone_turns_auth_on_with_a_jwks_file(tmp_path: Path, keys: Keys) -> None:
    jwks_file = tmp_path / "jwks.json"
    jwks_file.write_text(json.dumps({"keys": [jwk(keys.ec, "ec1")]}))
    s = Server(tmp_path / "data", "--init-user", f"{ADMIN[0]}:{ADMIN[1]}",
               "--auth-jwt-jwks", str(jwks_file), "--auth-order", "jwt,builtin").start()
    try:
        raw = RawClient(s.port, 4)
        try:
            assert raw.connect("nobody").reason_code == 5  # auth is on: anonymous refused
        finally:
            raw.close()
        c = Client(s.port, "es", username="es",
                   password=token(keys.ec, "ES256", "ec1", sub="es"))
        c.disconnect()
        # HS256 was not asked for (a JWKS alone means RS256,ES256)
        assert refused(s, "hs", "hs", token(SECRET, sub="hs")) == BAD_CREDENTIALS_V5
        assert s.wait_log("reason=jwt: algorithm 'HS256' not accepted")
        # jwt first, then the built-in users: a plain password is no token, builtin decides
        admin = Client(s.port, "adm", username=ADMIN[0], password=ADMIN[1])
        admin.disconnect()
    finally:
        assert s.stop() == 0, s.logs()[-3000:]


@pytest.mark.parametrize(("args", "message"), [
    (["--auth-order", "builtin,jwt"], "the jwt backend needs --auth-jwt-secret"),
    (["--auth-jwt-jwks", "/nonexistent/jwks.json"], "--auth-jwt-jwks /nonexistent/jwks.json"),
    (["--auth-jwt-secret", "s", "--auth-jwt-algorithms", "RS256"],
     "--auth-jwt-algorithms RS256 needs --auth-jwt-jwks"),
    (["--auth-order", "builtin,ldap"], "--auth-order takes a comma list"),
    # keys fetched in the clear could be swapped on the way: only loopback may be plain
    (["--auth-jwt-jwks", "http://idp.example/jwks.json"],
     "--auth-jwt-jwks http://idp.example/jwks.json: keys over plain http"),
    (["--auth-jwt-jwks", "http://[::2]:8080/jwks.json"], "use https://"),
    # valid settings, but a backend turns auth on and nobody could run the store's side
    (["--auth-jwt-secret", SECRET], "needs a Super user"),
])
def test_a_bad_jwt_setting_stops_start_up_with_one_line(tmp_path: Path, args: list[str],
                                                        message: str) -> None:
    r = subprocess.run([sys.executable, "-m", "lightgate", "--log-level", "WARNING", "serve",
                        "--data-dir",
                        str(tmp_path / "d"), "--mqtt", "127.0.0.1:0", "--ws", "off",
                        "--native", "127.0.0.1:0", "--http", "127.0.0.1:0", *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and message in r.stderr, r.stderr


def test_a_separated_gateway_takes_jwt_settings_of_its_own(tmp_path: Path) -> None:
    """The store keeps to its built-in users; the gateway asks its own JWT backend."""
    store = Server(tmp_path / "store", "--auth", "--init-user", f"{ADMIN[0]}:{ADMIN[1]}",
                   command="store").start()
    gw = None
    try:
        gw = Server(None, "--store", store.native, "--store-auth", f"{ADMIN[0]}:{ADMIN[1]}",
                    "--auth-jwt-secret", SECRET, command="gateway").start()
        dev = Client(gw.port, "gw-dev", version=5, username="gw-dev",
                     password=token(SECRET, sub="gw-dev", acl={"pub": ["devices/%c/#"]}))
        ok = dev.publish("devices/gw-dev/up", b"x", qos=1)
        no = dev.publish("devices/other/up", b"x", qos=1)
        assert dev.pub_codes[ok] == 0 and dev.pub_codes[no] == 0x87
        dev.disconnect()
        admin = Client(gw.port, "gw-admin", username=ADMIN[0], password=ADMIN[1])
        admin.disconnect()
        assert gw.wait_log("MQTT authentication backends builtin,jwt")
        assert gw.wait_log("[AUTHENTICATION] user=gw-dev ip=127.0.0.1 via=mqtt result=success "
                           "reason=jwt token")
    finally:
        if gw is not None:
            assert gw.stop() == 0, gw.logs()[-3000:]
        assert store.stop() == 0, store.logs()[-3000:]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def hand_made_token(header: dict[str, Any], claims: dict[str, Any],
                    secret: str = SECRET) -> str:
    """An HS256 token signed with the right secret but laid out by hand: PyJWT will not
    encode the malformed headers a stranger may send."""
    signing_input = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(claims).encode())}"
    mac = hmac.new(secret.encode(), signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{_b64(mac)}"


@pytest.mark.parametrize("header", [
    {"alg": "HS256", "kid": 7},  # a key id that is no string
    {"alg": "HS256", "kid": ["a"]},
    {"alg": "HS256", "crit": ["x-unknown"]},
    {"alg": "HS256", "crit": "x"},
])
def test_a_malformed_token_header_is_refused_like_any_bad_password(srv: Server,
                                                                   header: dict) -> None:
    ok = Client(srv.port, "reset-bad-header", username="r", password=token(SECRET, sub="r"))
    ok.disconnect()  # no earlier failure slows these down
    bad = hand_made_token(header, {"sub": "stranger", "exp": int(time.time()) + 60})
    assert refused(srv, "bad-header-5", "stranger", bad) == BAD_CREDENTIALS_V5
    assert srv.wait_log("user=stranger ip=127.0.0.1 via=mqtt result=failure reason=jwt: bad "
                        "header")
    raw = RawClient(srv.port, 4, timeout=15)
    try:
        started = time.monotonic()
        code = raw.connect("bad-header-4", username="stranger",
                           password=bad.encode()).reason_code
        waited = time.monotonic() - started
    finally:
        raw.close()
    assert code == 4  # 3.1.1: bad user name or password
    assert waited >= 0.15, "the failed-login back-off must slow the next attempt"
    assert "Traceback" not in srv.logs()


def test_the_identity_is_the_tokens_and_a_different_username_is_refused(srv: Server) -> None:
    alice = token(SECRET, sub="alice", acl={"sub": ["users/%u/#"]})
    assert refused(srv, "as-oscar", "oscar", alice) == BAD_CREDENTIALS_V5
    assert srv.wait_log("user=oscar ip=127.0.0.1 via=mqtt result=failure reason=jwt: the token "
                        "is for another username")
    raw = RawClient(srv.port, 4, timeout=15)
    try:
        assert raw.connect("as-oscar-4", username="oscar", password=alice.encode()).reason_code == 4
    finally:
        raw.close()
    # No username, or the token's own: the token's identity, and %u is it.
    for client_id, username in (("as-nobody", ""), ("as-alice", "alice")):
        c = Client(srv.port, client_id, version=5, username=username, password=alice)
        codes = c.subscribe([("users/alice/inbox", 1), ("users/oscar/inbox", 1)])
        assert [x.value for x in codes] == [1, 0x87]
        c.disconnect()
    assert srv.wait_log("[AUTHENTICATION] user=alice ip=127.0.0.1 via=mqtt result=success",
                        count=2)
    assert "user=oscar ip=127.0.0.1 via=mqtt result=success" not in srv.logs()
    # A token that names nobody vouches for no one.
    assert refused(srv, "as-whoever", "carl", token(SECRET)) == BAD_CREDENTIALS_V5
    assert srv.wait_log("reason=jwt: the token names no user")
    ok = Client(srv.port, "reset-identity", username="r", password=token(SECRET, sub="r"))
    ok.disconnect()


def test_a_connection_ends_when_its_token_expires(srv: Server) -> None:
    """MQTT 5: DISCONNECT 0xA0 (Maximum connect time) at the token's exp; 3.1.1: closed.
    Keepalive 0: only the expiry can end them."""
    v5 = RawClient(srv.port, 5, timeout=10)
    v4 = RawClient(srv.port, 4, timeout=10)
    try:
        short = token(SECRET, ttl=2, sub="short-lived")
        assert v5.connect("short-5", keepalive=0, username="short-lived",
                          password=short.encode()).reason_code == 0
        assert v4.connect("short-4", keepalive=0, username="short-lived",
                          password=short.encode()).reason_code == 0
        started = time.monotonic()
        v5.send(mqtt.Pingreq())
        assert isinstance(v5.recv(), mqtt.Pingresp)  # alive before its exp
        bye = v5.recv()
        assert isinstance(bye, mqtt.Disconnect), bye
        assert bye.reason_code == 0xA0
        assert time.monotonic() - started < 4
        assert v4.closed_by_server()
        assert time.monotonic() - started < 5
    finally:
        v5.close()
        v4.close()
    assert srv.wait_log("disconnected: credentials expired")


def _token_with_raw_exp(exp: str, sub: str) -> str:
    """An HS256 token whose exp is written as given: a number JSON can hold but Python's
    float or int conversions cannot (json.dumps would never write these)."""
    claims = f'{{"sub": "{sub}", "exp": {exp}}}'.encode()
    header = _b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    signing_input = f"{header}.{_b64(claims)}"
    mac = hmac.new(SECRET.encode(), signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{_b64(mac)}"


@pytest.mark.parametrize("exp", ["1e400", "1" + "0" * 400, "-1e400"])
def test_an_exp_out_of_any_range_is_a_bad_token(srv: Server, exp: str) -> None:
    """1e400 is infinity once parsed, and a 400-digit integer has no float: either is a
    bad token (CONNACK not authorized), never an exception inside the gateway."""
    ok = Client(srv.port, "reset-huge-exp", username="r", password=token(SECRET, sub="r"))
    ok.disconnect()  # no earlier failure slows these down
    bad = _token_with_raw_exp(exp, "forever")
    assert refused(srv, "huge-exp-5", "forever", bad) == BAD_CREDENTIALS_V5
    raw = RawClient(srv.port, 4, timeout=15)
    try:
        assert raw.connect("huge-exp-4", username="forever",
                           password=bad.encode()).reason_code == 4
    finally:
        raw.close()
    assert srv.wait_log("user=forever ip=127.0.0.1 via=mqtt result=failure reason=jwt: ")
    assert "Traceback" not in srv.logs()
    assert "OverflowError" not in srv.logs()
