"""The two data planes over TLS: the same client session, from the handshake to the
close, sent to a `lightgate serve` on the native plane (the engine holds the TLS
session, relays it to Python's rules and carries it once promoted) and to one on the
Python plane (trio's SSLStream), gets the same bytes back once decrypted, byte for byte,
and the same close."""

from __future__ import annotations

import importlib.util
import ssl
import uuid
from collections.abc import Callable, Iterator

import pytest

from gateway import mqtt
from tests.conftest import Server
from tests.plane.test_handover import wait_native
from tests.plane.test_planes_wire import MALFORMED, answer
from tests.plane.test_tls_handover import TlsRaw
from tests.security.test_tls import Pki, make_pki, port_of, tls_args

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("serving.lightgate_native") is None,
    reason="the native data plane is not built")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def planes(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[dict[str, Server]]:
    """A server on each plane, both with the same certificate."""
    servers: dict[str, Server] = {}
    try:
        for name, env in (("native", "1"), ("python", "0")):
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("LIGHTGATE_NATIVE", env)
                servers[name] = Server(tmp_path_factory.mktemp(name) / "data",
                                       *tls_args(pki)).start()
        assert [s.addrs["plane"] for s in servers.values()] == ["native", "python"]
        yield servers
    finally:
        for srv in servers.values():
            if srv.proc is not None:
                assert srv.stop() == 0, srv.logs()[-3000:]


# A session: what to do once connected (anything it reads is its own), then writes,
# each with how many packets answer it (None: all until the close).
Scenario = Callable[[TlsRaw, str], list[tuple[bytes, int | None]]]


def session_on_both(planes: dict[str, Server], pki: Pki, version: int, scenario: Scenario,
                    subscriptions: int = 0) -> list[mqtt.Packet]:
    """`scenario` on a fresh TLS connection to each plane: every byte either server
    sends after the handshake, decrypted, must be the same (the CONNACK included), and
    so must the close. The packets."""
    got = {}
    cid = f"tw-{uuid.uuid4().hex[:8]}"  # the same on both: it may be in the answers
    for name, srv in planes.items():
        raw = TlsRaw(port_of(srv, "mqtt_tls"), pki.client_context(), version=version)
        raw.send(mqtt.Connect(client_id=cid, protocol_level=version))
        data, closed = answer(raw.sock, version, 1)
        for chunk, packets in scenario(raw, cid):
            if name == "native":
                wait_native(srv, cid, subscriptions)
            raw.send_raw(chunk)
            try:
                more, closed = answer(raw.sock, version, packets)
            except ssl.SSLError:  # a close without close_notify reads as one
                more, closed = b"", True
            data += more
        got[name] = (data, closed)
        raw.close()
    assert got["native"] == got["python"], \
        f"native {got['native'][0].hex()} closed={got['native'][1]}\n" \
        f"python {got['python'][0].hex()} closed={got['python'][1]}"
    return mqtt.Decoder(server=False, version=version).feed(got["native"][0])


@pytest.mark.parametrize("version", [4, 5])
def test_a_publishers_and_a_subscribers_sessions_over_tls_are_the_same_on_both_planes(
        planes: dict[str, Server], pki: Pki, version: int) -> None:
    """A subscriber, and a publisher that (carried, on the native plane) sends a QoS 1
    and a QoS 0 publish, a ping and a second QoS 1 in one write, then a malformed
    packet: each session's bytes are the same on both planes."""
    topic = f"tw/{uuid.uuid4().hex[:8]}"
    subs: dict[str, TlsRaw] = {}
    got = {}
    for name, srv in planes.items():
        sub = subs[name] = TlsRaw(port_of(srv, "mqtt_tls"), pki.client_context(),
                                  version=version)
        sub.send(mqtt.Connect(client_id=f"{topic}-sub", protocol_level=version))
        sub.send(mqtt.Subscribe(1, [(topic, mqtt.SubscriptionOptions(1))]))
        got[name] = answer(sub.sock, version, 2)[0]  # CONNACK, SUBACK

    def scenario(raw: TlsRaw, cid: str) -> list[tuple[bytes, int | None]]:
        packets = [mqtt.Publish(topic, b"one", 1, packet_id=7),
                   mqtt.Publish(topic, b"zero", 0), mqtt.Pingreq(),
                   mqtt.Publish(topic, b"two", 1, packet_id=8)]
        return [(b"".join(mqtt.encode(p, version) for p in packets), 3),
                (MALFORMED, None)]

    answers = session_on_both(planes, pki, version, scenario)
    assert [type(p).__name__ for p in answers][:4] == \
        ["Connack", "Puback", "Pingresp", "Puback"]
    for name, sub in subs.items():  # the subscriber's side, delivered in order
        delivered, _ = answer(sub.sock, version, 3)
        got[name] += delivered
        sub.close()
    assert got["native"] == got["python"], \
        f"native {got['native'].hex()}\npython {got['python'].hex()}"
    packets = mqtt.Decoder(server=False, version=version).feed(got["native"])
    assert [p.payload for p in packets if isinstance(p, mqtt.Publish)] == \
        [b"one", b"zero", b"two"]


def test_a_subscribe_and_unsubscribe_over_tls_are_answered_alike(
        planes: dict[str, Server], pki: Pki) -> None:
    """What needs Python's rules (the carried connection comes back for it on the native
    plane) after a publish the engine answers: the same bytes, then a clean DISCONNECT."""
    def scenario(raw: TlsRaw, cid: str) -> list[tuple[bytes, int | None]]:
        packets = [mqtt.Publish(f"t/{cid}", b"x", 1, packet_id=1),
                   mqtt.Subscribe(2, [(f"t/{cid}/#", mqtt.SubscriptionOptions(1))]),
                   mqtt.Unsubscribe(3, [f"t/{cid}/#"]),
                   mqtt.Disconnect()]
        return [(b"".join(mqtt.encode(p, 5) for p in packets), None)]

    got = session_on_both(planes, pki, 5, scenario)
    assert [type(p).__name__ for p in got] == ["Connack", "Puback", "Suback", "Unsuback"]


@pytest.mark.parametrize("version", [4, 5])
def test_a_publish_to_ones_own_subscription_over_tls_is_acked_then_delivered(
        planes: dict[str, Server], pki: Pki, version: int) -> None:
    """The order a client sees of its own stored publish, over TLS as over TCP: the
    PUBACK, then the delivery to its own subscription."""
    def scenario(raw: TlsRaw, cid: str) -> list[tuple[bytes, int | None]]:
        raw.send(mqtt.Subscribe(1, [(f"own/{cid}", mqtt.SubscriptionOptions(1))]))
        assert isinstance(raw.recv(), mqtt.Suback)
        publish = mqtt.Publish(f"own/{cid}", b"mine", 1, packet_id=7)
        return [(mqtt.encode(publish, version), 2)]

    got = session_on_both(planes, pki, version, scenario, subscriptions=1)
    assert [type(p).__name__ for p in got] == ["Connack", "Puback", "Publish"]
