"""MQTT over WebSocket and secure WebSocket on the native plane, against a real
`lightgate serve` with LIGHTGATE_NATIVE=1 and real clients (paho's websocket transport,
and a raw RFC 6455 client that chooses every frame): the engine accepts the connection,
reads its upgrade and its frames; a quiet clean session is promoted and carried
natively (the native counters count its messages), comes back to Python for a
SUBSCRIBE and goes native again, and while carried its frames keep the rules of
`WebSocketStream`: pings answered, a text frame closed with 1003, a message past its
limit with 1009 and the warning, a keepalive that runs out and a lost socket (its
will)."""

from __future__ import annotations

import socket
import ssl
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway import mqtt
from serving import plane
from tests.conformance.ws import BINARY, PING, PONG, TEXT, WebSocket
from tests.conftest import Server
from tests.mqtt.raw import RawClient
from tests.plane.conftest import native_server
from tests.plane.test_handover import (
    native_counters,
    promotions,
    said_back,
    wait_native,
    wait_promoted,
)
from tests.security.test_tls import Pki, SecureClient, make_pki, port_of, tls_args

pytestmark = pytest.mark.skipif(plane.NATIVE is None or not hasattr(plane.NATIVE, "Engine"),
                                reason="the native data plane is not built")

TRANSPORTS = ["ws", "wss"]


