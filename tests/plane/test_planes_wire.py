"""The two data planes on the wire: the same client bytes, sent to a `lightgate serve`
on the native plane (the connection promoted first) and to one on the Python plane
(LIGHTGATE_NATIVE=0), get the same bytes back, byte for byte, and the same close.

The core-level differential test (test_protocol_native.py) holds the two connection
cores to one behaviour packet by packet; what it cannot see is what lies around them:
the order in which the engine answers a publish and delivers it, what a connection
that ends still says about the publishes it had stored, and the state a demotion hands
back. These cases drive whole servers for that."""

from __future__ import annotations

import importlib.util
import socket
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from gateway import mqtt
from tests.conftest import Server
from tests.mqtt.raw import RawClient
from tests.plane.test_handover import wait_native

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("serving.lightgate_native") is None,
    reason="the native data plane is not built")

MALFORMED = b"\x30\x02\xff\xff"  # a PUBLISH whose topic runs past its packet
QUIET_S = 0.3  # after the answers expected, how long nothing more may come


@pytest.fixture(scope="module")
def planes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    """A server on each plane (whatever LIGHTGATE_NATIVE this run has)."""
    servers: dict[str, Server] = {}
    try:
        for name, env in (("native", "1"), ("python", "0")):
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("LIGHTGATE_NATIVE", env)
                servers[name] = Server(tmp_path_factory.mktemp(name) / "data").start()
        assert [s.addrs["plane"] for s in servers.values()] == ["native", "python"]
        yield servers
    finally:
        for srv in servers.values():
            if srv.proc is not None:
                assert srv.stop() == 0, srv.logs()[-3000:]


def answer(sock: socket.socket, version: int, packets: int | None) -> tuple[bytes, bool]:
    """What the server sends: until it closes the connection (`packets` None), or
    `packets` whole packets and nothing more for a moment. The bytes, and whether it
    closed."""
    decoder = mqtt.Decoder(server=False, version=version)
    data, count = b"", 0
    deadline = time.monotonic() + 10
    while True:
        done = packets is not None and count >= packets
        sock.settimeout(QUIET_S if done else max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            assert done, f"only {count} packets in time: {data.hex()}"
            return data, False
        except ConnectionResetError:
            return data, True
        if not chunk:
            return data, True
        data += chunk
        count += len(decoder.feed(chunk))


Scenario = Callable[[RawClient, str, mqtt.Connack], tuple[bytes, int | None]]


def on_both(planes: dict[str, Server], version: int, scenario: Scenario,
            subscriptions: int = 0) -> list[mqtt.Packet]:
    """Run `scenario` on a fresh connection to each plane: its set-up, then the bytes
    it gives are sent in one write (the native connection promoted first), and read
    are as many packets as it says answer them, or (None) all until the server closes.
    Both planes must answer alike, close alike; the packets."""
    got = {}
    cid = f"wire-{uuid.uuid4().hex[:8]}"  # the same on both: it may be in the answers
    for name, srv in planes.items():
        raw = RawClient(srv.port, version=version)
        connack = raw.connect(cid)
        data, packets = scenario(raw, cid, connack)
        if name == "native":
            wait_native(srv, cid, subscriptions)
        raw.send_raw(data)
        got[name] = answer(raw.sock, version, packets)
        raw.close()
    assert got["native"] == got["python"], \
        f"native {got['native'][0].hex()} closed={got['native'][1]}\n" \
        f"python {got['python'][0].hex()} closed={got['python'][1]}"
    packets = mqtt.Decoder(server=False, version=version).feed(got["native"][0])
    return packets


@pytest.mark.parametrize("version", [4, 5])
def test_a_publish_to_ones_own_subscription_is_acked_then_delivered(
        planes: dict[str, Server], version: int) -> None:
    def scenario(raw: RawClient, cid: str, _: mqtt.Connack) -> tuple[bytes, int]:
        raw.subscribe(f"own/{cid}", 1)
        return mqtt.encode(mqtt.Publish(f"own/{cid}", b"mine", 1, packet_id=7), version), 2

    ack, delivery = on_both(planes, version, scenario, subscriptions=1)
    assert isinstance(ack, mqtt.Puback) and ack.packet_id == 7
    assert isinstance(delivery, mqtt.Publish) and delivery.payload == b"mine"


@pytest.mark.parametrize("version", [4, 5])
def test_a_publish_stored_before_a_malformed_packet_is_acked_before_the_close(
        planes: dict[str, Server], version: int) -> None:
    def scenario(raw: RawClient, cid: str, _: mqtt.Connack) -> tuple[bytes, None]:
        publish = mqtt.Publish(f"bad/{cid}", b"kept", 1, packet_id=3)
        return mqtt.encode(publish, version) + MALFORMED, None

    got = on_both(planes, version, scenario)
    assert isinstance(got[0], mqtt.Puback) and (got[0].packet_id, got[0].reason_code) == (3, 0)
    if version == 5:
        assert isinstance(got[1], mqtt.Disconnect) and got[1].reason_code == 0x81
    assert len(got) == version - 3  # 3.1.1 has no DISCONNECT from the server


def test_one_publish_past_our_receive_maximum_in_one_write_is_0x93(
        planes: dict[str, Server]) -> None:
    """MQTT 5 §3.3.4: a QoS 1 PUBLISH more than our Receive Maximum, all in one write
    (the client waited for no PUBACK): each one stored is acknowledged, then DISCONNECT
    0x93. The native side hands the connection back at the one too many: the count of
    those it had not answered when it read it goes back with it."""
    rmax = 0

    def scenario(raw: RawClient, cid: str, connack: mqtt.Connack) -> tuple[bytes, None]:
        nonlocal rmax
        rmax = connack.properties["receive_maximum"]
        return b"".join(mqtt.encode(mqtt.Publish(f"rm/{cid}", b"x", 1, packet_id=i), 5)
                        for i in range(1, rmax + 2)), None

    got = on_both(planes, 5, scenario)
    assert [(type(p), p.packet_id, p.reason_code) for p in got[:-1]] == \
        [(mqtt.Puback, i, 0) for i in range(1, rmax + 1)]
    assert isinstance(got[-1], mqtt.Disconnect) and got[-1].reason_code == 0x93
