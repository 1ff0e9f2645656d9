"""MQTT 5.0 §3.15 and §4.12: enhanced authentication, with the method the Server offers
(SCRAM-SHA-256 against the built-in users), over a raw socket."""

from __future__ import annotations

from typing import Any

from gateway import mqtt
from tests.conformance.conftest import PASSWORD, USER
from tests.conformance.reader import Auth, Connack, Disconnect
from tests.conformance.wire import Peer, uid
from tests.conftest import Server
from tests.security.test_auth_scram import METHOD, ScramClient, auth


def scram_connect(port: int, password: str = PASSWORD,
                  **properties: Any) -> tuple[Peer, list[Any]]:
    """CONNECT with SCRAM, answer the challenge: the client and what the Server sent
    (AUTH 0x18, then the CONNACK), the Server's proof checked when it accepted."""
    c = Peer(port)
    scram = ScramClient(USER, password)
    c.send(mqtt.Connect(client_id=uid(), protocol_level=5, clean_start=True, keepalive=60,
                        properties={"authentication_method": METHOD,
                                    "authentication_data": scram.first(), **properties}))
    challenge = c.recv()
    assert isinstance(challenge, Auth) and challenge.reason_code == 0x18, challenge
    c.send(auth(0x18, scram.final(challenge.properties["authentication_data"])))
    ack = c.recv()
    assert isinstance(ack, Connack), ack
    if ack.reason_code == 0:
        scram.verify(ack.properties["authentication_data"])
    return c, [challenge, ack]


def _reauthenticate(c: Peer, password: str) -> list[Any]:
    """AUTH 0x19 and the exchange after it; what the Server sent back."""
    scram = ScramClient(USER, password)
    c.send(auth(0x19, scram.first()))
    got = [c.recv()]
    if isinstance(got[0], Auth) and got[0].reason_code == 0x18:
        c.send(auth(0x18, scram.final(got[0].properties["authentication_data"])))
        got.append(c.recv())
    return got


def test_mqtt_3_15_2_1(auth_broker: Server) -> None:
    """[MQTT-3.15.2-1] Every AUTH the Server sends, at CONNECT and on re-authentication,
    carries an Authenticate Reason Code: 0x18 while it goes on, 0x00 at the end."""
    c, (challenge, ack) = scram_connect(auth_broker.port)
    assert ack.reason_code == 0
    got = [challenge, *_reauthenticate(c, PASSWORD)]
    assert [(type(p), p.reason_code) for p in got] == [(Auth, 0x18), (Auth, 0x18), (Auth, 0)]
    c.close()


def test_mqtt_4_12_0_2(auth_broker: Server) -> None:
    """[MQTT-4.12.0-2] The Server's AUTH during authentication carries 0x18."""
    c = Peer(auth_broker.port)
    c.send(mqtt.Connect(client_id=uid(), protocol_level=5, clean_start=True, keepalive=60,
                        properties={"authentication_method": METHOD,
                                    "authentication_data": ScramClient(USER, PASSWORD).first()}))
    challenge = c.recv()
    assert isinstance(challenge, Auth) and challenge.reason_code == 0x18
    c.close()


def test_mqtt_4_12_0_4(auth_broker: Server) -> None:
    """[MQTT-4.12.0-4] Authentication rejected (a wrong password's proof): CONNACK 0x80
    or above, then the connection is closed."""
    c, (_, ack) = scram_connect(auth_broker.port, "not-the-password")
    assert ack.reason_code >= 0x80
    assert c.closed()


def test_mqtt_4_12_0_5(auth_broker: Server) -> None:
    """[MQTT-4.12.0-5] Every AUTH and the successful CONNACK carry the CONNECT's method."""
    c, got = scram_connect(auth_broker.port)
    assert got[1].reason_code == 0
    got += _reauthenticate(c, PASSWORD)
    assert [p.properties.get("authentication_method") for p in got] == [METHOD] * 4
    c.close()


def test_mqtt_4_12_1_2(auth_broker: Server) -> None:
    """[MQTT-4.12.1-2] A failed re-authentication: the Server sends DISCONNECT (0x87) and
    closes."""
    c, (_, ack) = scram_connect(auth_broker.port)
    assert ack.reason_code == 0
    got = _reauthenticate(c, "not-the-password")
    assert isinstance(got[-1], Disconnect) and got[-1].reason_code == 0x87
    assert c.closed()


def test_mqtt_3_1_2_30(auth_broker: Server) -> None:
    """[MQTT-3.1.2-30] A PUBLISH before the CONNACK of an authentication exchange is a
    Protocol Error: CONNACK 0x82, then the connection is closed."""
    c = Peer(auth_broker.port)
    c.send(mqtt.Connect(client_id=uid(), protocol_level=5, clean_start=True, keepalive=60,
                        properties={"authentication_method": METHOD,
                                    "authentication_data": ScramClient(USER, PASSWORD).first()}))
    assert isinstance(c.recv(), Auth)
    c.send(mqtt.Publish("t/early", b"x", 0))
    c.refused_with(0x82)


def test_mqtt_4_12_1_1(auth_broker: Server) -> None:
    """[MQTT-4.12.1-1] Re-authentication with another method than the CONNECT's: the
    Server answers DISCONNECT 0x82 (Protocol Error)."""
    c, (_, ack) = scram_connect(auth_broker.port)
    assert ack.reason_code == 0
    c.send(auth(0x19, b"x", method="SCRAM-SHA-1"))
    c.refused_with(0x82)
