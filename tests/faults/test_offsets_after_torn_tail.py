"""kill -9, then the log's tail torn (the last segment cut 100 bytes short, as a power
loss may leave it), with the index (no WAL) behind the cut: the next message never gets
an offset a reader was already given, so a reader that keeps its own offsets (as a Spark
checkpoint does) and a persistent MQTT subscriber both get it. Also when the index was
lost as well.

The subscriber reads a wildcard queue: the positions a session stores would keep its own
queue's offsets ahead by themselves; the topic's queue is read by PULL alone."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from spark_streaming.native import StoreClient
from store import record
from tests.conftest import Server
from tests.faults.damage import (
    PLANES,
    publish,
    records,
    segments,
    subscribe,
    use_plane,
)
from tests.faults.persistent import drain

COUNT = 2000
TOPIC = "torn/t"


def pull_to_end(srv: Server, offset: int) -> tuple[list[int], list[bytes], int]:
    """A reader's PULLs from `offset` to the queue's end: the offsets and bodies it was
    given, and where it goes on from."""
    offsets, bodies = [], []
    with StoreClient(srv.native) as client:
        while True:
            msgs, nxt = client.pull(TOPIC, offset, 512)
            for m in msgs:
                offsets.append(m.offset_in(TOPIC))
                bodies.append(m.body)
            if not msgs:
                return offsets, bodies, offset
            offset = nxt


def tear_tail(data: Path, cut: int = 100) -> None:
    """Cut the log `cut` bytes into the last record of TOPIC: what follows it (the
    $SYS messages of the last second) goes too, as a power loss takes a tail."""
    for seg in reversed(segments(data)):
        raw = seg.read_bytes()
        ends = [pos + size for pos, size in records(seg)
                if record.decode(raw, pos).topic == TOPIC]
        if ends:
            with open(seg, "r+b") as fh:
                fh.truncate(ends[-1] - cut)
            return
        seg.unlink()
    raise AssertionError("no record of the topic")


@pytest.mark.parametrize("plane_name", PLANES)
def test_offsets_handed_out_are_not_given_again_after_a_torn_tail(
        tmp_path: Path, plane_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    use_plane(plane_name, monkeypatch)
    data = tmp_path / "d"
    srv = Server(data, "--segment-size", "65536").start()
    try:
        subscribe(srv, "keeper", "torn/#")
        bodies = [b"%05d-" % i + b"y" * 100 for i in range(COUNT)]
        publish(srv, TOPIC, bodies)
        offsets, got, kept = pull_to_end(srv, 0)
        assert offsets == list(range(COUNT)) and kept == COUNT
        assert drain(srv.port, "keeper", count=COUNT) == bodies
        time.sleep(1.0)  # the session's position is written every 0.5 s
        for round_ in range(2):
            srv.kill()
            tear_tail(data)
            if round_ == 1:
                shutil.rmtree(data / "index")  # derived data: rebuilt from the log
            srv.start()
            assert srv.wait_log("commitlog cut at offset", count=round_ + 1)
            assert srv.wait_log("resume at their high-water marks", count=round_ + 1)
            new = b"new-%d" % round_
            publish(srv, TOPIC, [new], client_id=f"pub-{round_}")
            offsets, got, nxt = pull_to_end(srv, kept)  # where the reader left off
            assert got == [new], (offsets, got, srv.logs()[-3000:])
            assert offsets[0] >= kept
            kept = nxt
            assert drain(srv.port, "keeper", idle_s=3.0, count=1) == [new]
            time.sleep(1.0)
        assert srv.stop() == 0
    finally:
        if srv.proc is not None:
            srv.kill()
