"""The two data planes over WebSocket and secure WebSocket: the same client session,
frame by frame, sent to a `lightgate serve` on the native plane (the engine reads the
upgrade and the frames, relays them to Python's rules and carries the connection once
promoted) and to one on the Python plane (wsproto's `WebSocketStream`), gets the same
MQTT bytes back, the same control frames (pongs, the close frame with its code and
reason) and the same end; the same upgrade requests, good and bad, get the same HTTP
answer byte for byte; and paho's websocket transport works against both listeners of
both planes."""

from __future__ import annotations

import base64
import importlib.util
import os
import socket
import ssl
import struct
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from gateway import mqtt
from tests.conformance.ws import BINARY, CLOSE, CONTINUATION, PING, PONG, TEXT, WebSocket
from tests.conftest import Server
from tests.plane.test_handover import wait_native
from tests.security.test_tls import Pki, SecureClient, make_pki, port_of, round_trip, tls_args

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("serving.lightgate_native") is None,
    reason="the native data plane is not built")

QUIET_S = 0.1  # nothing more comes within this: the answer is whole (what comes later
# is read with the next step: all of it is compared)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def planes(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[dict[str, Server]]:
    """A server on each plane, with the same certificate and limits."""
    servers: dict[str, Server] = {}
    try:
        for name, env in (("native", "1"), ("python", "0")):
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("LIGHTGATE_NATIVE", env)
                servers[name] = Server(tmp_path_factory.mktemp(name) / "data",
                                       "--max-connect-packet", "4096",
                                       "--max-packet-size", "4096", *tls_args(pki)).start()
        assert [s.addrs["plane"] for s in servers.values()] == ["native", "python"]
        yield servers
    finally:
        for srv in servers.values():
            if srv.proc is not None:
                assert srv.stop() == 0, srv.logs()[-3000:]


def frame(opcode: int, payload: bytes, fin: bool = True, masked: bool = True,
          first: int | None = None) -> bytes:
    """A client's frame (`first`: the first byte as given, reserved bits and all)."""
    head = bytes([first if first is not None else (0x80 if fin else 0) | opcode])
    n = len(payload)
    bit = 0x80 if masked else 0
    if n < 126:
        head += bytes([bit | n])
    elif n < 1 << 16:
        head += bytes([bit | 126]) + struct.pack("!H", n)
    else:
        head += bytes([bit | 127]) + struct.pack("!Q", n)
    if not masked:
        return head + payload
    mask = os.urandom(4)
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def binary(*packets: mqtt.Packet, version: int = 4) -> bytes:
    return frame(BINARY, b"".join(mqtt.encode(p, version) for p in packets))


@dataclass
class Seen:
    """What a server sent: its MQTT bytes (the payloads of its binary frames, however
    framed), its control frames in order, and whether the connection ended."""

    mqtt: bytes = b""
    controls: list[tuple[int, bytes]] = field(default_factory=list)
    ended: bool = False


def read_until(ws: WebSocket, seen: Seen, version: int, packets: int | None,
               controls: int = 0) -> None:
    """Frames until `packets` more MQTT packets and `controls` more control frames came
    and nothing more for a moment; or until the end (`packets` None)."""
    decoder = mqtt.Decoder(server=False, version=version)
    decoder.feed(seen.mqtt)
    want_packets = len(mqtt.Decoder(server=False, version=version).feed(seen.mqtt)) \
        + (packets or 0)
    want_controls = len(seen.controls) + controls
    count = want_packets - (packets or 0)
    deadline = time.monotonic() + 10
    while not seen.ended:
        done = packets is not None and count >= want_packets \
            and len(seen.controls) >= want_controls
        ws.settimeout(QUIET_S if done else max(0.01, deadline - time.monotonic()))
        try:
            _fin, opcode, payload = ws.read_frame()
        except TimeoutError:
            assert done, f"only {count} packets, {seen.controls} in time: {seen.mqtt.hex()}"
            return
        except (ConnectionError, ssl.SSLError, OSError):
            seen.ended = True
            return
        if opcode in (BINARY, CONTINUATION):
            seen.mqtt += payload
            count += len(decoder.feed(payload))
        else:
            seen.controls.append((opcode, payload))
        if opcode == CLOSE:  # answered, as a client does: the server need not wait
            try:
                ws.sock.sendall(frame(CLOSE, payload[:2]))
            except OSError:
                pass


