"""Idempotent producers in the CommitLog (store.producers): a request's sequence is
checked inside the append; duplicates come back with their original offsets and are not
appended, gaps and replaced epochs are refused with nothing appended, and the sequences
are rebuilt from the records (a restart, a crash, a torn append, a replica's copy, a cut
log)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lightqueue.index import ConsumeQueueIndex
from store import record
from store.commitlog import PRODUCERS_FILE, CommitLog
from store.producers import KEEP, ProducerBudgetError, ProducerTable, SequenceError, Stamp
from store.record import MARK_FIRST, MARK_MORE, Message


def send(log: CommitLog, pid: str, seq: int, bodies: list[bytes], epoch: int = 0,
         topic: str = "t") -> list[Message]:
    msgs = [Message(topic, b) for b in bodies]
    return log.append(msgs, [[f"{topic}#0"]] * len(msgs),
                      Stamp(pid, topic, epoch, seq)).result(10)


def bodies(log: CommitLog, queue: str = "t#0") -> list[bytes]:
    return [log.read(e.phys_offset, e.size).body for e in log.index.read(queue, 0, 100_000)]


@pytest.mark.parametrize("flush", ["sync", "async"])
def test_a_duplicate_is_answered_with_its_offsets_and_not_appended(logs, flush) -> None:
    log = logs.open(flush=flush)
    first = send(log, "p1", 0, [b"a", b"b"])
    second = send(log, "p1", 2, [b"c"])
    again = send(log, "p1", 0, [b"a", b"b"])  # the first request, sent again
    assert [(m.phys_offset, m.queues) for m in again] == \
        [(m.phys_offset, m.queues) for m in first]
    assert send(log, "p1", 2, [b"c"])[0].phys_offset == second[0].phys_offset
    assert bodies(log) == [b"a", b"b", b"c"]
    # What a consumer reads: the store's own property is not among the message's.
    assert all(not m.properties for m in log.scan(0))


def test_gap_lower_epoch_and_overlap(logs) -> None:
    log = logs.open()
    send(log, "p1", 0, [b"a", b"b"])
    with pytest.raises(SequenceError, match="gap"):
        send(log, "p1", 5, [b"x"])
    with pytest.raises(SequenceError, match="first sequence is 0, not 3"):
        send(log, "p2", 3, [b"x"])  # a new producer starts at 0
    send(log, "p1", 0, [b"c"], epoch=4)  # a higher epoch starts again at 0
    with pytest.raises(SequenceError, match="older than its epoch 4"):
        send(log, "p1", 2, [b"x"], epoch=0)
    with pytest.raises(SequenceError, match="starts at sequence 0"):
        send(log, "p1", 1, [b"x"], epoch=5)
    # Overlapping the end: the stored head is a duplicate, the tail is appended.
    out = send(log, "p1", 0, [b"c", b"d", b"e"], epoch=4)
    assert [m.body for m in out] == [b"c", b"d", b"e"]
    assert bodies(log) == [b"a", b"b", b"c", b"d", b"e"]
    assert len(log.producers) == 1  # p2 was refused: nothing remembered of it


def test_duplicates_older_than_the_appends_kept_are_acknowledged_without_offsets(
        logs) -> None:
    log = logs.open()
    for i in range(KEEP + 2):
        send(log, "p", i, [b"%d" % i])
    old = send(log, "p", 0, [b"0"])
    assert old[0].phys_offset == -1 and old[0].queues == []
    assert len(bodies(log)) == KEEP + 2


def test_budget_refuses_new_sequences_not_known_ones(logs) -> None:
    log = logs.open(max_producers=2)
    send(log, "a", 0, [b"1"])
    send(log, "b", 0, [b"1"])
    with pytest.raises(ProducerBudgetError, match="--max-producers"):
        send(log, "c", 0, [b"1"])
    send(log, "a", 1, [b"2"])  # known ones go on
    assert bodies(log) == [b"1", b"1", b"2"]
    log.producers.expire(before_ms=1 << 62)  # idle: forgotten, room again
    send(log, "c", 0, [b"1"])


@pytest.mark.parametrize("clean", [True, False])
def test_sequences_survive_a_restart_and_a_crash(logs, clean) -> None:
    log = logs.open()
    send(log, "p", 0, [b"a", b"b"])
    send(log, "q", 0, [b"x"], topic="u")
    logs.close(log) if clean else logs.crash(log)
    log = logs.open()
    assert send(log, "p", 0, [b"a", b"b"])[1].body == b"b"  # a duplicate still
    send(log, "p", 2, [b"c"])
    with pytest.raises(SequenceError):
        send(log, "q", 3, [b"y"], topic="u")
    assert bodies(log) == [b"a", b"b", b"c"]


def test_rebuilt_from_the_log_alone_without_a_snapshot(logs) -> None:
    log = logs.open(segment_size=4096)
    for i in range(40):
        send(log, "p", i * 3, [os.urandom(200) for _ in range(3)])
    logs.close(log)
    (log.dir / PRODUCERS_FILE).unlink()
    log = logs.open(segment_size=4096)
    assert log.report.producer_records == 120
    with pytest.raises(SequenceError, match="stored up to sequence 119"):
        send(log, "p", 121, [b"x"])


def test_a_torn_append_counts_as_the_records_that_survived(logs) -> None:
    log = logs.open()
    send(log, "p", 0, [b"a"])
    out = send(log, "p", 1, [b"b" * 100, b"c" * 100, b"d" * 100])
    end = out[1].phys_offset + out[1].size + 10  # inside the third record
    logs.crash(log)
    seg = next(p for p in log.dir.iterdir() if p.name.isdigit())
    os.truncate(seg, end)
    (log.dir / PRODUCERS_FILE).unlink()
    log = logs.open()
    # b and c survived: the request sent again appends d alone.
    again = send(log, "p", 1, [b"b" * 100, b"c" * 100, b"d" * 100])
    assert [m.phys_offset for m in again[:2]] == [m.phys_offset for m in out[:2]]
    assert bodies(log) == [b"a", b"b" * 100, b"c" * 100, b"d" * 100]


def test_marks_and_the_stamp_in_the_records(logs) -> None:
    log = logs.open()
    send(log, "p", 0, [b"0"] * 7, epoch=2)
    out = send(log, "p", 7, [b"a", b"b", b"c"], epoch=2)
    raw, _ = log.read_raw(out[0].phys_offset, 1 << 20)
    msgs, pos = [], 0
    while pos < len(raw):
        msgs.append(record.decode(raw, pos, out[0].phys_offset + pos))
        pos += msgs[-1].size
    assert [m.mark for m in msgs] == [MARK_FIRST, MARK_MORE, MARK_MORE]
    assert msgs[0].producer == ["p", 2, 7] and msgs[0].properties == {}
    # A plain append of a message read from the log is not a producer's.
    plain = log.append([msgs[1]], [["t#0"]]).result(10)[0]
    assert log.read(plain.phys_offset).mark == 0


def test_a_replica_copying_the_records_has_the_same_sequences(tmp_path: Path) -> None:
    master = CommitLog(tmp_path / "m", ConsumeQueueIndex(tmp_path / "mi"))
    replica = CommitLog(tmp_path / "r", ConsumeQueueIndex(tmp_path / "ri"))
    master.open()
    replica.open()
    try:
        send(master, "p", 0, [b"a" * 500 for _ in range(10)])
        send(master, "p", 10, [b"b"])
        pos = 0
        while pos < master.max_offset:  # copied a little at a time: appends split
            data, base = master.read_raw(pos, 1200)
            replica.write_raw(pos, data, base)
            pos += len(data)
        assert replica.producers.snapshot()[0] == master.producers.snapshot()[0]
        assert send(replica, "p", 10, [b"b"])[0].phys_offset == \
            master.producers.snapshot()[0][("p", "t")][1][-1][3]
    finally:
        for log in (master, replica):
            log.close()
            log.index.close()


def test_a_cut_log_takes_its_sequences_back(logs) -> None:
    log = logs.open()
    send(log, "p", 0, [b"a"])
    cut_at = log.max_offset
    send(log, "p", 1, [b"b", b"c"])
    log.truncate_to(cut_at)
    assert send(log, "p", 1, [b"b", b"c"])[0].phys_offset == cut_at  # appended again
    assert bodies(log) == [b"a", b"b", b"c"]


def test_table_runs_and_snapshot_round_trip() -> None:
    from store.producers import dump, load

    t = ProducerTable()
    st = Stamp("p", "t", 0, 0)
    t.appended(st, 0, 3, 0, 300, 5)
    t.appended(st, 3, 2, 300, 500, 6)
    plan = t.plan(Stamp("p", "t", 0, 1), 4)
    assert plan.skip == 4 and plan.stored == [(0, 300, 1, 2), (300, 500, 0, 2)]
    copy = ProducerTable()
    assert load(copy, dump(500, t.snapshot())) == 500
    assert copy.snapshot()[0] == t.snapshot()[0]
    with pytest.raises(ValueError, match="not a producer snapshot"):
        load(copy, b'{"v": 1, "offset": -1, "entries": []}')