class WsRaw(RawClient):
    """RawClient over a WebSocket (a binary frame per packet), secure when `tls`."""

    def __init__(self, port: int, tls: ssl.SSLContext | None = None, version: int = 4,
                 timeout: float = 5.0) -> None:
        self.ws = WebSocket(port, timeout=timeout, tls=tls)
        self.sock = self.ws  # type: ignore[assignment]  # sendall/recv/close, as a socket's
        self.version = version
        self.decoder = mqtt.Decoder(server=False, version=version)
        self.pending = []

    def closed_by_server(self) -> bool:
        try:
            return super().closed_by_server()
        except (ssl.SSLError, OSError):
            return True


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def srv(tmp_path: Path, pki: Pki, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    """One reactor thread: no connection moves between threads, so counts are exact."""
    s = native_server(tmp_path / "data", monkeypatch, "--io-threads", "1",
                      "--max-packet-size", "4096", *tls_args(pki))
    yield s
    if s.proc is not None:
        assert s.stop() == 0, s.logs()[-3000:]


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def raw(srv: Server, pki: Pki, transport: str, version: int = 4, timeout: float = 5.0
        ) -> WsRaw:
    tls = pki.client_context() if transport == "wss" else None
    return WsRaw(port_of(srv, transport), tls, version, timeout)


def paho(srv: Server, pki: Pki, transport: str, client_id: str) -> SecureClient:
    tls = pki.client_context() if transport == "wss" else None
    return SecureClient(port_of(srv, transport), client_id, tls=tls, transport="websockets")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_promoted_websocket_client_publishes_and_receives_natively(
        srv: Server, pki: Pki, transport: str) -> None:
    sub_id, pub_id = uid("wsub"), uid("wpub")
    sub = paho(srv, pki, transport, sub_id)
    sub.subscribe("ws/+/t", 1)
    pub = paho(srv, pki, transport, pub_id)
    pub.publish("ws/1/t", b"first", 1)
    assert [m.payload for m in sub.expect(1)] == [b"first"]
    wait_native(srv, sub_id, 1)
    wait_native(srv, pub_id)
    promoted = promotions(srv, pub_id) + promotions(srv, sub_id)
    before = native_counters(srv)
    for i in range(50):
        pub.publish("ws/1/t", b"q1-%d" % i, 1)
        pub.publish("ws/1/t", b"q0-%d" % i * 100, 0)  # several frames' worth at times
    got = sub.expect(100)
    assert [m.payload for m in got] == \
        [p for i in range(50) for p in (b"q1-%d" % i, b"q0-%d" % i * 100)]
    after = native_counters(srv)
    for way in ("in", "out"):  # every one went in and out on the native side
        name = f"lightgate_native_messages_{way}_total"
        assert after[name] - before[name] == 100, way
    assert promotions(srv, pub_id) + promotions(srv, sub_id) == promoted, "none came back"
    pub.disconnect()
    sub.disconnect()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_websocket_client_comes_back_for_a_subscribe_and_goes_native_again(
        srv: Server, pki: Pki, transport: str) -> None:
    c = raw(srv, pki, transport, version=5)
    cid = uid("wraw")
    c.connect(cid)
    wait_promoted(srv, cid)
    ack = c.subscribe(f"own/{cid}", 1)  # Python's SUBACK, over the same WebSocket
    assert ack.reason_codes == [1]
    assert said_back(srv, cid, "packet")
    wait_native(srv, cid, 1)
    before = native_counters(srv)
    c.send(mqtt.Publish(f"own/{cid}", b"mine", 1, packet_id=5))
    got = [c.recv(), c.recv()]
    assert isinstance(got[0], mqtt.Puback) and got[0].packet_id == 5
    assert isinstance(got[1], mqtt.Publish) and got[1].payload == b"mine"
    c.send(mqtt.Puback(got[1].packet_id))
    after = native_counters(srv)
    assert after["lightgate_native_messages_in_total"] \
        - before["lightgate_native_messages_in_total"] == 1
    c.send(mqtt.Disconnect())
    assert c.closed_by_server()
    assert c.ws.close_code == 1000  # the close handshake, from the server
    assert {op for _, op, _ in c.ws.frames} <= {BINARY, 0x8}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_carried_websocket_keeps_the_frame_rules(
        srv: Server, pki: Pki, transport: str) -> None:
    """Carried, a ping is answered; a text frame is closed with 1003; a message past
    --max-packet-size and 64 KiB with 1009 and the warning Python gives."""
    c = raw(srv, pki, transport)
    cid = uid("wping")
    c.connect(cid)
    wait_native(srv, cid)
    c.ws.send_frame(PING, b"are you there")
    c.send(mqtt.Pingreq())
    assert isinstance(c.recv(), mqtt.Pingresp)
    assert (True, PONG, b"are you there") in c.ws.frames
    c.ws.send_frame(TEXT, b"\xc0\x00".decode("latin-1").encode())
    assert c.closed_by_server()
    assert c.ws.close_code == 1003
    assert said_back(srv, cid, "lost")

    big = raw(srv, pki, transport)
    cid = uid("wbig")
    big.connect(cid)
    wait_native(srv, cid)
    before = native_counters(srv)
    big.ws.send_frame(BINARY, b"\xc0\x00" * (40 * 1024))  # 80 KiB of PINGREQs: past 68 KiB
    assert big.closed_by_server()
    assert big.ws.close_code == 1009
    assert srv.wait_log("a message of more than 69632 bytes (--max-packet-size)")
    assert said_back(srv, cid, "lost")
    after = native_counters(srv)
    assert after["lightgate_native_demoted_total"] > before["lightgate_native_demoted_total"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_carried_websocket_clients_end_publishes_its_will(
        srv: Server, pki: Pki, transport: str) -> None:
    """A keepalive that runs out (DISCONNECT 0x8D over the WebSocket), and a socket
    lost without a close frame: the will either way."""
    watcher = paho(srv, pki, transport, uid("wwatch"))
    watcher.subscribe("wills/#", 1)
    sleeper = raw(srv, pki, transport, version=5, timeout=10)
    sleeper.connect("wsleeper", keepalive=1,
                    will=mqtt.Will("wills/wsleeper", b"timed out", 1))
    wait_native(srv, "wsleeper")
    started = time.monotonic()
    bye = sleeper.recv()  # nothing sent: 1.5 keepalives later the engine hands it back
    assert isinstance(bye, mqtt.Disconnect) and bye.reason_code == 0x8D
    assert time.monotonic() - started < 5
    assert said_back(srv, "wsleeper", "timeout")
    doomed = raw(srv, pki, transport)
    doomed.connect("wdoomed", will=mqtt.Will("wills/wdoomed", b"gone", 1, False))
    wait_promoted(srv, "wdoomed")
    sock = doomed.ws.sock
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()  # a reset: no DISCONNECT, no close frame
    wills = watcher.expect(2)
    assert sorted((w.topic, w.payload) for w in wills) == \
        [("wills/wdoomed", b"gone"), ("wills/wsleeper", b"timed out")]
    assert said_back(srv, "wdoomed", "lost")
    watcher.disconnect()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_carried_websocket_subscriber_that_falls_behind_stays_native(
        srv: Server, pki: Pki, transport: str) -> None:
    """Past its budget a carried WebSocket subscriber is served from the store, as a
    plain-TCP one is: every message once, in order, and no demotion for its backlog."""
    sub_id = uid("wbehind")
    sub = raw(srv, pki, transport, timeout=20)
    sub.connect(sub_id)
    assert sub.subscribe("wsflood/t", 1).reason_codes == [1]
    wait_native(srv, sub_id, 1)
    said = len(srv.log)
    pub = RawClient(srv.port, timeout=20)
    pub.connect(uid("wflooder"))
    count, body = 4_000, b"." * 1_000  # 4 MB: past the 2 MiB budget, unread meanwhile
    pub.send_raw(b"".join(mqtt.encode(mqtt.Publish("wsflood/t", b"%05d" % i + body, qos=1,
                                                   packet_id=i + 1), 4)
                          for i in range(count)))
    assert all(isinstance(pub.recv(), mqtt.Puback) for _ in range(count))
    got = []
    while len(got) < count:
        p = sub.recv()
        assert isinstance(p, mqtt.Publish), p
        got.append(p.payload[:5])
        sub.send(mqtt.Puback(p.packet_id))
    assert got == [b"%05d" % i for i in range(count)]  # once each, in order
    assert not [line for line in srv.log[said:]
                if f"client {sub_id!r} (" in line and "back from the native plane" in line]
    counters = native_counters(srv)
    assert counters["lightgate_native_fell_behind_total"] >= 1, counters
    pub.close()
