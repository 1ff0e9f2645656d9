"""TLS connections on the native plane, against a real `lightgate serve` with
LIGHTGATE_NATIVE=1 and real TLS clients (paho, raw sockets through Python's ssl): the
engine accepts them and holds their TLS session; a quiet clean session is promoted and
carried natively (the native counters count its messages), comes back to Python for a
SUBSCRIBE, a takeover, a kick, a keepalive that runs out and a lost socket (its will),
and a client certificate's identity logs it in (cn or san) and holds it to its rights
while it is carried."""

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
from tests.security.helpers import ADMIN, add_user, allow
from tests.security.test_tls import Pki, SecureClient, make_pki, port_of, tls_args

pytestmark = pytest.mark.skipif(plane.NATIVE is None or not hasattr(plane.NATIVE, "Engine"),
                                reason="the native data plane is not built")


class TlsRaw(RawClient):
    """RawClient over TLS (the server's certificate checked against the test CA)."""

    def __init__(self, port: int, ctx: ssl.SSLContext, version: int = 4,
                 timeout: float = 5.0) -> None:
        super().__init__(port, version, timeout)
        self.sock = ctx.wrap_socket(self.sock, server_hostname="localhost")

    def closed_by_server(self) -> bool:
        try:
            return super().closed_by_server()
        except (ssl.SSLError, OSError):
            return True


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path / "pki")


