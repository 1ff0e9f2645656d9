from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest

from lightqueue.index import ConsumeQueueIndex
from store import highwater
from store.commitlog import CommitLog
from store.record import Message


def append(log: CommitLog, topic: str, body: bytes, queues: list[str] | None = None) -> Message:
    return log.append([Message(topic, body, qos=1)], [queues or [topic]]).result(10)[0]


def queue_dump(index: ConsumeQueueIndex, names: list[str]) -> dict[str, list[tuple]]:
    return {
        q: [(e.offset, e.phys_offset, e.size, e.store_ts) for e in index.read(q, 0, 1_000_000)]
        for q in names
    }


@pytest.mark.parametrize("flush", ["sync", "async"])
def test_append_and_read_across_segment_rolls(logs, flush) -> None:
    log = logs.open(segment_size=4096, flush=flush)
    sent = [append(log, "a/b", os.urandom(300) + bytes([i]), ["a/b", "a/+"]) for i in range(100)]
    assert len(log.segments()) > 5
    for seg_base, seg_size in log.segments():
        assert seg_size <= 4096 and (log.dir / f"{seg_base:020d}").exists()
    for i, msg in enumerate(sent):
        assert msg.queues == [("a/b", i), ("a/+", i)]
        assert log.read(msg.phys_offset).body == msg.body
        assert log.read(msg.phys_offset, msg.size).body == msg.body
    entries = log.index.read("a/+", 0, 1000)
    assert [e.offset for e in entries] == list(range(100))
    assert [log.read(e.phys_offset, e.size).body for e in entries] == [m.body for m in sent]
    # A batch read of a range in the middle.
    assert [e.offset for e in log.index.read("a/b", 40, 5)] == [40, 41, 42, 43, 44]
    assert [m.body for m in log.scan(sent[10].phys_offset, sent[13].phys_offset)] == [
        m.body for m in sent[10:13]
    ]


def test_batched_append_is_one_write(logs) -> None:
    log = logs.open()
    msgs = [Message("t", b"x%d" % i) for i in range(500)]
    done = log.append(msgs, [["t"]] * 500).result(10)
    assert [m.offset_in("t") for m in done] == list(range(500))
    assert log.stats["batches"] == 1


@pytest.mark.parametrize("flush", ["sync", "async"])  # group commit; inline under a lock
def test_concurrent_appenders_get_unique_gap_free_offsets(logs, flush) -> None:
    log = logs.open(flush=flush, segment_size=256 * 1024)
    results: list[Message] = []
    lock = threading.Lock()

    def worker(n: int) -> None:
        for i in range(200):
            futs = [
                log.append([Message("s/x", b"%d-%d-%d" % (n, i, j))], [["s/x", "s/+", f"w/{n}"]])
                for j in range(3)
            ]
            got = [m for f in futs for m in f.result(10)]
            with lock:
                results.extend(got)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 * 600
    for q in ("s/x", "s/+"):
        offsets = sorted(m.offset_in(q) for m in results)
        assert offsets == list(range(len(results)))
    for n in range(8):
        mine = [m for m in results if m.body.startswith(b"%d-" % n)]
        assert sorted(m.offset_in(f"w/{n}") for m in mine) == list(range(600))
    # Offsets follow log order: a queue never goes backwards in the CommitLog.
    entries = log.index.read("s/x", 0, 10_000)
    assert [e.offset for e in entries] == list(range(len(results)))
    assert all(a.phys_offset < b.phys_offset for a, b in zip(entries, entries[1:], strict=False))
    for m in results[::97]:
        assert log.read(m.phys_offset, m.size).body == m.body
    if flush == "sync":
        assert log.stats["batches"] < len(results)  # group commit actually grouped


def test_offsets_continue_after_restart(logs) -> None:
    log = logs.open()
    for i in range(10):
        append(log, "r", b"%d" % i)
    logs.close(log)
    log = logs.open()
    assert append(log, "r", b"10").queues == [("r", 10)]
    assert append(log, "new", b"x").queues == [("new", 0)]


def _fill(log: CommitLog, n: int) -> list[Message]:
    return [append(log, "t/1", b"body-%05d" % i * 20, ["t/1", "t/#"]) for i in range(n)]


