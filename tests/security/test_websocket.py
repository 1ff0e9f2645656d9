"""MQTT over WebSocket and secure WebSocket against a real `lightgate serve`: paho with
transport="websockets", a raw WebSocket client for the framing rules of MQTT section 6
(subprotocol `mqtt`, binary frames, packets split over or packed into messages), and
the message size bound."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from gateway import mqtt
from tests.conftest import Server
from tests.mqtt.paho_client import Client
from tests.security.test_tls import (
    CONNACK_OK,
    Pki,
    SecureClient,
    make_pki,
    port_of,
    round_trip,
    tls_args,
    uid,
)

PINGREQ = b"\xc0\x00"
PINGRESP = b"\xd0\x00"


@pytest.fixture
def ws_pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path / "pki")


@pytest.fixture
def ws_server(tmp_path: Path, ws_pki: Pki) -> Iterator[Server]:
    srv = Server(tmp_path / "data", *tls_args(ws_pki)).start()
    yield srv
    if srv.proc is not None:
        assert srv.stop() == 0, srv.logs()[-3000:]


def ws_connect(srv: Server, path: str = "/mqtt", **kw) -> ClientConnection:
    kw.setdefault("subprotocols", ["mqtt"])
    return connect(f"ws://{srv.addrs['ws']}{path}", proxy=None, open_timeout=5,
                   close_timeout=2, compression=None, **kw)


def receive_bytes(ws: ClientConnection, n: int) -> bytes:
    """At least n bytes from binary messages, however the server framed them."""
    data = b""
    while len(data) < n:
        message = ws.recv(timeout=5)
        assert isinstance(message, bytes), f"text frame from the server: {message!r}"
        data += message
    return data


def test_paho_over_websocket_round_trip(ws_server: Server) -> None:
    port = port_of(ws_server, "ws")
    sub = SecureClient(port, uid("wsub"), transport="websockets")
    pub = SecureClient(port, uid("wpub"), transport="websockets")
    topic = uid("ws") + "/t"
    round_trip(pub, sub, topic, b"over-ws")
    # Every QoS, and messages large enough to span many frames and TCP reads.
    for qos in (0, 1, 2):
        pub.publish(topic, bytes([qos]) * 200_000, qos)
    got = sub.expect(3)
    assert [len(m.payload) for m in got] == [200_000] * 3
    # WebSocket and TCP clients share the broker both ways.
    tcp = Client(ws_server.port, uid("tcp"))
    round_trip(tcp, sub, uid("ws") + "/x", b"tcp-to-ws")
    round_trip(pub, tcp, uid("ws") + "/y", b"ws-to-tcp")
    for c in (sub, pub, tcp):
        c.disconnect()


def test_paho_mqtt5_over_websocket_any_path(ws_server: Server) -> None:
    port = port_of(ws_server, "ws")
    sub = SecureClient(port, uid("w5s"), transport="websockets", path="/", version=5)
    pub = SecureClient(port, uid("w5p"), transport="websockets", path="/some/where",
                       version=5)
    round_trip(pub, sub, uid("ws5") + "/t", b"v5")
    sub.disconnect()
    pub.disconnect()


def test_paho_over_secure_websocket_round_trip(ws_server: Server, ws_pki: Pki) -> None:
    port = port_of(ws_server, "wss")
    sub = SecureClient(port, uid("ssub"), tls=ws_pki.client_context(), transport="websockets")
    pub = SecureClient(port, uid("spub"), tls=ws_pki.client_context(), transport="websockets")
    tls = SecureClient(port_of(ws_server, "mqtt_tls"), uid("tls"), tls=ws_pki.client_context())
    topic = uid("wss") + "/t"
    round_trip(pub, sub, topic, b"over-wss")
    pub.publish(topic, b"x" * 100_000, 1)
    assert sub.expect(1)[0].payload == b"x" * 100_000
    round_trip(tls, sub, uid("wss") + "/u", b"tls-to-wss")
    for c in (sub, pub, tls):
        c.disconnect()


@pytest.mark.parametrize("offered", [None, ["chat"], ["MQTT-ish", "v12.stomp"]])
def test_websocket_without_the_mqtt_subprotocol_is_rejected(
    ws_server: Server, offered: list[str] | None
) -> None:
    with pytest.raises(InvalidStatus) as info:
        ws_connect(ws_server, subprotocols=offered)
    assert info.value.response.status_code == 400
    assert ws_server.wait_log("not mqtt: rejected")
    # The listener is unharmed.
    with ws_connect(ws_server) as ws:
        assert ws.subprotocol == "mqtt"


def test_server_selects_mqtt_among_offered_subprotocols(ws_server: Server) -> None:
    with ws_connect(ws_server, subprotocols=["chat", "mqtt"]) as ws:
        assert ws.subprotocol == "mqtt"
    with ws_connect(ws_server, subprotocols=["mqttv3.1"]) as ws:  # MQTT 3.1 clients' name
        assert ws.subprotocol == "mqttv3.1"


def test_packets_split_over_and_packed_into_messages(ws_server: Server) -> None:
    connect_packet = mqtt.encode(mqtt.Connect(client_id=uid("raw"), keepalive=30), 4)
    with ws_connect(ws_server, path="/any/path?x=1") as ws:
        # MQTT 6.0: a packet need not be aligned with a message.
        ws.send(connect_packet[:5])
        ws.send(connect_packet[5:])
        assert receive_bytes(ws, 4) == CONNACK_OK
        ws.send(PINGREQ * 3)  # three packets in one message
        assert receive_bytes(ws, 6) == PINGRESP * 3
        ws.send(PINGREQ[:1])
        ws.send(PINGREQ[1:] + PINGREQ)
        assert receive_bytes(ws, 4) == PINGRESP * 2


def test_pings_and_fragmented_messages(ws_server: Server) -> None:
    connect_packet = mqtt.encode(mqtt.Connect(client_id=uid("frag"), keepalive=30), 4)
    with ws_connect(ws_server) as ws:
        assert ws.ping().wait(5)  # answered before CONNECT too
        ws.send([connect_packet[:3], connect_packet[3:7], connect_packet[7:]])  # 3 frames
        assert receive_bytes(ws, 4) == CONNACK_OK
        ws.send([PINGREQ[:1], PINGREQ[1:] + PINGREQ])
        assert ws.ping().wait(5)
        assert receive_bytes(ws, 4) == PINGRESP * 2


def test_text_frames_close_the_connection(ws_server: Server) -> None:
    with ws_connect(ws_server) as ws:
        ws.send(mqtt.encode(mqtt.Connect(client_id=uid("txt")), 4))
        assert receive_bytes(ws, 4) == CONNACK_OK
        ws.send("\xc0\x00")  # a PINGREQ, but as text: MQTT-6.0.0-1
        with pytest.raises(ConnectionClosed) as info:
            ws.recv(timeout=5)
        assert info.value.rcvd is not None and info.value.rcvd.code == 1003


def _close_code(ws: ClientConnection) -> int | None:
    """Read until the server closes; the code of its close frame."""
    with pytest.raises(ConnectionClosed) as info:
        while True:
            ws.recv(timeout=5)
    return info.value.rcvd.code if info.value.rcvd is not None else None


def test_messages_beyond_the_packet_size_limit_close_the_connection(tmp_path: Path) -> None:
    srv = Server(tmp_path / "data", "--max-packet-size", "1024").start()
    try:
        with ws_connect(srv, max_size=None) as ws:
            ws.send(mqtt.encode(mqtt.Connect(client_id=uid("big")), 4))
            assert receive_bytes(ws, 4) == CONNACK_OK
            # Well-formed packets, but far over 1 KiB + slack in one message.
            ws.send(PINGREQ * (100 * 1024))
            assert _close_code(ws) == 1009
        with ws_connect(srv, max_size=None) as ws:
            ws.send(mqtt.encode(mqtt.Connect(client_id=uid("junk")), 4))
            assert receive_bytes(ws, 4) == CONNACK_OK
            ws.send(b"\x00" * (200 * 1024))  # not MQTT: closed as it arrives
            _close_code(ws)
        with ws_connect(srv) as ws:  # others still welcome
            ws.send(mqtt.encode(mqtt.Connect(client_id=uid("small")), 4))
            assert receive_bytes(ws, 4) == CONNACK_OK
    finally:
        assert srv.stop() == 0, srv.logs()[-3000:]


def test_before_connect_a_message_is_bounded_by_the_connect_limit(tmp_path: Path) -> None:
    srv = Server(tmp_path / "data", "--max-connect-packet", "4096").start()
    try:
        connect_packet = mqtt.encode(mqtt.Connect(client_id=uid("early")), 4)
        with ws_connect(srv) as ws:
            # Packets need not align with messages, so a CONNECT and 3,000 PINGREQs may
            # share one; begun before CONNECT, it may be no larger than a CONNECT may.
            ws.send(connect_packet + PINGREQ * 3000)
            assert _close_code(ws) == 1009
        assert srv.wait_log("--max-connect-packet")
        with ws_connect(srv) as ws:  # after CONNECT, --max-packet-size bounds a message
            ws.send(connect_packet)
            assert receive_bytes(ws, 4) == CONNACK_OK
            ws.send(PINGREQ * 3000)
            assert receive_bytes(ws, 6000) == PINGRESP * 3000
    finally:
        assert srv.stop() == 0, srv.logs()[-3000:]


def test_garbage_and_silence_on_the_websocket_port_do_not_hurt(ws_server: Server) -> None:
    host, port = ws_server.addrs["ws"].rsplit(":", 1)
    silent = socket.create_connection((host, int(port)), timeout=5)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(mqtt.encode(mqtt.Connect(client_id=uid("plain")), 4))  # MQTT, not HTTP
        try:
            assert CONNACK_OK not in s.recv(1024)
        except (TimeoutError, ConnectionError):
            pass
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"GET /mqtt HTTP/1.1\r\nHost: x\r\n\r\n")  # HTTP, but no upgrade
        try:
            assert b"101" not in s.recv(1024)
        except (TimeoutError, ConnectionError):
            pass
    # Neither holds its task until the handshake timeout (10 s).
    assert ws_server.wait_log("failed: no upgrade request", count=2, timeout=5)
    sub = SecureClient(int(port), uid("ok"), transport="websockets")
    pub = Client(ws_server.port, uid("tcp"))
    round_trip(pub, sub, uid("g") + "/t", b"fine")
    sub.disconnect()
    pub.disconnect()
    silent.close()


def test_shutdown_with_websocket_clients_connected(tmp_path: Path, ws_pki: Pki) -> None:
    srv = Server(tmp_path / "data", *tls_args(ws_pki)).start()
    ws = SecureClient(port_of(srv, "ws"), uid("ws"), transport="websockets")
    wss = SecureClient(port_of(srv, "wss"), uid("wss"), tls=ws_pki.client_context(),
                       transport="websockets")
    half_open = socket.create_connection(("127.0.0.1", port_of(srv, "ws")), timeout=5)
    started = time.monotonic()
    assert srv.stop() == 0, srv.logs()[-3000:]
    # The close handshakes finish at once rather than each waiting out a timeout.
    assert time.monotonic() - started < 5
    assert ws.disconnected.wait(5) and wss.disconnected.wait(5)
    for c in (ws, wss):
        c.c.loop_stop()
    half_open.close()
