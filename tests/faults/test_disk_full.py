"""The store on a small filesystem: when it fills, publishes fail with a clear reason,
nothing stored before is damaged, and service comes back once space is freed."""

from __future__ import annotations

from pathlib import Path

from gateway import mqtt
from tests.conftest import Server, free_bytes
from tests.mqtt.raw import RawClient


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
