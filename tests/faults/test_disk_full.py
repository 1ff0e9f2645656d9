"""The store on a small filesystem: when it fills, publishes fail with a clear reason,
nothing stored before is damaged, and service comes back once space is freed."""

from __future__ import annotations

import importlib.util
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
    assert srv.wait_log("truncated_at=None")
    assert srv.stop() == 0


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