# A session: once its CONNECT is answered, writes (raw frames), each with how many MQTT
# packets and control frames answer it (packets None: everything until the end).
Step = tuple[bytes, int | None, int]


def session_on_both(planes: dict[str, Server], pki: Pki, transport: str, version: int,
                    steps: list[Step], connect: bool = True) -> Seen:
    """`steps` over a fresh WebSocket to each plane (after a CONNECT, in two frames,
    answered): the same MQTT bytes, control frames and end on both."""
    got = {}
    cid = f"ww-{uuid.uuid4().hex[:8]}"  # the same on both: it may be in the answers
    for name, srv in planes.items():
        tls = pki.client_context() if transport == "wss" else None
        ws = WebSocket(port_of(srv, transport), tls=tls, timeout=5)
        seen = Seen()
        if connect:
            packet = mqtt.encode(mqtt.Connect(client_id=cid, protocol_level=version), version)
            ws.sock.sendall(frame(BINARY, packet[:5]) + frame(BINARY, packet[5:]))
            read_until(ws, seen, version, 1)
        for data, packets, controls in steps:
            if name == "native" and connect and not seen.ended:
                wait_native(srv, cid)  # carried by the engine from here
            try:
                ws.sock.sendall(data)
            except OSError:
                pass
            read_until(ws, seen, version, packets, controls)
        got[name] = seen
        ws.close()
    assert got["native"] == got["python"], f"native {got['native']}\npython {got['python']}"
    return got["native"]


def close_of(seen: Seen) -> tuple[int | None, bytes]:
    [(code, reason)] = [(struct.unpack("!H", p[:2])[0] if p else None, p[2:])
                        for op, p in seen.controls if op == CLOSE]
    return code, reason


@pytest.mark.parametrize("transport", ["ws", "wss"])
@pytest.mark.parametrize("version", [4, 5])
def test_a_session_over_websocket_is_the_same_on_both_planes(
        planes: dict[str, Server], pki: Pki, transport: str, version: int) -> None:
    """Packets packed into a message, split over messages and over the frames of a
    fragmented one, a ping, a publish of several frames' worth, then DISCONNECT: the
    same bytes, the pong, and the server's close 1000 on both planes."""
    topic = f"ww/{uuid.uuid4().hex[:8]}"
    pub = mqtt.encode(mqtt.Publish(topic, b"x" * 3000, 1, packet_id=3), version)
    ping = mqtt.encode(mqtt.Pingreq(), version)
    steps: list[Step] = [
        (binary(mqtt.Pingreq(), mqtt.Pingreq(), mqtt.Pingreq(), version=version), 3, 0),
        (frame(BINARY, pub[:7], fin=False) + frame(CONTINUATION, pub[7:2000], fin=False)
         + frame(PING, b"hello") + frame(CONTINUATION, pub[2000:] + ping[:1])
         + frame(BINARY, ping[1:]), 2, 1),
        (binary(mqtt.Publish(topic, b"zero", 0), mqtt.Disconnect(), version=version),
         None, 0),
    ]
    seen = session_on_both(planes, pki, transport, version, steps)
    kinds = [type(p).__name__ for p in mqtt.Decoder(server=False, version=version)
             .feed(seen.mqtt)]
    assert kinds == ["Connack", "Pingresp", "Pingresp", "Pingresp", "Puback", "Pingresp"]
    assert seen.controls[0] == (PONG, b"hello")
    assert close_of(seen)[0] == 1000 and seen.ended


