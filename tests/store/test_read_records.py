"""Records handed out as the log holds them (CommitLog.read_records, PULL `raw`): runs
of records back to back, each CRC checked, none decoded; what a reader decodes from
them equals what the decoded read gives."""

from __future__ import annotations

import os

import pytest

from store import record
from store.commitlog import CommitLog
from store.record import CorruptRecord, Message


def fill(log: CommitLog) -> list[Message]:
    """Two queues interleaved: q's records lie back to back in bursts."""
    out = []
    for burst in range(6):
        out += log.append([Message("a/q", b"q%d-%d" % (burst, i)) for i in range(5)],
                          [["q"]] * 5).result(10)
        log.append([Message("a/r", b"r%d" % burst)], [["r"]]).result(10)
    return out


def decode_all(runs: list[list[int]], data: bytes) -> list[tuple[int, int, bytes]]:
    out, pos = [], 0
    for phys, _, first, count in runs:
        for i in range(count):
            m = record.decode(data, pos, phys)
            assert record.peek_topic(data, pos) == (m.topic, m.size)
            out.append((first + i, m.phys_offset, m.body))
            pos += m.size
            phys += m.size
    assert pos == len(data)
    return out


def test_runs_are_the_bursts_and_decode_as_the_log_holds_them(logs) -> None:
    log = logs.open()
    sent = fill(log)
    entries = log.index.read_tuples("q", 0, 100)
    runs, data, looked = log.read_records(entries, 1 << 20)
    assert looked == len(entries) == 30
    assert [r[3] for r in runs] == [5] * 6 and [r[2] for r in runs] == list(range(0, 30, 5))
    assert decode_all(runs, data) == [(i, m.phys_offset, m.body) for i, m in enumerate(sent)]
    # A byte budget cuts the answer short (one record at least).
    runs, _, looked = log.read_records(entries, 1)
    assert runs == [[sent[0].phys_offset, sent[0].size, 0, 1]] and looked == 1


def test_a_damaged_record_is_left_out_not_handed_out(logs) -> None:
    """The records around it are: its run is split in two; it is counted and listed."""
    log = logs.open()
    sent = fill(log)
    seg = next(p for p in log.dir.iterdir() if p.name.isdigit())
    with open(seg, "r+b") as f:  # flip a byte of the seventh record's body
        f.seek(sent[7].phys_offset + sent[7].size - 10)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    entries = log.index.read_tuples("q", 0, 100)
    runs, data, looked = log.read_records(entries, 1 << 20)
    assert looked == 30
    assert [(r[2], r[3]) for r in runs[:3]] == [(0, 5), (5, 2), (8, 2)]
    assert [o for o, _, _ in decode_all(runs, data)] == [i for i in range(30) if i != 7]
    assert log.stats["corrupt_reads"] == 1
    assert log.damage.ranges() == [(sent[7].phys_offset, sent[7].phys_offset + sent[7].size,
                                    "CRC mismatch")]
    with pytest.raises(CorruptRecord):  # and by its id
        log.read(sent[7].phys_offset)
