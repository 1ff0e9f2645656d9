"""Damaged records in the log (store.damage): where readers go on after one, what is
kept aside, and what is found in the background. Real files, real RocksDB."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from store import record
from store.damage import DamagedRanges
from store.record import Message


def _append(log, topic: str, body: bytes) -> Message:
    return log.append([Message(topic, body)], [[topic]]).result(10)[0]


def _flip(log, at: int, mask: int = 0xFF) -> None:
    seg = max(b for b, _ in log.segments() if b <= at)
    path = log.dir / f"{seg:020d}"
    raw = bytearray(path.read_bytes())
    raw[at - seg] ^= mask
    path.write_bytes(bytes(raw))


def test_a_damaged_length_in_the_unindexed_tail_is_read_around_not_cut(logs) -> None:
    """With no index to ask (lost after a crash, rebuilt from the log), the next record
    after a damaged length is found by the records that follow it checking, and nothing
    after the damage is cut or lost."""
    log = logs.open()
    sent = [_append(log, "t/a", b"%03d" % i * 30) for i in range(40)]
    logs.crash(log)
    shutil.rmtree(log.index.path)
    _flip(log, sent[10].phys_offset + 5, 0x10)  # total_len: 1 MiB more
    log = logs.open()
    assert log.report.truncated_at is None and log.report.damaged == 1
    assert [m.body for m in log.scan(0)] == [m.body for m in sent if m is not sent[10]]
    assert [e.offset for e in log.index.read("t/a", 0, 100)] == \
        [i for i in range(40) if i != 10]  # its entry was never written: a gap
    assert log.damage.ranges()[0][:2] == (sent[10].phys_offset, sent[11].phys_offset)


def test_a_record_hidden_in_a_body_is_not_taken_for_the_next_one(logs) -> None:
    """A client may send a whole record as a message body. When the record holding it
    is damaged, the reader that looks for the next record meets the hidden one first:
    the index does not know it, so the search goes on to the real next record."""
    log = logs.open()
    hidden = record.encode(Message("secret/t", b"forged", store_ts=1,
                                   queues=[("secret/t", 0)]))
    before = _append(log, "t/a", b"a" * 50)
    carrier = _append(log, "t/a", b"<" + hidden + hidden + b">")
    after = _append(log, "t/a", b"z" * 50)
    logs.close(log)  # clean: the index covers all three
    log = logs.open()
    _flip(log, carrier.phys_offset + 1)  # its magic
    assert [m.body for m in log.scan(0)] == [before.body, after.body]
    assert log.damage.ranges()[0][:2] == (carrier.phys_offset, after.phys_offset)
    assert log.index.max_offset("secret/t") == 0


def test_older_segments_are_verified_in_the_background_at_a_bounded_rate(logs) -> None:
    log = logs.open(segment_size=4096)
    sent = [_append(log, "t/a", b"%03d" % i * 100) for i in range(60)]
    logs.close(log)
    _flip(log, sent[3].phys_offset + 200)  # in the first segment, which start-up skips
    log = logs.open(segment_size=4096, verify_bytes_per_s=1 << 20)
    assert log.report.verified_from > sent[3].phys_offset
    deadline = time.monotonic() + 10
    while log.stats["verify_pending_bytes"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert log.stats["verify_pending_bytes"] == 0 and log.stats["verified_bytes"] > 0
    assert log.damage.ranges() == [(sent[3].phys_offset, sent[4].phys_offset, "CRC mismatch")]
    assert (log.dir / "quarantine" / f"{sent[3].phys_offset:020d}.damaged").read_bytes() == \
        (log.dir / "00000000000000000000").read_bytes()[sent[3].phys_offset:sent[4].phys_offset]
    # Known from now on: listed in the file, found again by the next start.
    logs.close(log)
    log = logs.open(segment_size=4096, verify_bytes_per_s=0)
    assert log.damage.count == 1
    assert [m.body for m in log.scan(0)] == [m.body for m in sent if m is not sent[3]]


def test_damaged_ranges_merge_persist_and_go_with_retention_and_cuts(tmp_path: Path) -> None:
    ranges = DamagedRanges(tmp_path)
    assert ranges.add(100, 200, "CRC mismatch", b"x" * 100)
    assert not ranges.add(120, 180, "again", b"x" * 60)  # known already
    assert ranges.add(150, 260, "wider", b"x" * 110)  # overlaps: merged
    assert ranges.add(400, 450, "other", b"y" * 50)
    assert ranges.ranges() == [(100, 260, "wider"), (400, 450, "other")]
    assert ranges.containing(99) is None and ranges.containing(259) == (100, 260)
    again = DamagedRanges(tmp_path)
    again.load(0)
    assert again.ranges() == ranges.ranges()
    again.forget_below(300)
    again.forget_from(420)
    assert again.ranges() == [(400, 420, "other")] and again.bytes == 20
    assert sorted(p.name for p in (tmp_path / "quarantine").iterdir()) == [
        f"{start:020d}.damaged" for start in (100, 150, 400)]  # (the wider one's too)


def test_the_seek_by_time_and_the_log_walk_step_over_a_damaged_length(logs) -> None:
    """A history of a wide filter walks the log: a record's time and length are believed
    only once its CRC checks, so a damaged length neither sends the walk astray nor
    ends it early."""
    from lightqueue.since import TIME, Since
    from store.history import HistoryReader

    log = logs.open()
    sent = []
    for i in range(30):
        sent.append(_append(log, f"w/{i % 3}", b"%03d" % i * 20))
        time.sleep(0.002)  # each its own store time
    _flip(log, sent[10].phys_offset + 5, 0x10)  # total_len: 1 MiB more
    _flip(log, sent[20].phys_offset + 9)  # CRC: its time can't be believed either
    reader = HistoryReader(log, log.index, b"k" * 32)
    assert reader.position_at_time(sent[15].store_ts, log.max_offset) == sent[15].phys_offset
    assert reader.position_at_time(sent[20].store_ts, log.max_offset) == sent[21].phys_offset
    batch = reader.first("#", Since(TIME, sent[5].store_ts), None, log.max_offset,
                         100, 1 << 20, None)
    assert [m.body for m in batch.messages] == [m.body for m in sent[5:]
                                                if m not in (sent[10], sent[20])]
    assert batch.cursor is None
