"""A node whose files were damaged while it was down starts, says what it repaired, and
serves everything but the damaged records."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from gateway import mqtt
from tests.conftest import Server
from tests.mqtt.raw import RawClient


def publish(srv: Server, n: int, start: int = 0) -> list[bytes]:
    pub = RawClient(srv.port)
    pub.connect("pub")
    bodies = []
    for i in range(start, start + n):
        body = b"%05d" % i + b"-" * 300
        pub.send(mqtt.Publish("dmg/t", body, qos=1, packet_id=i % 65535 + 1))
        assert isinstance(pub.recv(), mqtt.Puback)
        bodies.append(body)
    pub.close()
    return bodies


def receive_all(srv: Server, n: int) -> list[bytes]:
    sub = RawClient(srv.port)
    assert sub.connect("keeper", clean=False).session_present
    got = []
    while len(got) < n:
        p = sub.recv()
        got.append(p.payload)
        sub.send(mqtt.Puback(p.packet_id))
    sub.close()
    return got


def last_segment(data: Path) -> Path:
    return sorted((data / "commitlog").glob("0*"))[-1]


def test_torn_tail_flipped_byte_lost_index_and_checkpoint(tmp_path) -> None:
    data = tmp_path / "d"
    srv = Server(data, "--segment-size", "65536").start()
    sub = RawClient(srv.port)
    sub.connect("keeper", clean=False)
    sub.subscribe("dmg/#", 1)
    sub.close()
    bodies = publish(srv, 400)
    srv.kill()
    # 1. A torn tail: the last record cut in half.
    seg = last_segment(data)
    size = seg.stat().st_size
    with open(seg, "r+b") as fh:
        fh.truncate(size - 100)
    srv.start()
    assert srv.wait_log("commitlog cut at offset")
    assert srv.wait_log("quarantine")
    got = receive_all(srv, 399)
    assert got == bodies[:399]  # everything before the damage, in order
    time.sleep(1.0)  # offsets are flushed every 0.5 s: a crash right after an ack redelivers
    srv.kill()
    # 2. The index and the checkpoint are gone: rebuilt from the log.
    shutil.rmtree(data / "index")
    (data / "commitlog" / "checkpoint").unlink()
    srv.start()
    assert srv.wait_log("records indexed again")
    more = publish(srv, 10, start=1000)
    got = receive_all(srv, 10)
    assert got == more
    time.sleep(1.0)
    srv.kill()
    # 3. A flipped byte in the last segment: that record is read around (its bytes kept
    #    aside), the records after it are kept.
    seg = last_segment(data)
    raw = bytearray(seg.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    seg.write_bytes(bytes(raw))
    srv.start()
    assert srv.wait_log("CRC mismatch") or srv.wait_log("bad ")
    after = publish(srv, 5, start=2000)
    sub = RawClient(srv.port)
    sub.connect("keeper", clean=False)
    got = []
    sub.sock.settimeout(3)
    try:
        while True:
            p = sub.recv()
            got.append(p.payload)
            sub.send(mqtt.Puback(p.packet_id))
    except TimeoutError:
        pass
    assert got[-5:] == after, srv.logs()[-6000:]  # new messages are served after the repair
    assert srv.stop() == 0