# (Each rule wsproto's parser stops at costs a second on either plane: the parser is
# done, so the client's close frame is never seen and the close waits it out. The rest of
# those rules are held to wsproto's codes in native/src/ws.rs's tests.)
ENDINGS = {
    "text": (frame(TEXT, b"\xc0\x00".decode("latin-1").encode()), 1003),
    "text-not-utf8": (frame(TEXT, b"\xff"), 1007),
    "unmasked": (frame(BINARY, b"\xc0\x00", masked=False), 1002),
    "reserved-opcode": (frame(3, b"x"), 1002),
    "close-reserved-code": (frame(CLOSE, b"\x03\xec"), 1002),
    "close-normal": (frame(CLOSE, b"\x03\xe8bye"), 1000),
    "close-going-away": (frame(CLOSE, b"\x03\xe9"), 1001),
    "close-no-code": (frame(CLOSE, b""), None),
    "close-app-code": (frame(CLOSE, b"\x0f\xa0app"), 4000),
    # QoS 0 publishes nobody reads (nothing answers them), 80 KiB in one message: past
    # --max-packet-size and 64 KiB.
    "too-big": (binary(*[mqtt.Publish("ww/nobody", b"n" * 1000, 0)] * 80), 1009),
}
# Over TLS, the frames are the same code: a few of them.
ENDINGS_WSS = ["text", "unmasked", "close-normal", "too-big"]


@pytest.mark.parametrize(("transport", "name"), [("ws", n) for n in ENDINGS]
                         + [("wss", n) for n in ENDINGS_WSS])
def test_frames_that_end_a_session_end_it_alike(
        planes: dict[str, Server], pki: Pki, transport: str, name: str) -> None:
    """Each after a ping answered (the connection carried on the native plane): the
    same close frame (code and reason, or the client's echoed) and end on both."""
    data, code = ENDINGS[name]
    steps: list[Step] = [(binary(mqtt.Pingreq()), 1, 0), (data, None, 0)]
    seen = session_on_both(planes, pki, transport, 4, steps)
    assert close_of(seen)[0] == code, name
    assert seen.ended


def test_before_connect_a_message_past_the_connect_limit_closes_alike(
        planes: dict[str, Server], pki: Pki) -> None:
    """A CONNECT and PINGREQs in one message past --max-connect-packet: no CONNACK,
    1009 on both planes; a ping before the CONNECT is answered on both."""
    packet = mqtt.encode(mqtt.Connect(client_id="early"), 4)
    steps: list[Step] = [(frame(PING, b"early"), 0, 1),
                         (frame(BINARY, packet + b"\xc0\x00" * 3000), None, 0)]
    seen = session_on_both(planes, pki, "ws", 4, steps, connect=False)
    assert seen.mqtt == b""
    assert seen.controls[0] == (PONG, b"early")
    assert close_of(seen) == (1009, b"message over 4096 bytes")


KEY = base64.b64encode(b"0123456789abcdef").decode()
GOOD = ("GET /mqtt HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {KEY}\r\nSec-WebSocket-Version: 13\r\n"
        "Sec-WebSocket-Protocol: {protocols}\r\n\r\n")