@pytest.fixture
def srv(tmp_path: Path, pki: Pki, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    """One reactor thread: no connection moves between threads, so counts are exact."""
    s = native_server(tmp_path / "data", monkeypatch, "--io-threads", "1", *tls_args(pki))
    yield s
    if s.proc is not None:
        assert s.stop() == 0, s.logs()[-3000:]


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def test_a_promoted_tls_client_publishes_and_receives_natively(srv: Server, pki: Pki) -> None:
    port = port_of(srv, "mqtt_tls")
    sub_id, pub_id = uid("tsub"), uid("tpub")
    sub = SecureClient(port, sub_id, tls=pki.client_context())
    sub.subscribe("tls/+/t", 1)
    pub = SecureClient(port, pub_id, tls=pki.client_context())
    pub.publish("tls/1/t", b"first", 1)
    assert [m.payload for m in sub.expect(1)] == [b"first"]
    wait_native(srv, sub_id, 1)
    wait_native(srv, pub_id)
    promoted = promotions(srv, pub_id) + promotions(srv, sub_id)
    before = native_counters(srv)
    for i in range(50):
        pub.publish("tls/1/t", b"q1-%d" % i, 1)
        pub.publish("tls/1/t", b"q0-%d" % i, 0)
    got = sub.expect(100)
    assert [m.payload for m in got] == [p for i in range(50) for p in (b"q1-%d" % i, b"q0-%d" % i)]
    after = native_counters(srv)
    for way in ("in", "out"):  # every one went in and out on the native side
        name = f"lightgate_native_messages_{way}_total"
        assert after[name] - before[name] == 100, way
    assert after["lightgate_native_tls_handshakes_total"] >= 2
    assert promotions(srv, pub_id) + promotions(srv, sub_id) == promoted, "none came back"
    pub.disconnect()
    sub.disconnect()


def test_a_tls_client_comes_back_for_a_subscribe_and_goes_native_again(
        srv: Server, pki: Pki) -> None:
    raw = TlsRaw(port_of(srv, "mqtt_tls"), pki.client_context(), version=5)
    cid = uid("traw")
    raw.connect(cid)
    wait_promoted(srv, cid)
    ack = raw.subscribe(f"own/{cid}", 1)  # Python's SUBACK, over the same TLS session
    assert ack.reason_codes == [1]
    assert said_back(srv, cid, "packet")
    wait_native(srv, cid, 1)
    before = native_counters(srv)
    raw.send(mqtt.Publish(f"own/{cid}", b"mine", 1, packet_id=5))
    got = [raw.recv(), raw.recv()]
    assert isinstance(got[0], mqtt.Puback) and got[0].packet_id == 5
    assert isinstance(got[1], mqtt.Publish) and got[1].payload == b"mine"
    raw.send(mqtt.Puback(got[1].packet_id))
    after = native_counters(srv)
    assert after["lightgate_native_messages_in_total"] \
        - before["lightgate_native_messages_in_total"] == 1
    raw.send(mqtt.Disconnect())
    assert raw.closed_by_server()


def test_takeover_and_kick_of_promoted_tls_connections(srv: Server, pki: Pki) -> None:
    import urllib.request

    port = port_of(srv, "mqtt_tls")
    first = TlsRaw(port, pki.client_context(), version=5)
    first.connect("ttwin")
    wait_promoted(srv, "ttwin")
    second = TlsRaw(port, pki.client_context(), version=5)
    assert second.connect("ttwin").reason_code == 0
    bye = first.recv()
    assert isinstance(bye, mqtt.Disconnect) and bye.reason_code == 0x8E  # taken over
    assert first.closed_by_server()
    wait_promoted(srv, "ttwin", 2)
    req = urllib.request.Request(f"http://{srv.addrs['http']}/api/v1/clients/ttwin/kick",
                                 method="POST")
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 200
    bye = second.recv()
    assert isinstance(bye, mqtt.Disconnect) and bye.reason_code == 0x98  # administrative
    assert second.closed_by_server()
    third = TlsRaw(port, pki.client_context(), version=5)
    third.connect("tlast")
    wait_promoted(srv, "tlast")
    assert srv.stop() == 0, srv.logs()[-3000:]
    bye = third.recv()
    assert isinstance(bye, mqtt.Disconnect) and bye.reason_code == 0x8B  # shutting down


def test_a_promoted_tls_clients_lost_socket_publishes_its_will(srv: Server, pki: Pki) -> None:
    watcher = SecureClient(port_of(srv, "mqtt_tls"), uid("twatch"), tls=pki.client_context())
    watcher.subscribe("wills/#", 1)
    raw = TlsRaw(port_of(srv, "mqtt_tls"), pki.client_context())
    raw.connect("tdoomed", will=mqtt.Will("wills/tdoomed", b"gone", 1, False))
    wait_promoted(srv, "tdoomed")
    raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    raw.close()  # a reset: no DISCONNECT, no close_notify
    [will] = watcher.expect(1)
    assert (will.topic, will.payload) == ("wills/tdoomed", b"gone")
    assert said_back(srv, "tdoomed", "lost")
    watcher.disconnect()


def test_a_promoted_tls_client_that_goes_quiet_times_out_with_its_will(
        srv: Server, pki: Pki) -> None:
    watcher = SecureClient(port_of(srv, "mqtt_tls"), uid("twatch"), tls=pki.client_context())
    watcher.subscribe("wills/#", 1)
    raw = TlsRaw(port_of(srv, "mqtt_tls"), pki.client_context(), version=5, timeout=10)
    raw.connect("tsleeper", keepalive=1, will=mqtt.Will("wills/tsleeper", b"timed out", 1))
    wait_native(srv, "tsleeper")
    started = time.monotonic()
    bye = raw.recv()  # nothing sent: 1.5 keepalives later the engine hands it back
    assert isinstance(bye, mqtt.Disconnect) and bye.reason_code == 0x8D
    assert time.monotonic() - started < 5
    [will] = watcher.expect(1)
    assert (will.topic, will.payload) == ("wills/tsleeper", b"timed out")
    assert said_back(srv, "tsleeper", "timeout")
    watcher.disconnect()


@pytest.mark.parametrize(("source", "user"), [
    ("cn", "device-1"), ("san", "sensor-9.devices.example"),
])
def test_a_certificates_identity_is_the_user_while_carried(
        tmp_path: Path, pki: Pki, monkeypatch: pytest.MonkeyPatch, source: str,
        user: str) -> None:
    """Mutual TLS with --auth: the certificate's cn (or san) is the user, no password;
    promoted, it publishes natively where its rights allow and gets Python's refusal
    where they do not."""
    srv = native_server(tmp_path / "data", monkeypatch, "--auth", "--init-user",
                        f"{ADMIN[0]}:{ADMIN[1]}", "--io-threads", "1",
                        *tls_args(pki, "--tls-ca", str(pki.ca_pem),
                                  "--tls-client-auth", "required",
                                  "--tls-username-from", source))
    try:
        add_user(srv, user, "unused-pw")
        allow(srv, user, f"Topic:dev/{user}/", "PUB", match="prefixed")
        port = port_of(srv, "mqtt_tls")
        raw = TlsRaw(port, pki.client_context(with_cert=True), version=5)
        cid = uid("mtls")
        assert raw.connect(cid).reason_code == 0
        assert srv.wait_log(f"certificate identity {user!r}")
        raw.send(mqtt.Publish(f"dev/{user}/up", b"first", 1, packet_id=1))
        assert (raw.recv().reason_code) == 0  # Python's answer: now in its ACL cache
        wait_native(srv, cid)
        before = native_counters(srv)
        for i in range(2, 12):
            raw.send(mqtt.Publish(f"dev/{user}/up", b"m", 1, packet_id=i))
            assert raw.recv().reason_code == 0
        after = native_counters(srv)
        assert after["lightgate_native_messages_in_total"] \
            - before["lightgate_native_messages_in_total"] == 10
        raw.send(mqtt.Publish("dev/someone-else/up", b"no", 1, packet_id=20))
        denied = raw.recv()
        assert isinstance(denied, mqtt.Puback) and denied.reason_code == 0x87
        raw.send(mqtt.Disconnect())
        assert raw.closed_by_server()
    finally:
        assert srv.stop() == 0, srv.logs()[-3000:]


def test_a_burst_from_a_carried_tls_publisher_is_all_read(srv: Server, pki: Pki) -> None:
    """Many small records arrive at once: each decrypts short of a read's size while
    the socket holds more, and all of them are read without the client writing again."""
    port = port_of(srv, "mqtt_tls")
    sub = TlsRaw(port, pki.client_context(), timeout=10)
    sub.connect(uid("bsub"))
    sub.subscribe("burst/t", 0)
    pub_id = uid("bpub")
    pub = TlsRaw(port, pki.client_context())
    pub.connect(pub_id)
    wait_native(srv, pub_id)
    packets = [mqtt.encode(mqtt.Publish("burst/t", b"%05d" % i + b"x" * 90, 0), 4)
               for i in range(3000)]
    for i in range(0, len(packets), 10):  # a record per 10 publishes
        pub.send_raw(b"".join(packets[i:i + 10]))
    got = [sub.recv() for _ in range(len(packets))]
    assert [p.payload[:5] for p in got] == [b"%05d" % i for i in range(len(packets))]
    pub.close()
    sub.close()
