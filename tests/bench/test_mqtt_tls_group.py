"""The MQTT benchmark's TLS rows and its store-group broker: each broker starts on its TLS
listener with the run's certificate and carries messages to clients that verify it;
mutual TLS turns away a client without a certificate; lightgate-group (three store
nodes, a gateway, Redis) starts and carries QoS 1; a tiny run on TLS has the new
fields. The peers built from their crate are skipped where missing (make bench-peers)."""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.mqtt import brokers, wire
from bench.mqtt.installs import RABBITMQ_SERVER, RUMQTTD, RUMQTTD_MTLS
from bench.mqtt.procfs import NATIVE_THREADS
from bench.mqtt.tls import Certs, client_context, make_certs
from tests.bench.test_mqtt_peers import _passes_messages

ROOT = Path(__file__).resolve().parents[2]
BUILT = {"rumqttd": RUMQTTD, "rabbitmq": RABBITMQ_SERVER}


@pytest.fixture(scope="module")
def certs() -> Iterator[Certs]:
    # Not under pytest's own 0700 directory: Debian's Mosquitto reads them as its user.
    directory = Path(tempfile.mkdtemp(prefix="bench-certs-"))
    yield make_certs(directory)
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture()
def on_tls(certs: Certs) -> Iterator[None]:
    yield
    wire.set_tls(None)
    wire.set_keepalive(0)


@pytest.mark.parametrize("name", [
    "mosquitto", "lightgate-native", "lightgate-async", "rumqttd", "amqtt",
    pytest.param("rabbitmq", marks=pytest.mark.slow)])  # its VM boots in 10-20 s
def test_broker_on_tls_carries_messages(name: str, certs: Certs, on_tls: None) -> None:
    if name in BUILT and not BUILT[name].exists():
        pytest.skip(f"{name} not installed (make bench-peers)")
    b = brokers.start_broker(name, brokers.Options(certs=certs))
    try:
        wire.set_keepalive(b.keepalive)
        wire.set_tls(client_context(certs, mutual=False))
        _passes_messages(b.port)  # QoS 0 and 1, over connections that verified the broker
        assert b.died() is None
        if name == "lightgate-native":  # python_cpu_share tells its reactors by name
            comms = {c.read_text().strip() for c in Path(f"/proc/{b.pid}/task").glob("*/comm")}
            assert any(c.startswith(NATIVE_THREADS[0]) for c in comms), comms
    finally:
        b.stop()


@pytest.mark.parametrize("name", ["mosquitto", "lightgate-native", "rumqttd"])
def test_mutual_tls_turns_away_a_client_without_certificate(name: str, certs: Certs,
                                                            on_tls: None) -> None:
    if name == "rumqttd" and not RUMQTTD_MTLS.exists():
        pytest.skip("rumqttd's mutual-TLS build missing (make bench-peers)")
    b = brokers.start_broker(name, brokers.Options(certs=certs, mutual=True))
    try:
        wire.set_keepalive(b.keepalive)
        wire.set_tls(client_context(certs, mutual=False))
        # TLS 1.3: the client's handshake is over before the broker checks it, so the
        # refusal comes as an alert or a closed connection at the first read.
        with pytest.raises((ssl.SSLError, ConnectionError)):
            wire.connect(b.port, "no-cert", timeout=10)
        wire.set_tls(client_context(certs, mutual=True))
        _passes_messages(b.port)
    finally:
        b.stop()


def test_tls_reads_are_batched_across_records(certs: Certs) -> None:
    """One recv over TLS yields one record (16 kB); recv_batch reads on to what is
    there, as a plain recv would, and still says when nothing is."""
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(str(certs.cert), str(certs.key))
    listener = socket.create_server(("127.0.0.1", 0))
    sent = threading.Event()
    payload = bytes(range(256)) * 400  # 100 kB: six records or more

    def serve() -> None:
        conn, _ = listener.accept()
        with server_ctx.wrap_socket(conn, server_side=True) as tls:
            tls.sendall(payload)
            sent.set()
            tls.recv(1)  # until the client closes

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    raw = socket.create_connection(listener.getsockname(), timeout=10)
    s = client_context(certs, mutual=False).wrap_socket(raw, server_hostname="127.0.0.1")
    try:
        assert sent.wait(10)
        got = wire.recv_batch(s, 1 << 20)
        assert len(got) > 16384  # more than one record in one call
        while len(got) < len(payload):
            got += wire.recv_batch(s, 1 << 20)
        assert got == payload
        s.setblocking(False)
        with pytest.raises(BlockingIOError):
            wire.recv_batch(s, 1 << 20)
    finally:
        s.close()
        thread.join(10)
        listener.close()


