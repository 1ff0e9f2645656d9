"""MQTT over TLS and mutual TLS against a real `lightgate serve`: paho over TLS, client
certificates required or not, the certificate identity, a certificate renewed on disk
without a restart, and garbage on the TLS port.

Certificates come from `trustme`; every wait is bounded."""

from __future__ import annotations

import os
import queue
import signal
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import paho.mqtt.client as paho
import pytest
import trio
import trustme
from paho.mqtt.enums import CallbackAPIVersion

from gateway import mqtt
from gateway.transports import ServerTLS, cert_identity
from tests.conftest import Server
from tests.mqtt.paho_client import Client

CONNACK_OK = b"\x20\x02\x00\x00"
TIMEOUT = 10.0


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


# -- certificates -------------------------------------------------------------------

@dataclass
class Pki:
    """One CA with a server certificate (127.0.0.1, localhost) and a client certificate
    (CN device-1, SAN sensor-9.devices.example), as PEM files."""

    ca: trustme.CA
    ca_pem: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def client_context(self, with_cert: bool = False) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca_pem))
        if with_cert:
            ctx.load_cert_chain(str(self.client_cert), str(self.client_key))
        return ctx


def make_pki(folder: Path) -> Pki:
    folder.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("sensor-9.devices.example", common_name="device-1")
    pki = Pki(ca, folder / "ca.pem", folder / "server.pem", folder / "server.key",
              folder / "client.pem", folder / "client.key")
    ca.cert_pem.write_to_path(str(pki.ca_pem))
    server.private_key_pem.write_to_path(str(pki.server_key))
    server.cert_chain_pems[0].write_to_path(str(pki.server_cert))
    for pem in server.cert_chain_pems[1:]:
        pem.write_to_path(str(pki.server_cert), append=True)
    client.private_key_pem.write_to_path(str(pki.client_key))
    client.cert_chain_pems[0].write_to_path(str(pki.client_cert))
    return pki


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path / "pki")


def tls_args(pki: Pki, *extra: str) -> list[str]:
    return ["--mqtt-tls", "127.0.0.1:0", "--wss", "127.0.0.1:0",
            "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), *extra]


def start(tmp_path: Path, *args: str) -> Server:
    return Server(tmp_path / "data", *args).start()


@pytest.fixture
def tls_server(tmp_path: Path, pki: Pki) -> Iterator[Server]:
    srv = start(tmp_path, *tls_args(pki))
    yield srv
    if srv.proc is not None:
        assert srv.stop() == 0, srv.logs()[-3000:]


def port_of(srv: Server, name: str) -> int:
    return int(srv.addrs[name].rsplit(":", 1)[1])


# -- clients ------------------------------------------------------------------------

class Message(NamedTuple):
    topic: str
    payload: bytes


class SecureClient:
    """A paho client over TLS and/or WebSocket with bounded waits, connected when
    constructed (self-contained: tests.mqtt.paho_client.Client speaks plain TCP only)."""

    def __init__(
        self, port: int, client_id: str, *, tls: ssl.SSLContext | None = None,
        transport: str = "tcp", path: str = "/mqtt", version: int = 4,
    ) -> None:
        proto = {4: paho.MQTTv311, 5: paho.MQTTv5}[version]
        self.c = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=proto,
                             transport=transport, reconnect_on_failure=False)
        self.messages: queue.Queue[Message] = queue.Queue()
        self.connected = threading.Event()
        self.disconnected = threading.Event()
        self._acks: dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        self.c.on_connect = self._on_connect
        self.c.on_disconnect = lambda *a: self.disconnected.set()
        self.c.on_message = lambda c, u, msg: self.messages.put(Message(msg.topic, msg.payload))
        self.c.on_publish = lambda c, u, mid, *a: self._ack(mid).set()
        self.c.on_subscribe = lambda c, u, mid, *a: self._ack(mid).set()
        if tls is not None:
            self.c.tls_set_context(tls)
        if transport == "websockets":
            self.c.ws_set_options(path=path)
        self.c.connect("127.0.0.1", port, 30)
        self.c.loop_start()
        if not self.connected.wait(TIMEOUT):
            self.c.loop_stop()
            raise TimeoutError("no CONNACK")
        if self.reason.is_failure:
            self.c.loop_stop()
            raise ConnectionRefusedError(f"CONNACK {self.reason}")

    def _on_connect(self, client, userdata, flags, reason, properties) -> None:
        self.reason = reason
        self.connected.set()

    def _ack(self, mid: int) -> threading.Event:
        with self._lock:  # paho's thread and the test's both get here
            return self._acks.setdefault(mid, threading.Event())

    def subscribe(self, topic: str, qos: int = 0) -> None:
        rc, mid = self.c.subscribe(topic, qos)
        assert rc == 0 and self._ack(mid).wait(TIMEOUT), "no SUBACK"

    def publish(self, topic: str, payload: bytes, qos: int = 0) -> None:
        info = self.c.publish(topic, payload, qos)
        if qos:
            assert self._ack(info.mid).wait(TIMEOUT), f"no ack for QoS {qos}"

    def expect(self, n: int = 1) -> list[Message]:
        return [self.messages.get(timeout=TIMEOUT) for _ in range(n)]

    def disconnect(self) -> None:
        self.c.disconnect()
        self.disconnected.wait(TIMEOUT)
        self.c.loop_stop()


