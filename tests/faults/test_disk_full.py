"""The store on a small filesystem: when it fills, publishes fail with a clear reason,
nothing stored before is damaged, and service comes back once space is freed."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

from gateway import mqtt
from tests.conftest import Server, free_bytes
from tests.mqtt.raw import RawClient
from tests.plane.test_handover import wait_native


def test_disk_full_refuses_clearly_keeps_data_and_recovers(small_fs: Path) -> None:
    srv = Server(small_fs / "data", "--segment-size", "262144").start()
    try:
        sub = RawClient(srv.port)
        sub.connect("keeper", clean=False)
        sub.subscribe("full/#", 1)
        sub.close()
        filler = small_fs / "filler"
        filler.write_bytes(b"\0" * (free_bytes(small_fs) - 1_500_000))
        pub = RawClient(srv.port, version=5)
        pub.connect("pub")
        acked: list[bytes] = []
        refusal = None
        for i in range(1, 5000):
            body = b"%05d" % i + b"." * 2000
            pub.send(mqtt.Publish("full/x", body, qos=1, packet_id=i))
            ack = pub.recv()
            if ack.reason_code:
                refusal = ack
                break
            acked.append(body)
        assert refusal is not None, "the disk never filled"
        assert refusal.reason_code == 0x97  # Quota exceeded
        assert "no space" in refusal.properties["reason_string"]
        assert srv.wait_log("No space left on device")
        # A 3.1.1 client has no negative ack: its connection is closed so it resends.
        old = RawClient(srv.port)
        old.connect("old")
        old.send(mqtt.Publish("full/x", b"z" * 2000, qos=1, packet_id=1))
        assert old.closed_by_server()
        filler.unlink()  # space is back
        for i in range(5000, 5010):
            body = b"%05d" % i
            pub.send(mqtt.Publish("full/x", body, qos=1, packet_id=i))
            assert pub.recv().reason_code == 0
            acked.append(body)
        pub.close()
        sub = RawClient(srv.port)
        assert sub.connect("keeper", clean=False).session_present
        got = []
        while len(got) < len(acked):
            p = sub.recv()
            got.append(p.payload)
            sub.send(mqtt.Puback(p.packet_id))
        assert got == acked  # every acknowledged message, intact and in order
        sub.close()
    finally:
        assert srv.stop() == 0, srv.logs()[-2000:]
    # And it starts again on the same data, with nothing to repair.
    srv = Server(small_fs / "data", "--segment-size", "262144").start()
    assert srv.wait_log("commitlog recovered after a clean shutdown")
    assert "torn tail" not in srv.logs()
    assert srv.stop() == 0


def connack(port: int, client_id: str, version: int) -> mqtt.Connack:
    """The CONNACK of a new persistent session (a ConnectionError: closed without one)."""
    c = RawClient(port, version=version, timeout=5.0)
    try:
        props = {"session_expiry_interval": 300} if version == 5 else {}
        c.send(mqtt.Connect(client_id=client_id, protocol_level=version, clean_start=False,
                            keepalive=60, properties=props))
        ack = c.recv()
        assert isinstance(ack, mqtt.Connack), ack
        return ack
    finally:
        c.close()


def take(sub: RawClient, got: list[bytes], seconds: float) -> None:
    """Take (and acknowledge) what comes for `seconds`; a closed connection fails."""
    sub.sock.settimeout(0.2)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            p = sub.recv()
        except TimeoutError:
            continue
        if isinstance(p, mqtt.Publish):
            got.append(p.payload)
            sub.send(mqtt.Puback(p.packet_id))


@pytest.mark.parametrize("plane", ["native", "python"])
def test_a_full_disk_keeps_persistent_subscribers_and_says_so_once(
        small_fs: Path, monkeypatch: pytest.MonkeyPatch, plane: str) -> None:
    """A persistent subscriber is connected, with messages in flight, when the disk
    fills: it stays connected (its deliveries wait, one line says so) and gets every
    message once there is room again. (On the native plane a batch's record is written
    ahead of the client's window, so what was published before the disk filled may
    all have its records, and go without waiting.) Meanwhile a new persistent session
    is refused with CONNACK 3 (3.1.1) or 0x97 (5.0), and refused publishes are logged
    once in a while, not each. (Before, the session's records could not be written:
    the subscriber was closed with a traceback on each delivery, a persistent CONNECT
    had no CONNACK, the metadata store took no write again until a restart, and each
    refused publish wrote two log lines.)"""
    if plane == "native" and importlib.util.find_spec("serving.lightgate_native") is None:
        pytest.skip("the native data plane is not built")
    monkeypatch.setenv("LIGHTGATE_NATIVE", "1" if plane == "native" else "0")
    srv = Server(small_fs / "data", "--segment-size", "262144").start()
    try:
        keeper = RawClient(srv.port, timeout=5.0)
        keeper.connect("keeper", clean=False)
        keeper.subscribe("full/#", 1)  # not read yet: its window fills and waits
        filler = small_fs / "filler"
        filler.write_bytes(b"\0" * (free_bytes(small_fs) - 1_500_000))
        pub = RawClient(srv.port, version=5)
        pub.connect("pub")
        acked: list[bytes] = []
        for i in range(1, 5000):
            body = b"%05d" % i + b"." * 2000
            pub.send(mqtt.Publish("full/x", body, qos=1, packet_id=i))
            if pub.recv().reason_code:
                break
            acked.append(body)
        assert 100 < len(acked) < 4999, len(acked)
        got: list[bytes] = []
        take(keeper, got, 2.0)  # acks whose records cannot go; deliveries that cannot go
        keeper.send(mqtt.Pingreq())
        take(keeper, got, 0.5)  # still read: the PINGRESP came (or recv had failed)
        assert 0 < len(got) <= len(acked) and got == acked[:len(got)]
        waited = len(got) < len(acked)
        assert waited or plane == "native"
        assert connack(srv.port, "new-3", 4).return_code == 3  # Server unavailable
        ack5 = connack(srv.port, "new-5", 5)
        assert ack5.reason_code == 0x97  # Quota exceeded, as a refused publish
        assert "no space left" in ack5.properties["reason_string"]
        before = len(srv.log)
        codes = []
        for i in range(0, 480, 16):  # refused publishes, 16 in flight
            for pid in range(i + 1, i + 17):
                pub.send(mqtt.Publish("full/x", b"z" * 1000, qos=1, packet_id=pid))
            codes += [pub.recv().reason_code for _ in range(16)]
        assert codes.count(0x97) > 400
        said = [line for line in srv.log[before:] if " DEBUG " not in line]
        assert len(said) <= 6, said  # once per 10 s per kind (the disk, the gateway)
        filler.unlink()  # room again: deliveries go on, new sessions are kept
        deadline = time.monotonic() + 20
        while len(set(got)) < len(acked) and time.monotonic() < deadline:
            take(keeper, got, 0.5)
        firsts = list(dict.fromkeys(got))  # QoS 1: one in flight at the fill may repeat
        assert firsts == acked, (len(firsts), len(acked))
        assert connack(srv.port, "new-3", 4).return_code == 0
        keeper.close()
        pub.close()
        logs = srv.logs()
        assert "Traceback" not in logs, logs[logs.index("Traceback") - 300:][:3000]
        assert logs.count("delivery to 'keeper' paused") == (1 if waited else 0)
        assert not waited or "delivery to 'keeper' resumed" in logs
    finally:
        assert srv.stop() == 0, srv.logs()[-2000:]


@pytest.mark.parametrize("plane", ["native", "python"])
def test_a_full_disks_refusal_is_explained_only_to_who_asked(
        small_fs: Path, monkeypatch: pytest.MonkeyPatch, plane: str) -> None:
    """On both planes (the native one carries both clients, promoted first), a v5
    publish refused for a full disk gets PUBACK 0x97 with the one wording of both
    planes, and with no Reason String at all for a client that set Request Problem
    Information 0 [MQTT-3.1.2-29]."""
    if plane == "native" and importlib.util.find_spec("serving.lightgate_native") is None:
        pytest.skip("the native data plane is not built")
    monkeypatch.setenv("LIGHTGATE_NATIVE", "1" if plane == "native" else "0")
    srv = Server(small_fs / "data", "--segment-size", "262144").start()
    assert srv.addrs["plane"] == plane
    try:
        told, quiet = RawClient(srv.port, version=5), RawClient(srv.port, version=5)
        told.connect("told")
        quiet.connect("quiet", properties={"request_problem_information": 0})
        for raw in (told, quiet):  # the topic in the native side's ACL cache
            raw.send(mqtt.Publish("full/x", b"w", qos=1, packet_id=1))
            assert raw.recv().reason_code == 0
        if plane == "native":
            wait_native(srv, "told")
            wait_native(srv, "quiet")
        filler = small_fs / "filler"
        filler.write_bytes(b"\0" * (free_bytes(small_fs) - 1_000_000))
        for pid in range(2, 200):  # 32 KB each: the disk is full within 1 MB
            told.send(mqtt.Publish("full/x", b"f" * 32_000, qos=1, packet_id=pid))
            ack = told.recv()
            if ack.reason_code:
                break
        assert (ack.reason_code, ack.properties) == (
            0x97, {"reason_string": "not stored: no space left on the store's disk"})
        quiet.send(mqtt.Publish("full/x", b"q" * 32_000, qos=1, packet_id=2))
        quiet.sock.settimeout(5)
        assert quiet.sock.recv(100) == mqtt.encode(mqtt.Puback(2, 0x97), 5) == \
            b"\x40\x03\x00\x02\x97"
        filler.unlink()
    finally:
        assert srv.stop() == 0, srv.logs()[-2000:]