def test_tls_configs(certs: Certs, tmp_path: Path) -> None:
    mutual = brokers.Options(certs=certs, mutual=True)
    conf = brokers.mosquitto_config(1883, mutual).splitlines()
    assert f"certfile {certs.cert}" in conf and f"cafile {certs.ca}" in conf
    assert "require_certificate true" in conf
    assert "require_certificate true" not in brokers.mosquitto_config(
        1883, brokers.Options(certs=certs))
    tls = tomllib.loads(brokers.rumqttd_config(18830, 20_000, mutual))["v4"]["1"]["tls"]
    assert tls == {"capath": str(certs.ca), "certpath": str(certs.cert),
                   "keypath": str(certs.key)}
    rabbit = dict(line.split(" = ", 1) for line in brokers.rabbitmq_config(
        18831, 18832, tmp_path, mutual).splitlines())
    assert rabbit["mqtt.listeners.ssl.default"] == "127.0.0.1:18831"
    assert rabbit["mqtt.listeners.tcp"] == "none"
    assert rabbit["ssl_options.fail_if_no_peer_cert"] == "true"
    # A persistent session's queue: the bound the catch-up row asks for.
    assert "max_queued_messages 2000000" in brokers.mosquitto_config(
        1883, brokers.Options(max_queued=2_000_000))


def test_lightgate_group_starts_and_carries_qos1() -> None:
    """Three store nodes and two gateways over them (lightgate-group-2gw, lightgate-group
    with one more gateway): each gateway carries messages, and one published on the
    second reaches a subscriber on the first."""
    b = brokers.start_broker("lightgate-group-2gw")
    try:
        tags = sorted(p.name for p in b.tmp.glob("*.log"))
        assert tags == ["gateway.log", "gateway2.log", "redis.log", "store0.log",
                        "store1.log", "store2.log"]
        assert len(b.python) == 5 and b.pid == b.python[-1]  # b.port's gateway
        assert len(b.ports) == 2 and b.ports[0] == b.port
        _passes_messages(b.port)
        _passes_messages(b.port, b.ports[1])
        assert b.died() is None
    finally:
        b.stop()
    assert all(p.poll() is not None for p in b.procs)


def _tiny(tmp_path: Path, *args: str) -> list[dict[str, Any]]:
    res = subprocess.run([sys.executable, "bench/mqtt_bench.py", "--tiny", *args, "--out",
                          str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=180)
    assert res.returncode == 0, res.stderr[-2000:]
    rows: list[dict[str, Any]] = json.loads(res.stdout)
    for r in rows:
        assert "error" not in r, r
    return rows


def test_tiny_tls_run_has_the_new_fields(tmp_path: Path) -> None:
    """device_fanin's PUBLISH -> PUBACK round trip, the catch-up of a persistent
    session and Python's share of Lightgate's CPU, on TLS connections (the idle ones
    handshake under a selector)."""
    rows = {r["scenario"]: r for r in _tiny(
        tmp_path, "--tls", "--brokers", "lightgate-native", "--scenarios",
        "device_fanin,catchup_persistent,idle_conns")}
    for r in rows.values():
        assert r["tls"] is True and r["mutual_tls"] is False
        assert 0 <= r["python_cpu_share"] <= 1
    fanin = rows["device_fanin"]
    assert 0 < fanin["ack_p50_ms"] <= fanin["ack_p99_ms"] <= fanin["ack_max_ms"]
    assert fanin["loadgen_cpu_us_per_msg"] > 0
    catchup = rows["catchup_persistent"]
    assert catchup["main_figure"] == "msgs_per_s" and catchup["msgs_per_s"] > 0
    assert catchup["received"] == catchup["expected"] == 500
    assert catchup["session_present"] is True
    assert 0 < catchup["connack_ms"] <= catchup["first_ms"]
    assert rows["idle_conns"]["connected"] == 100


@pytest.mark.slow  # a fleet of 300 for 3 s, twice
def test_tiny_fleet_over_mutual_tls(tmp_path: Path) -> None:
    rows = _tiny(tmp_path, "--brokers", "lightgate-native,mosquitto", "--scenarios",
                 "device_fleet_mtls")
    assert [r["broker"] for r in rows] == ["lightgate-native", "mosquitto"]
    for fleet in rows:
        assert fleet["tls"] is True and fleet["mutual_tls"] is True
        assert fleet["received"] == fleet["acked"] == fleet["expected"] == 300 * 3
        assert 0 < fleet["ack_p50_ms"] <= fleet["ack_p99_ms"]
        assert "mutual TLS" in fleet["notes"]
