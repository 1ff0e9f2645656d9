"""MQTT 5.0 and 3.1.1 chapter 6: MQTT over WebSocket, against the broker's `--ws`
listener, through the tests' own RFC 6455 client (ws.py): one test per normative
statement, each in 5.0 and, where the Server has a duty, in 3.1.1."""

from __future__ import annotations

import pytest

from gateway import mqtt
from tests.conformance.reader import Connack, Publish
from tests.conformance.wire import Peer, connect_bytes, uid
from tests.conformance.ws import BINARY, CONTINUATION, TEXT, HandshakeRefused, WebSocket


def over_ws(ws_port: int, version: int = 5, **kw: object) -> Peer:
    return Peer(sock=WebSocket(ws_port, **kw), version=version)


def binary_frames_only(ws_port: int, version: int) -> None:
    """A session with CONNACK, SUBACK, PUBLISH, PUBACK and PINGRESP from the Server: all
    in binary frames. Then a text frame from the Client: the connection is closed."""
    c = over_ws(ws_port, version)
    topic = uid("ws/")
    c.connect(uid())
    c.subscribe(topic, 1)
    c.publish(topic, b"x", 1)
    c.messages(1)
    c.ping()
    kinds = [type(p).__name__ for p in c.log]
    assert sorted(kinds) == ["Connack", "Pingresp", "Puback", "Publish", "Suback"], kinds
    assert {(fin, opcode) for fin, opcode, _ in c.sock.frames} == {(True, BINARY)}
    for first in (True, False):  # as the first frame, and inside a session
        t = over_ws(ws_port, version)
        if not first:
            t.connect(uid())
        t.sock.send_frame(TEXT, connect_bytes(uid(), level=version) if first else b"\xc0\x00")
        assert t.closed(), t.pending
        assert t.sock.tcp_closed()
        assert [type(p) for p in t.log] == ([] if first else [Connack])  # text read as nothing


def frames_need_not_align(ws_port: int, version: int) -> None:
    """A CONNECT in two binary messages; SUBSCRIBE, PUBLISH and PINGREQ in one frame; a
    PUBLISH and a PINGREQ spread over the three frames of one fragmented message, cut
    inside both packets. The Server reads them all."""
    c = over_ws(ws_port, version)
    ws, topic = c.sock, uid("ws/")
    connect = connect_bytes(uid(), level=version)
    ws.send_frame(BINARY, connect[:3])
    ws.send_frame(BINARY, connect[3:])
    assert c.expect(Connack).reason_code == 0
    enc = [mqtt.encode(p, version) for p in (
        mqtt.Subscribe(1, [(topic, mqtt.SubscriptionOptions(1))]),
        mqtt.Publish(topic, b"one", 1, packet_id=2), mqtt.Pingreq())]
    ws.send_frame(BINARY, b"".join(enc))
    got = [c.recv() for _ in range(4)]  # the delivery of "one" comes in among them
    assert sorted(type(p).__name__ for p in got) == ["Pingresp", "Puback", "Publish", "Suback"]
    assert [p.payload for p in got if isinstance(p, Publish)] == [b"one"]
    data = mqtt.encode(mqtt.Publish(topic, b"two" * 50, 1, packet_id=3), version) + b"\xc0\x00"
    ws.send_frame(BINARY, data[:4], fin=False)
    ws.send_frame(CONTINUATION, data[4:-1], fin=False)
    ws.send_frame(CONTINUATION, data[-1:], fin=True)
    got = [c.recv() for _ in range(3)]
    assert sorted(type(p).__name__ for p in got) == ["Pingresp", "Puback", "Publish"]
    assert [p.payload for p in got if isinstance(p, Publish)] == [b"two" * 50]


def test_mqtt_6_0_0_1(ws_port: int) -> None:
    """[MQTT-6.0.0-1] MQTT travels in binary frames: the Server sends nothing else, and
    closes the connection on a text frame."""
    binary_frames_only(ws_port, 5)


def test_mqtt311_6_0_0_1(ws_port: int) -> None:
    """[MQTT-6.0.0-1] (3.1.1) The same with a 3.1.1 session."""
    binary_frames_only(ws_port, 4)


def test_mqtt_6_0_0_2(ws_port: int) -> None:
    """[MQTT-6.0.0-2] The Server does not take packets to be aligned on frames: a frame
    may hold several packets or part of one."""
    frames_need_not_align(ws_port, 5)


def test_mqtt311_6_0_0_2(ws_port: int) -> None:
    """[MQTT-6.0.0-2] (3.1.1) The same with a 3.1.1 session."""
    frames_need_not_align(ws_port, 4)


OFFERS = [("mqtt",), ("chat", "mqtt"), ("mqttv3.1", "mqtt"), ("mqtt", "mqttv3.1")]


@pytest.mark.parametrize("offered", OFFERS, ids=", ".join)
def test_mqtt_6_0_0_4(ws_port: int, offered: tuple[str, ...]) -> None:
    """[MQTT-6.0.0-4] The subprotocol the Server selects and returns is "mqtt", wherever
    the Client lists it among others; MQTT 5.0 then runs over it."""
    c = over_ws(ws_port, subprotocols=offered)
    assert c.sock.subprotocol == "mqtt"
    assert c.connect(uid()).reason_code == 0


def test_mqtt311_6_0_0_4(ws_port: int) -> None:
    """[MQTT-6.0.0-4] (3.1.1) The same for a 3.1.1 Client."""
    c = over_ws(ws_port, 4, subprotocols=("chat", "mqtt"))
    assert c.sock.subprotocol == "mqtt"
    assert c.connect(uid()).reason_code == 0


@pytest.mark.parametrize("offered", [(), ("chat",)], ids=["none", "chat"])
def test_an_upgrade_without_mqtt_is_refused(ws_port: int, offered: tuple[str, ...]) -> None:
    """(MQTT-6.0.0-3 binds the Client: it offers "mqtt". Of a Client that does not, the
    specification asks nothing; this Server refuses the upgrade with 400.)"""
    with pytest.raises(HandshakeRefused) as refused:
        WebSocket(ws_port, subprotocols=offered)
    assert refused.value.status == 400
