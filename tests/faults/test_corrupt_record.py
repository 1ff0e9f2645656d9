"""Records damaged in an old segment while the node was down (one byte of a body, one
byte of a length): every reader reads around them (PULL decoded and raw, history by
queue and by scanning the log, a persistent MQTT subscriber) and gets every other
record; the damage is found in the background, counted and kept aside, and a full
verification at the next start takes the damaged records alone out of service."""

from __future__ import annotations

from pathlib import Path

import pytest

from store import record
from tests.conftest import Server
from tests.faults.damage import (
    PLANES,
    flip,
    history,
    http_json,
    publish,
    pull_all,
    records,
    segments,
    subscribe,
    use_plane,
)
from tests.faults.hostile import metric, metrics
from tests.faults.persistent import drain

COUNT = 1500
TOPIC = "dmg/t"
BAD_BODY, BAD_LENGTH = 5, 20  # records of the first segment to damage


def damage_first_segment(data: Path) -> list[int]:
    """Flip a byte of one message's body and the top byte of another's record length,
    in the first of the segments; their queue offsets (one message per record)."""
    first = segments(data)[0]
    raw = first.read_bytes()
    where = {record.decode(raw, pos).body[:6]: (pos, size) for pos, size in records(first)}
    pos, size = where[b"%05d-" % BAD_BODY]
    flip(first, pos + size // 2)  # inside the body: the CRC fails
    pos, _ = where[b"%05d-" % BAD_LENGTH]
    flip(first, pos + 4, 0x40)  # total_len: the record seems 1 GiB long
    return [BAD_BODY, BAD_LENGTH]


@pytest.mark.parametrize("plane_name", PLANES)
def test_readers_read_around_corrupt_records(tmp_path: Path, plane_name: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    use_plane(plane_name, monkeypatch)
    data = tmp_path / "d"
    srv = Server(data, "--segment-size", "32768").start()
    try:
        subscribe(srv, "keeper", TOPIC)
        bodies = [b"%05d-" % i + b"x" * 180 for i in range(COUNT)]
        publish(srv, TOPIC, bodies)
        assert srv.stop() == 0  # clean: the next start verifies the last segment only
        assert len(segments(data)) >= 8
        bad = damage_first_segment(data)
        good = [b for i, b in enumerate(bodies) if i not in bad]
        srv.start()

        # A PULL across the damage answers with the records around it.
        offsets, got = pull_all(srv, TOPIC)
        assert got == good
        assert offsets == [i for i in range(COUNT) if i not in bad]
        offsets, got = pull_all(srv, TOPIC, raw=True)  # the Spark source's reads
        assert got == good
        assert offsets == [i for i in range(COUNT) if i not in bad]
        # History by the topic's queue, and by scanning the log ('#').
        assert history(srv, TOPIC) == good
        assert history(srv, "#") == good
        # The persistent subscriber gets everything else, in order, on one connection.
        assert drain(srv.port, "keeper", idle_s=5.0, count=len(good)) == good

        # Found in the background as well, counted, and its bytes kept aside.
        assert srv.wait_log("background verification of the log done", timeout=20)
        text = metrics(srv)
        assert metric(text, "lightgate_commitlog_corrupt_reads_total") >= 2
        assert metric(text, "lightgate_commitlog_damaged_records") == 2
        stats = http_json(srv, "/api/v1/store/stats")["commitlog"]
        assert stats["damaged_records"] == 2
        quarantine = sorted((data / "commitlog" / "quarantine").iterdir())
        assert len(quarantine) == 2, quarantine
        srv.kill()

        # A full verification takes the two records out of service, nothing else.
        before = [p.name for p in segments(data)]
        srv.extra = ["--segment-size", "32768", "--full-verify"]
        srv.start()
        assert [p.name for p in segments(data)] == before
        publish(srv, TOPIC, [b"after"], client_id="pub2")
        offsets, got = pull_all(srv, TOPIC)
        assert got == [*good, b"after"]
        assert offsets[-1] == COUNT
        assert srv.stop() == 0
    finally:
        if srv.proc is not None:
            srv.kill()
