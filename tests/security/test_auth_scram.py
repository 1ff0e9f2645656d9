"""MQTT 5 enhanced authentication with SCRAM-SHA-256 (§4.12, RFC 5802/7677) against a
real `lightgate serve --auth`, driven by a raw-socket client whose SCRAM side is written
here from the RFC with the standard library alone (not the server's library)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from collections.abc import Iterator

import pytest

from gateway import mqtt
from gateway.auth.enhanced import CONTINUE, FAILURE
from gateway.auth.scram import ScramSha256
from store.auth.passwords import make_verifier
from tests.conftest import Server
from tests.mqtt.raw import RawClient
from tests.security.helpers import ADMIN, add_user, allow, auth_server, native

METHOD = "SCRAM-SHA-256"


class ScramClient:
    """RFC 5802 §3 client side, no channel binding (gs2 header "n,,")."""

    def __init__(self, user: str, password: str) -> None:
        self.user, self.password = user, password
        self.nonce = base64.b64encode(os.urandom(18)).decode()
        self.first_bare = f"n={user.replace('=', '=3D').replace(',', '=2C')},r={self.nonce}"
        self.server_signature = b""

    def first(self) -> bytes:
        return f"n,,{self.first_bare}".encode()

    def final(self, server_first: bytes) -> bytes:
        attrs = dict(a.split("=", 1) for a in server_first.decode().split(","))
        assert attrs["r"].startswith(self.nonce) and len(attrs["r"]) > len(self.nonce)
        salted = hashlib.pbkdf2_hmac("sha256", self.password.encode(),
                                     base64.b64decode(attrs["s"]), int(attrs["i"]))
        client_key = hmac.digest(salted, b"Client Key", "sha256")
        stored_key = hashlib.sha256(client_key).digest()
        without_proof = f"c={base64.b64encode(b'n,,').decode()},r={attrs['r']}"
        auth_message = f"{self.first_bare},{server_first.decode()},{without_proof}".encode()
        signature = hmac.digest(stored_key, auth_message, "sha256")
        proof = bytes(a ^ b for a, b in zip(client_key, signature, strict=True))
        server_key = hmac.digest(salted, b"Server Key", "sha256")
        self.server_signature = hmac.digest(server_key, auth_message, "sha256")
        return f"{without_proof},p={base64.b64encode(proof).decode()}".encode()

    def verify(self, server_final: bytes) -> None:
        """The server knew the verifier too (mutual authentication)."""
        assert server_final.decode() == \
            f"v={base64.b64encode(self.server_signature).decode()}", server_final


def auth(code: int, data: bytes, method: str = METHOD) -> mqtt.Auth:
    return mqtt.Auth(code, {"authentication_method": method, "authentication_data": data})


def scram_connect(port: int, client_id: str, user: str, password: str,
                  **kw: object) -> tuple[RawClient, mqtt.Connack]:
    """CONNECT with SCRAM; returns the client and the CONNACK (verified when 0)."""
    c = RawClient(port, 5)
    scram = ScramClient(user, password)
    c.send(mqtt.Connect(client_id=client_id, protocol_level=5, clean_start=True, keepalive=60,
                        properties={"authentication_method": METHOD,
                                    "authentication_data": scram.first()}, **kw))
    challenge = c.recv()
    if isinstance(challenge, mqtt.Connack):  # refused before any exchange
        return c, challenge
    assert isinstance(challenge, mqtt.Auth), challenge
    assert challenge.reason_code == 0x18
    assert challenge.properties["authentication_method"] == METHOD
    c.send(auth(0x18, scram.final(challenge.properties["authentication_data"])))
    ack = c.recv()
    assert isinstance(ack, mqtt.Connack), ack
    if ack.reason_code == 0:
        assert ack.properties["authentication_method"] == METHOD
        scram.verify(ack.properties["authentication_data"])
    return c, ack


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = auth_server(tmp_path_factory.mktemp("scram"))
    add_user(s, "carol", "carol-pw")
    allow(s, "carol", "Topic:scram/#", "PUB,SUB")
    yield s
    assert s.stop() == 0, s.logs()[-3000:]


def test_scram_connect_then_publish(srv: Server) -> None:
    c, ack = scram_connect(srv.port, "scram-1", "carol", "carol-pw")
    assert ack.reason_code == 0, ack
    c.send(mqtt.Subscribe(1, [("scram/t", mqtt.SubscriptionOptions(1))]))
    assert isinstance(c.recv(), mqtt.Suback)
    c.send(mqtt.Publish("scram/t", b"hello", qos=1, packet_id=2))
    got = {type(c.recv()), type(c.recv())}
    assert got == {mqtt.Puback, mqtt.Publish}
    c.close()
    assert srv.wait_log("[AUTHENTICATION] user=carol ip=127.0.0.1 via=mqtt result=success "
                        "reason=SCRAM-SHA-256")
    # The Super user made by --init-user on first start has a verifier as well.
    c, ack = scram_connect(srv.port, "scram-admin", *ADMIN)
    assert ack.reason_code == 0
    c.close()


@pytest.mark.parametrize(("user", "password"), [("carol", "wrong"), ("nobody", "carol-pw")])
def test_scram_bad_password_or_unknown_user_is_refused(srv: Server, user: str,
                                                       password: str) -> None:
    c, ack = scram_connect(srv.port, "scram-bad", user, password)
    assert ack.reason_code == 0x86  # the same for both: no telling which users exist
    assert "authentication_data" not in ack.properties
    assert c.closed_by_server()
    assert srv.wait_log(f"[AUTHENTICATION] user={user} ip=127.0.0.1 via=mqtt "
                        "result=failure reason=SCRAM-SHA-256: bad username or password")


def test_unknown_method_and_connect_name_mismatch(srv: Server) -> None:
    c = RawClient(srv.port, 5)
    ack = c.connect("scram-x", properties={"authentication_method": "SCRAM-SHA-1"})
    assert ack.reason_code == 0x8C  # Bad authentication method
    c.close()
    _, ack = scram_connect(srv.port, "scram-y", "carol", "carol-pw", username="admin")
    assert ack.reason_code == 0x86


def test_clients_without_a_method_keep_working(srv: Server) -> None:
    for version in (4, 5):
        c = RawClient(srv.port, version)
        assert c.connect(f"plain-{version}", username="carol",
                         password=b"carol-pw").reason_code == 0
        c.close()
    # ... and may not send AUTH: they chose no method (§4.12)
    c = RawClient(srv.port, 5)
    c.connect("plain-auth", username="carol", password=b"carol-pw")
    c.send(auth(0x19, b"n,,n=carol,r=abc"))
    reply = c.recv()
    assert isinstance(reply, mqtt.Disconnect) and reply.reason_code == 0x82
    c.close()


def test_reauthentication(srv: Server) -> None:
    c, ack = scram_connect(srv.port, "scram-re", "carol", "carol-pw")
    assert ack.reason_code == 0
    for _ in range(2):
        scram = ScramClient("carol", "carol-pw")
        c.send(auth(0x19, scram.first()))
        challenge = c.recv()
        assert isinstance(challenge, mqtt.Auth) and challenge.reason_code == 0x18
        c.send(auth(0x18, scram.final(challenge.properties["authentication_data"])))
        done = c.recv()
        assert isinstance(done, mqtt.Auth) and done.reason_code == 0, done
        scram.verify(done.properties["authentication_data"])
    c.send(mqtt.Pingreq())
    assert isinstance(c.recv(), mqtt.Pingresp)  # still connected
    # A failed re-authentication ends the connection: DISCONNECT Not authorized.
    scram = ScramClient("carol", "not-any-more")
    c.send(auth(0x19, scram.first()))
    challenge = c.recv()
    c.send(auth(0x18, scram.final(challenge.properties["authentication_data"])))
    reply = c.recv()
    assert isinstance(reply, mqtt.Disconnect) and reply.reason_code == 0x87, reply
    c.close()
    # ... as does one with another method than the CONNECT's.
    c, _ = scram_connect(srv.port, "scram-re2", "carol", "carol-pw")
    c.send(auth(0x19, b"x", method="SCRAM-SHA-1"))
    reply = c.recv()
    assert isinstance(reply, mqtt.Disconnect) and reply.reason_code == 0x82
    c.close()


def test_password_change_renews_the_verifier(srv: Server) -> None:
    add_user(srv, "dave", "old-pw")
    native(srv, "USER_UPDATE", {"name": "dave", "password": "new-pw"})
    _, ack = scram_connect(srv.port, "scram-dave", "dave", "old-pw")
    assert ack.reason_code == 0x86
    c, ack = scram_connect(srv.port, "scram-dave", "dave", "new-pw")
    assert ack.reason_code == 0
    c.close()


def test_user_without_a_verifier_fails_with_a_reason() -> None:
    """A user whose password was set before SCRAM support has no verifier: the exchange
    runs to the end (a client cannot tell) and fails, the audit reason says why."""
    verifiers = {"old": "", "new": make_verifier("pw")}
    for name, outcome in (("old", FAILURE), ("new", "success")):
        server = ScramSha256(verifiers.get, os.urandom(32))
        client = ScramClient(name, "pw")
        first = server.start(client.first())
        assert first.outcome == CONTINUE and first.data
        last = server.step(client.final(first.data))
        assert last.outcome == outcome, last
        if outcome == FAILURE:
            assert "no SCRAM verifier" in last.reason and "set it again" in last.reason
        else:
            client.verify(last.data or b"")


def test_packets_before_the_exchange_ends_are_bounded_like_the_connect(srv: Server) -> None:
    """Until a client is authenticated, every packet is bounded by --max-connect-packet
    (64 KiB), not --max-packet-size (1 MiB): an AUTH announcing 200 kB is refused as soon
    as its length is read, before the server holds any of it."""
    c = RawClient(srv.port, 5)
    try:
        scram = ScramClient("carol", "carol-pw")
        c.send(mqtt.Connect(client_id="scram-big", protocol_level=5, clean_start=True,
                            keepalive=60, properties={"authentication_method": METHOD,
                                                      "authentication_data": scram.first()}))
        challenge = c.recv()
        assert isinstance(challenge, mqtt.Auth) and challenge.reason_code == 0x18
        size = 200_000  # an AUTH's remaining length, as a variable byte integer
        length = bytes([size & 0x7F | 0x80, size >> 7 & 0x7F | 0x80, size >> 14])
        c.send_raw(b"\xf0" + length + b"\x18" + b"\x00" * 1000)  # and the rest never comes
        ack = c.recv()
        assert isinstance(ack, mqtt.Connack), ack
        assert ack.reason_code == 0x95  # Packet too large
        assert c.closed_by_server()
    finally:
        c.close()
    # Once authenticated, --max-packet-size holds.
    ok, ack = scram_connect(srv.port, "scram-big-ok", "carol", "carol-pw")
    assert ack.reason_code == 0
    ok.send(mqtt.Publish("scram/big", b"x" * 200_000, qos=1, packet_id=1))
    assert isinstance(ok.recv(), mqtt.Puback)
    ok.close()