HEADS = {
    "mqtt": GOOD.format(protocols="mqtt"),
    "chat-and-mqtt": GOOD.format(protocols="chat, mqtt"),
    "mqttv3.1": GOOD.format(protocols="mqttv3.1"),
    "http-1.0": GOOD.format(protocols="mqtt").replace("HTTP/1.1", "HTTP/1.0"),
    "no-mqtt": GOOD.format(protocols="chat"),
    "no-mqtt-http-1.0": GOOD.format(protocols="chat").replace("HTTP/1.1", "HTTP/1.0"),
    "no-subprotocols": GOOD.replace("Sec-WebSocket-Protocol: {protocols}\r\n", ""),
    "post": GOOD.format(protocols="mqtt").replace("GET", "POST"),
    "no-connection": GOOD.format(protocols="mqtt").replace("Connection: Upgrade\r\n", ""),
    "version-12": GOOD.format(protocols="mqtt").replace("Version: 13", "Version: 12"),
    "no-version": GOOD.format(protocols="mqtt").replace("Sec-WebSocket-Version: 13\r\n", ""),
    "no-key": GOOD.format(protocols="mqtt").replace(f"Sec-WebSocket-Key: {KEY}\r\n", ""),
    "upgrade-h2c": GOOD.format(protocols="mqtt").replace("websocket", "h2c"),
    "no-host": GOOD.format(protocols="mqtt").replace("Host: x\r\n", ""),
    "no-host-http-1.0": GOOD.format(protocols="mqtt").replace("Host: x\r\n", "")
    .replace("HTTP/1.1", "HTTP/1.0"),
    "two-hosts": GOOD.format(protocols="mqtt").replace("Host: x\r\n", "Host: x\r\nHost: y\r\n"),
    "plain-get": "GET /mqtt HTTP/1.1\r\nHost: x\r\n\r\n",
    "mqtt-bytes": "\x10\x0c\x00\x04MQTT\x04\x02\x00\x3c\x00\x00",
    "blank-line-first": "\r\n" + GOOD.format(protocols="mqtt"),
    "too-long": "GET /mqtt HTTP/1.1\r\nX: " + "a" * 17_000,
}


def http_answer(sock: socket.socket, upgraded: bool) -> bytes:
    """The server's answer: its head once upgraded (the connection stays), or all it
    sends until it closes."""
    data = b""
    sock.settimeout(5)
    while not (upgraded and b"\r\n\r\n" in data):
        try:
            chunk = sock.recv(65536)
        except (ConnectionError, ssl.SSLError, OSError):
            break
        if not chunk:
            break
        data += chunk
    return data


ACCEPTED = {"mqtt", "chat-and-mqtt", "mqttv3.1", "http-1.0"}


@pytest.mark.parametrize("head", list(HEADS))
def test_an_upgrade_is_answered_alike(planes: dict[str, Server], head: str) -> None:
    """Each request gets the same answer from both planes (wsproto's, on the Python
    plane), byte for byte: a 101 with the subprotocol chosen, or a refusal, after
    which the connection is closed."""
    got = {}
    for name, srv in planes.items():
        with socket.create_connection(("127.0.0.1", port_of(srv, "ws")), timeout=5) as s:
            s.sendall(HEADS[head].encode("latin-1"))
            got[name] = http_answer(s, upgraded=head in ACCEPTED)
    assert got["native"] == got["python"], f"native {got['native']!r}\npython {got['python']!r}"
    assert got["native"].startswith(b"HTTP/1.1 101 " if head in ACCEPTED else b"HTTP/1.1 4")


@pytest.mark.parametrize("transport", ["ws", "wss"])
def test_paho_over_websocket_on_both_planes(planes: dict[str, Server], pki: Pki,
                                            transport: str) -> None:
    """paho-mqtt's websocket transport: a round trip at every QoS through each plane's
    listener, and a message of many frames."""
    for srv in planes.values():
        port = port_of(srv, transport)
        tls = pki.client_context() if transport == "wss" else None
        tag = uuid.uuid4().hex[:8]
        sub = SecureClient(port, f"ps-{tag}", tls=tls, transport="websockets")
        pub = SecureClient(port, f"pp-{tag}", tls=tls, transport="websockets", version=5)
        topic = f"pw/{tag}"
        round_trip(pub, sub, topic, b"hello")
        for qos in (0, 1, 2):
            pub.publish(topic, bytes([qos]) * 3000, qos)
        assert [m.payload for m in sub.expect(3)] == [bytes([q]) * 3000 for q in (0, 1, 2)]
        sub.disconnect()
        pub.disconnect()