def test_recovery_cuts_a_torn_tail(logs) -> None:
    log = logs.open(segment_size=16 * 1024)
    sent = _fill(log, 200)
    last = sent[-1]
    logs.crash(log)
    seg_path = log.dir / f"{log.segments()[-1][0]:020d}"
    # Tear the last record in half, as a crash mid-write would.
    os.truncate(seg_path, last.phys_offset - log.segments()[-1][0] + last.size // 2)
    log = logs.open(segment_size=16 * 1024)
    rep = log.report
    assert not rep.clean_shutdown
    assert rep.truncated_at == last.phys_offset
    assert log.max_offset == last.phys_offset
    bodies = [m.body for m in log.scan(log.min_offset)]
    assert bodies == [m.body for m in sent[:-1]]
    assert [e.offset for e in log.index.read("t/#", 0, 1000)] == list(range(199))
    # The index had seen offset 199, so readers may have too: it is not given again.
    # Each queue resumes at its high-water mark (written before offsets reached it).
    ends = {q: log.index.max_offset(q) for q in ("t/1", "t/#")}
    assert 200 <= ends["t/#"] <= 200 + highwater.STEP_MAX and rep.marked_queues == 2
    assert append(log, "t/1", b"again", ["t/1", "t/#"]).queues == list(ends.items())


def test_recovery_reads_around_a_flipped_byte_and_quarantines_that_record_alone(logs) -> None:
    log = logs.open(segment_size=16 * 1024)
    sent = _fill(log, 200)
    logs.crash(log)
    victim = sent[150]
    seg_base = max(b for b, _ in log.segments() if b <= victim.phys_offset)
    with open(log.dir / f"{seg_base:020d}", "r+b") as fh:
        fh.seek(victim.phys_offset - seg_base + victim.size - 3)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0xFF]))
    log = logs.open(segment_size=16 * 1024, full_verify=True)
    rep = log.report
    assert rep.truncated_at is None and rep.damaged == 1
    others = [m.body for m in sent[:150] + sent[151:]]
    assert [m.body for m in log.scan(log.min_offset)] == others
    entries = log.index.read("t/1", 0, 1000)
    assert [e.offset for e in entries] == list(range(200))
    read = log.read_run([(e.phys_offset, e.size) for e in entries])
    assert [m.body for m in read if m is not None] == others and read[150] is None
    # Nothing is thrown away: the damaged record's bytes wait in quarantine.
    quarantined = list((log.dir / "quarantine").iterdir())
    assert [p.stat().st_size for p in quarantined] == [victim.size]
    assert log.damage.ranges() == [(victim.phys_offset, victim.phys_offset + victim.size,
                                    "CRC mismatch")]
    assert append(log, "t/1", b"more", ["t/1"]).queues == [("t/1", 200)]


def test_index_rebuild_after_deleting_rocksdb_gives_identical_queues(logs, tmp_path: Path) -> None:
    log = logs.open(segment_size=8 * 1024)
    for i in range(300):
        append(log, f"h/{i % 7}", b"x" * 50, [f"h/{i % 7}", "h/+", f"h#{i % 3}"])
    names = [f"h/{i}" for i in range(7)] + ["h/+", "h#0", "h#1", "h#2"]
    before = queue_dump(log.index, names)
    logs.close(log)
    shutil.rmtree(tmp_path / "index")
    log = logs.open(segment_size=8 * 1024)
    assert log.report.redispatched == 300
    assert queue_dump(log.index, names) == before
    assert append(log, "h/0", b"next", ["h/0"]).queues == [("h/0", len(before["h/0"]))]


def test_index_ahead_of_a_cut_log_is_rebuilt(logs) -> None:
    log = logs.open(segment_size=16 * 1024)
    sent = _fill(log, 50)
    logs.crash(log)
    seg_base = log.segments()[-1][0]
    os.truncate(log.dir / f"{seg_base:020d}", sent[40].phys_offset - seg_base)
    log = logs.open(segment_size=16 * 1024)
    assert log.report.index_rebuilt
    assert [e.offset for e in log.index.read("t/#", 0, 100)] == list(range(40))
    end = log.index.max_offset("t/1")
    assert 50 <= end <= 50 + highwater.STEP_MAX  # a gap: offsets 40..49 are not reused
    assert append(log, "t/1", b"new", ["t/1"]).queues == [("t/1", end)]


def test_missing_checkpoint_means_full_verification(logs) -> None:
    log = logs.open(segment_size=4096)
    _fill(log, 100)
    logs.close(log)
    (log.dir / "checkpoint").unlink()
    log = logs.open(segment_size=4096)
    assert log.report.verified_from == 0 and log.report.records_verified == 100