def raw_tls_connect(port: int, ctx: ssl.SSLContext, client_id: str) -> bytes:
    """CONNECT over TLS from a plain socket; the first bytes back (a CONNACK), or b""
    when the server closes. TLS errors propagate."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            ctx.wrap_socket(raw, server_hostname="localhost") as s:
        s.sendall(mqtt.encode(mqtt.Connect(client_id=client_id), 4))
        data = b""
        while len(data) < 4:
            chunk = s.recv(4 - len(data))
            if not chunk:
                break
            data += chunk
        return data


def refused(port: int, ctx: ssl.SSLContext) -> bool:
    """Whether the server turns this TLS client away (during or right after the
    handshake: with TLS 1.3 the client learns of a missing certificate on its first read)."""
    try:
        return raw_tls_connect(port, ctx, uid("refused")) != CONNACK_OK
    except (ssl.SSLError, ConnectionError):
        return True


def round_trip(pub: Client | SecureClient, sub: Client | SecureClient, topic: str,
               payload: bytes) -> None:
    sub.subscribe(topic, 1)
    pub.publish(topic, payload, 1)
    [m] = sub.expect(1)
    assert (m.topic, m.payload) == (topic, payload)


# -- tests --------------------------------------------------------------------------

def test_paho_publishes_and_receives_over_tls(tls_server: Server, pki: Pki) -> None:
    port = port_of(tls_server, "mqtt_tls")
    sub = SecureClient(port, uid("sub"), tls=pki.client_context())
    pub = SecureClient(port, uid("pub"), tls=pki.client_context())
    plain = Client(tls_server.port, uid("plain"))  # TCP and TLS share one broker
    topic = uid("tls") + "/t"
    round_trip(pub, sub, topic, b"secret")
    plain.subscribe(topic, 1)
    pub.publish(topic, b"to-both", 1)
    assert sub.expect(1)[0].payload == b"to-both"
    assert plain.expect(1)[0].payload == b"to-both"
    for c in (sub, pub, plain):
        c.disconnect()


def test_ready_line_names_every_listener(tls_server: Server) -> None:
    for name in ("mqtt", "mqtt_tls", "ws", "wss"):
        host, port = tls_server.addrs[name].rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0, tls_server.addrs


def test_client_that_does_not_trust_the_server_cannot_connect(
    tls_server: Server, tmp_path: Path
) -> None:
    stranger = make_pki(tmp_path / "stranger")
    with pytest.raises(ssl.SSLCertVerificationError):
        raw_tls_connect(port_of(tls_server, "mqtt_tls"), stranger.client_context(), uid("x"))


def test_mutual_tls_required_rejects_a_client_without_a_certificate(
    tmp_path: Path, pki: Pki
) -> None:
    srv = start(tmp_path, *tls_args(pki, "--tls-ca", str(pki.ca_pem),
                                     "--tls-client-auth", "required"))
    try:
        port = port_of(srv, "mqtt_tls")
        assert refused(port, pki.client_context(with_cert=False))
        assert srv.wait_log("TLS handshake with 127.0.0.1:")
        # A certificate from another CA is no better than none.
        other = make_pki(tmp_path / "other")
        foreign = pki.client_context()
        foreign.load_cert_chain(str(other.client_cert), str(other.client_key))
        assert refused(port, foreign)
        # With a certificate from the configured CA: in, and MQTT works.
        assert raw_tls_connect(port, pki.client_context(with_cert=True), uid("ok")) == CONNACK_OK
        a = SecureClient(port, uid("a"), tls=pki.client_context(with_cert=True))
        b = SecureClient(port, uid("b"), tls=pki.client_context(with_cert=True))
        round_trip(a, b, uid("mtls") + "/t", b"hello")
        a.disconnect()
        b.disconnect()
    finally:
        assert srv.stop() == 0, srv.logs()[-3000:]


def test_mutual_tls_optional_admits_clients_with_and_without_certificates(
    tmp_path: Path, pki: Pki
) -> None:
    srv = start(tmp_path, *tls_args(pki, "--tls-ca", str(pki.ca_pem),
                                     "--tls-client-auth", "optional",
                                     "--tls-username-from", "cn"))
    try:
        port = port_of(srv, "mqtt_tls")
        assert raw_tls_connect(port, pki.client_context(), uid("anon")) == CONNACK_OK
        assert raw_tls_connect(port, pki.client_context(True), uid("dev")) == CONNACK_OK
        assert srv.wait_log("certificate identity 'device-1'")
        assert srv.logs().count("certificate identity") == 1  # none for the anonymous one
    finally:
        assert srv.stop() == 0, srv.logs()[-3000:]


@pytest.mark.parametrize(("source", "expected"), [
    ("cn", "device-1"), ("san", "sensor-9.devices.example"),
])
def test_certificate_identity_reaches_the_connection(
    tmp_path: Path, pki: Pki, source: str, expected: str
) -> None:
    """End to end: the identity read from the client certificate on each TLS listener."""
    srv = start(tmp_path, *tls_args(pki, "--tls-ca", str(pki.ca_pem),
                                     "--tls-client-auth", "required",
                                     "--tls-username-from", source))
    try:
        c = SecureClient(port_of(srv, "mqtt_tls"), uid("id"), tls=pki.client_context(True))
        assert srv.wait_log(f"certificate identity {expected!r}")
        w = SecureClient(port_of(srv, "wss"), uid("idw"), tls=pki.client_context(True),
                         transport="websockets")
        assert srv.wait_log(f"certificate identity {expected!r}", count=2)
        c.disconnect()
        w.disconnect()
    finally:
        assert srv.stop() == 0, srv.logs()[-3000:]


async def _handshake(pki: Pki, client: ssl.SSLContext, **server: str) -> str | None:
    """A real TLS handshake over a socket pair through ServerTLS.handshake; the identity
    it hands to Connection (or 'refused')."""
    tls = ServerTLS(str(pki.server_cert), str(pki.server_key), str(pki.ca_pem), **server)
    a, b = trio.socket.socketpair()
    server_side, client_side = trio.SocketStream(a), trio.SocketStream(b)
    client_tls = trio.SSLStream(client_side, client, server_hostname="localhost")
    result: list = []

    async def serve() -> None:
        result.append(await tls.handshake(server_side, "test-peer"))

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            try:
                await client_tls.do_handshake()
            except trio.BrokenResourceError:
                pass
    await trio.aclose_forcefully(client_tls)
    if result[0] is None:
        return "refused"
    stream, identity = result[0]
    await trio.aclose_forcefully(stream)
    return identity


async def test_identity_extraction_over_a_real_handshake(pki: Pki) -> None:
    with_cert = pki.client_context(with_cert=True)
    assert await _handshake(pki, with_cert, client_auth="required", username_from="cn") \
        == "device-1"
    assert await _handshake(pki, with_cert, client_auth="required", username_from="san") \
        == "sensor-9.devices.example"
    assert await _handshake(pki, with_cert, client_auth="required") is None  # not asked for
    assert await _handshake(pki, pki.client_context(), client_auth="optional",
                            username_from="cn") is None
    assert await _handshake(pki, pki.client_context(), client_auth="required",
                            username_from="cn") == "refused"


def test_cert_identity_picks_the_first_usable_name() -> None:
    cert = {
        "subject": ((("countryName", "DE"),), (("commonName", "dev-a"),),
                    (("commonName", "dev-b"),)),
        "subjectAltName": (("IP Address", "10.0.0.1"), ("email", "dev@example.com"),
                           ("DNS", "dev.example")),
    }
    assert cert_identity(cert, "cn") == "dev-a"
    assert cert_identity(cert, "san") == "dev@example.com"
    assert cert_identity(cert, "none") is None
    assert cert_identity({}, "cn") is None  # what getpeercert() gives when unverified
    assert cert_identity(None, "san") is None
    assert cert_identity({"subject": ((("organizationName", "x"),),)}, "cn") is None
    assert cert_identity({"subjectAltName": (("IP Address", "10.0.0.1"),)}, "san") is None


def _replace(path: Path, data: bytes) -> None:
    """Write a file the way certificate tools do: a temporary file, then a rename."""
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def test_certificate_reload_without_restart(tmp_path: Path, pki: Pki) -> None:
    srv = start(tmp_path, *tls_args(pki))
    try:
        port = port_of(srv, "mqtt_tls")
        old_client = SecureClient(port, uid("old"), tls=pki.client_context())
        # A broken certificate file: the listener keeps serving with the old one.
        _replace(pki.server_cert, b"-----BEGIN CERTIFICATE-----\nbroken\n")
        assert raw_tls_connect(port, pki.client_context(), uid("still")) == CONNACK_OK
        assert srv.wait_log("did not load, keeping the previous one")
        # A renewed certificate from a different CA: new connections get it.
        new = make_pki(tmp_path / "renewed")
        _replace(pki.server_key, new.server_key.read_bytes())
        _replace(pki.server_cert, new.server_cert.read_bytes())
        fresh = SecureClient(port, uid("new"), tls=new.client_context())
        assert srv.wait_log("reloaded TLS certificate")
        with pytest.raises(ssl.SSLCertVerificationError):
            raw_tls_connect(port, pki.client_context(), uid("stale"))
        # The secure WebSocket listener shares the renewed certificate.
        wss = SecureClient(port_of(srv, "wss"), uid("wss"), tls=new.client_context(),
                           transport="websockets")
        # The connection made before the renewal is still up and working.
        topic = uid("reload") + "/t"
        round_trip(old_client, fresh, topic, b"across")
        wss.subscribe(topic, 1)
        old_client.publish(topic, b"again", 1)
        assert fresh.expect(1)[0].payload == b"again"
        assert wss.expect(1)[0].payload == b"again"
        for c in (old_client, fresh, wss):
            c.disconnect()
    finally:
        assert srv.stop() == 0, srv.logs()[-3000:]


def test_sighup_rereads_the_certificate_and_says_so(tmp_path: Path, pki: Pki) -> None:
    """SIGHUP rebuilds the TLS context at once, whatever the files' stats say, and logs
    which file changed; a file that does not load keeps the one in service, in one line,
    and the server goes on."""
    srv = start(tmp_path, *tls_args(pki))
    assert srv.proc is not None
    try:
        port = port_of(srv, "mqtt_tls")
        new = make_pki(tmp_path / "renewed")
        _replace(pki.server_key, new.server_key.read_bytes())
        _replace(pki.server_cert, new.server_cert.read_bytes())
        os.kill(srv.proc.pid, signal.SIGHUP)  # before any connection: SIGHUP, not a stat
        assert srv.wait_log(f"SIGHUP: TLS certificates: {pki.server_cert} changed")
        assert srv.wait_log(f"SIGHUP: TLS certificates: {pki.server_key} changed")
        assert raw_tls_connect(port, new.client_context(), uid("new")) == CONNACK_OK
        os.kill(srv.proc.pid, signal.SIGHUP)
        assert srv.wait_log("SIGHUP: TLS certificates unchanged")
        _replace(pki.server_cert, b"-----BEGIN CERTIFICATE-----\nbroken\n")
        os.kill(srv.proc.pid, signal.SIGHUP)
        assert srv.wait_log("SIGHUP: TLS certificates not re-read, those in effect are kept")
        assert raw_tls_connect(port, new.client_context(), uid("still")) == CONNACK_OK
    finally:
        assert srv.stop() == 0, srv.logs()[-3000:]


def test_plain_mqtt_and_silence_on_the_tls_port_do_not_hurt(tls_server: Server, pki: Pki) -> None:
    port = port_of(tls_server, "mqtt_tls")
    # A client that connects and says nothing holds only its own handshake.
    silent = socket.create_connection(("127.0.0.1", port), timeout=5)
    # Plain MQTT to the TLS port: no CONNACK, the connection is closed.
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(mqtt.encode(mqtt.Connect(client_id=uid("plain")), 4))
            got = b""
            while chunk := s.recv(1024):
                got += chunk
            assert CONNACK_OK not in got
    # Random bytes too.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(os.urandom(4096))
        try:
            while s.recv(1024):
                pass
        except ConnectionError:
            pass
    assert tls_server.wait_log("TLS handshake with 127.0.0.1:", count=4)
    # Others are served all along, TLS and TCP alike.
    c = SecureClient(port, uid("good"), tls=pki.client_context())
    d = Client(tls_server.port, uid("tcp"))
    round_trip(d, c, uid("after") + "/t", b"fine")
    c.disconnect()
    d.disconnect()
    silent.close()


def test_certificate_identity_logs_in_when_auth_is_on(tmp_path: Path, pki: Pki) -> None:
    """With --auth, a verified certificate naming a known user is that user (no password);
    an unknown name, or neither certificate nor username, is turned away."""
    srv = start(tmp_path, "--auth", "--init-user", "device-1:pw-unused",
                *tls_args(pki, "--tls-ca", str(pki.ca_pem), "--tls-client-auth", "optional",
                          "--tls-username-from", "cn"))
    try:
        port = port_of(srv, "mqtt_tls")
        assert raw_tls_connect(port, pki.client_context(True), uid("known")) == CONNACK_OK
        stranger = pki.ca.issue_cert("device-2.example", common_name="device-2")
        ctx = pki.client_context()
        with stranger.private_key_and_cert_chain_pem.tempfile() as pem:
            ctx.load_cert_chain(pem)
        refusal = raw_tls_connect(port, ctx, uid("unknown"))
        assert refusal[:3] == b"\x20\x02\x00" and refusal != CONNACK_OK
        assert raw_tls_connect(port, pki.client_context(), uid("anon")) == b"\x20\x02\x00\x05"
        # The same certificate over secure WebSocket.
        c = SecureClient(port_of(srv, "wss"), uid("wss"), tls=pki.client_context(True),
                         transport="websockets")
        round_trip(c, c, uid("cert-user") + "/t", b"as device-1")
        c.disconnect()
    finally:
        assert srv.stop() == 0, srv.logs()[-3000:]


def test_a_silent_client_is_closed_at_the_handshake_deadline(tmp_path: Path, pki: Pki) -> None:
    """--tls-handshake-timeout: a client that connects and says nothing is closed when
    it runs out, with one line, and others are served meanwhile."""
    srv = start(tmp_path, *tls_args(pki, "--tls-handshake-timeout", "1"))
    try:
        port = port_of(srv, "mqtt_tls")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as silent:
            began = time.monotonic()
            assert raw_tls_connect(port, pki.client_context(), uid("meanwhile")) == CONNACK_OK
            assert silent.recv(1) == b""  # closed by the server
            took = time.monotonic() - began
        assert 0.8 < took < 5, took
        assert srv.wait_log("timed out")
    finally:
        assert srv.stop() == 0, srv.logs()[-3000:]


def test_handshakes_under_way_are_bounded(tmp_path: Path, pki: Pki) -> None:
    """--tls-max-handshakes: past that many handshakes under way, the next client waits
    its turn (here until the silent ones time out), and is then served."""
    srv = start(tmp_path, *tls_args(pki, "--tls-max-handshakes", "3",
                                     "--tls-handshake-timeout", "1.5"))
    try:
        port = port_of(srv, "mqtt_tls")
        silent = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3)]
        time.sleep(0.3)  # the three hold every turn
        began = time.monotonic()
        assert raw_tls_connect(port, pki.client_context(), uid("waited")) == CONNACK_OK
        waited = time.monotonic() - began
        assert 0.8 < waited < 8, waited  # until the silent ones' 1.5 s ran out
        for s in silent:
            assert s.recv(1) == b""
            s.close()
        # With turns free, a client is served at once.
        began = time.monotonic()
        assert raw_tls_connect(port, pki.client_context(), uid("at-once")) == CONNACK_OK
        assert time.monotonic() - began < 0.8
    finally:
        assert srv.stop() == 0, srv.logs()[-3000:]
