"""MQTT 5.0 §3.15 and §4.12: enhanced authentication, with the method the Server offers
(SCRAM-SHA-256 against the built-in users), over a raw socket."""

from __future__ import annotations

from gateway import mqtt
from tests.conformance.conftest import PASSWORD, USER
from tests.conformance.wire import uid
from tests.conftest import Server
from tests.security.test_auth_scram import METHOD, ScramClient, auth, scram_connect

AUTH_CODES = {0x00, 0x18, 0x19}


def _reauthenticate(c: object, password: str) -> list[object]:
    """AUTH 0x19 and the exchange after it; what the Server sent back."""
    scram = ScramClient(USER, password)
    c.send(auth(0x19, scram.first()))
    got = [c.recv()]
    if isinstance(got[0], mqtt.Auth) and got[0].reason_code == 0x18:
        c.send(auth(0x18, scram.final(got[0].properties["authentication_data"])))
        got.append(c.recv())
    return got


def test_mqtt_3_15_2_1(auth_broker: Server) -> None:
    """[MQTT-3.15.2-1] Every AUTH the Server sends, at CONNECT and on re-authentication,
    carries an Authenticate Reason Code."""
    c, ack = scram_connect(auth_broker.port, uid(), USER, PASSWORD)
    assert ack.reason_code == 0
    got = _reauthenticate(c, PASSWORD)
    assert [type(p) for p in got] == [mqtt.Auth, mqtt.Auth]
    assert {p.reason_code for p in got} <= AUTH_CODES and got[-1].reason_code == 0x00
    c.close()


def test_mqtt_3_15_2_2(auth_broker: Server) -> None:
    """[MQTT-3.15.2-2] The Server's AUTH packets stay within the Client's Maximum Packet
    Size (200 bytes: the SCRAM messages fit, a Reason String would not be added)."""
    c, ack = _connect_small(auth_broker.port, 200)
    assert ack.reason_code == 0
    for p in _reauthenticate(c, PASSWORD):
        assert len(mqtt.encode(p, 5)) <= 200
    c.close()


def _connect_small(port: int, max_packet: int) -> tuple[object, mqtt.Connack]:
    """scram_connect with a Maximum Packet Size in the CONNECT; every packet is checked."""
    from tests.mqtt.raw import RawClient

    c = RawClient(port, 5)
    scram = ScramClient(USER, PASSWORD)
    c.send(mqtt.Connect(client_id=uid(), protocol_level=5, clean_start=True, keepalive=60,
                        properties={"authentication_method": METHOD,
                                    "authentication_data": scram.first(),
                                    "maximum_packet_size": max_packet}))
    challenge = c.recv()
    assert isinstance(challenge, mqtt.Auth) and len(mqtt.encode(challenge, 5)) <= max_packet
    c.send(auth(0x18, scram.final(challenge.properties["authentication_data"])))
    ack = c.recv()
    assert isinstance(ack, mqtt.Connack) and len(mqtt.encode(ack, 5)) <= max_packet
    return c, ack


def test_mqtt_4_12_0_2(auth_broker: Server) -> None:
    """[MQTT-4.12.0-2] The Server's AUTH during authentication carries 0x18."""
    from tests.mqtt.raw import RawClient

    c = RawClient(auth_broker.port, 5)
    c.send(mqtt.Connect(client_id=uid(), protocol_level=5, clean_start=True, keepalive=60,
                        properties={"authentication_method": METHOD,
                                    "authentication_data": ScramClient(USER, PASSWORD).first()}))
    challenge = c.recv()
    assert isinstance(challenge, mqtt.Auth) and challenge.reason_code == 0x18
    c.close()


def test_mqtt_4_12_0_4(auth_broker: Server) -> None:
    """[MQTT-4.12.0-4] Authentication rejected (a wrong password's proof): CONNACK 0x80
    or above, then the connection is closed."""
    c, ack = scram_connect(auth_broker.port, uid(), USER, "not-the-password")
    assert ack.reason_code >= 0x80
    assert c.closed_by_server()


def test_mqtt_4_12_0_5(auth_broker: Server) -> None:
    """[MQTT-4.12.0-5] Every AUTH and the successful CONNACK carry the CONNECT's method."""
    c, ack = scram_connect(auth_broker.port, uid(), USER, PASSWORD)  # checks the first two
    assert ack.properties["authentication_method"] == METHOD
    for p in _reauthenticate(c, PASSWORD):
        assert p.properties["authentication_method"] == METHOD
    c.close()


def test_mqtt_4_12_1_2(auth_broker: Server) -> None:
    """[MQTT-4.12.1-2] A failed re-authentication: the Server sends DISCONNECT (0x87) and
    closes."""
    c, ack = scram_connect(auth_broker.port, uid(), USER, PASSWORD)
    assert ack.reason_code == 0
    got = _reauthenticate(c, "not-the-password")
    assert isinstance(got[-1], mqtt.Disconnect) and got[-1].reason_code == 0x87
    assert c.closed_by_server()


def test_mqtt_3_1_2_30(auth_broker: Server) -> None:
    """[MQTT-3.1.2-30] A PUBLISH before the CONNACK of an authentication exchange is a
    Protocol Error: CONNACK 0x82, then the connection is closed."""
    from tests.mqtt.raw import RawClient

    c = RawClient(auth_broker.port, 5)
    c.send(mqtt.Connect(client_id=uid(), protocol_level=5, clean_start=True, keepalive=60,
                        properties={"authentication_method": METHOD,
                                    "authentication_data": ScramClient(USER, PASSWORD).first()}))
    assert isinstance(c.recv(), mqtt.Auth)
    c.send(mqtt.Publish("t/early", b"x", 0))
    reply = c.recv()
    assert isinstance(reply, mqtt.Connack) and reply.reason_code == 0x82
    assert c.closed_by_server()


def test_mqtt_4_12_1_1(auth_broker: Server) -> None:
    """[MQTT-4.12.1-1] Re-authentication with another method than the CONNECT's: the
    Server answers DISCONNECT 0x82 (Protocol Error)."""
    c, ack = scram_connect(auth_broker.port, uid(), USER, PASSWORD)
    assert ack.reason_code == 0
    c.send(auth(0x19, b"x", method="SCRAM-SHA-1"))
    reply = c.recv()
    assert isinstance(reply, mqtt.Disconnect) and reply.reason_code == 0x82
    assert c.closed_by_server()