def test_retention_deletes_old_segments_and_their_index_entries(logs) -> None:
    log = logs.open(segment_size=4096)
    sent = [append(log, "ret/a", b"y" * 200, ["ret/a", "ret/+"]) for _ in range(100)]
    append(log, "ret/b", b"z", ["ret/b"])
    total = log.max_offset
    deleted = log.enforce_retention(retention_bytes=total // 2)
    assert deleted
    assert log.min_offset == log.segments()[0][0] > deleted[-1]
    assert log.max_offset - log.min_offset <= total // 2 + 4096
    first = log.index.read("ret/a", 0, 1)[0]
    assert first.phys_offset >= log.min_offset
    assert log.index.min_offset("ret/a") == first.offset > 0
    assert log.index.min_offset("ret/+") == first.offset
    assert log.index.max_offset("ret/a") == 100
    for base in deleted:
        assert not (log.dir / f"{base:020d}").exists()
    with pytest.raises(KeyError):
        log.read(sent[0].phys_offset)
    # Age-based: everything but the active segment is older than 0 hours.
    log.enforce_retention(retention_hours=0)
    assert len(log.segments()) == 1


def test_retention_waits_for_readers(logs) -> None:
    log = logs.open(segment_size=4096)
    for _ in range(50):
        append(log, "w", b"q" * 200)
    oldest = log._segments[0]
    assert oldest.acquire()  # a reader in the middle of a read
    log.enforce_retention(retention_hours=0)
    assert oldest.path.exists()  # still there for the reader
    assert log.min_offset > oldest.base  # but no new reader can find it
    oldest.release()
    assert not oldest.path.exists()


def test_a_forked_tail_cut_then_a_crash_restarts(logs) -> None:
    """A replica cuts a forked tail and copies the master's (differently sized) records
    past the cut; killed before the index flushed, it must still start: the index (no
    WAL) once came back with its pre-cut checkpoint, inside one of the new records."""
    log = logs.open()
    old = [append(log, "f/t", b"old-%d-" % i + b"x" * 300) for i in range(10)]
    log.index.flush()
    cut_at = old[5].phys_offset
    assert log.truncate_to(cut_at) == sum(m.size for m in old[5:])
    new = [append(log, "f/t", b"new-%d" % i) for i in range(5)]
    assert new[0].phys_offset == cut_at
    logs.crash(log)
    log = logs.open()
    bodies = [log.read(e.phys_offset, e.size).body for e in log.index.read("f/t", 0, 100)]
    assert bodies == [m.body for m in old[:5]] + [m.body for m in new]


def test_an_index_checkpoint_inside_a_record_rebuilds_the_index(logs) -> None:
    log = logs.open()
    sent = [append(log, "g/t", b"m-%d" % i + b"y" * 200) for i in range(6)]
    logs.close(log)
    index = ConsumeQueueIndex(logs.root / "index")
    index.write_messages([], sent[2].phys_offset + 7)  # not where a record starts
    index.close()
    log = logs.open()
    assert log.report.index_rebuilt
    bodies = [log.read(e.phys_offset, e.size).body for e in log.index.read("g/t", 0, 100)]
    assert bodies == [m.body for m in sent]


def test_a_replica_starts_over_at_its_masters_start(logs) -> None:
    """A replica behind its master's retention drops its log and starts over, empty, at
    the master's first offset, with the master's floors; a restart keeps it so."""
    log = logs.open(segment_size=4096)
    for i in range(30):
        append(log, "s/a", b"old-%d" % i + b"x" * 200)
    reader = log._segments[0]
    assert reader.acquire()  # a reader amid a read keeps its file until it is done
    start = log.max_offset + 10_000
    log.index.reset(start, {"s/a": 70, "s/b": 5}, 3)
    assert log.restart_at(start) > 30 * 200
    assert (log.min_offset, log.max_offset) == (start, start)
    assert [p.name for p in log.dir.iterdir() if p.name.isdigit()] == [f"{start:020d}"]
    assert not reader.path.exists() and len(reader.pread(100, 0)) == 100  # still readable
    reader.release()
    assert not reader.path.exists()
    assert log.index.read("s/a", 0, 100) == []
    assert [log.index.max_offset(q) for q in ("s/a", "s/b", "s/c")] == [70, 5, 3]
    msg = append(log, "s/a", b"after")  # the master's record would carry 70; ours too
    assert msg.phys_offset == start and msg.queues == [("s/a", 70)]
    logs.crash(log)
    log = logs.open(segment_size=4096)
    assert not log.report.index_rebuilt
    assert (log.min_offset, log.max_offset) == (start, msg.phys_offset + msg.size)
    assert [e.offset for e in log.index.read("s/a", 0, 100)] == [70]
    assert [log.index.max_offset(q) for q in ("s/b", "s/c")] == [5, 3]


def test_an_index_reset_then_a_crash_before_the_log_restarts(logs) -> None:
    """Killed between the index reset and the log's restart: the index is ahead of the
    log, recovery rebuilds it from the old log, the master's floors stay."""
    log = logs.open()
    sent = [append(log, "r/a", b"m-%d" % i) for i in range(5)]
    log.index.reset(log.max_offset + 1000, {"r/b": 9}, 0)
    logs.crash(log)
    log = logs.open()
    assert log.report.index_rebuilt
    assert [e.phys_offset for e in log.index.read("r/a", 0, 100)] == [m.phys_offset
                                                                      for m in sent]
    assert log.index.max_offset("r/b") == 9
    # The same cut short by a change of master, with no crash: the follower repairs it.
    log.index.reset(log.max_offset + 1000, {"r/c": 4}, 0)
    assert log.repair_index() and not log.repair_index()
    assert [e.phys_offset for e in log.index.read("r/a", 0, 100)] == [m.phys_offset
                                                                      for m in sent]
    assert log.index.max_offset("r/c") == 4
