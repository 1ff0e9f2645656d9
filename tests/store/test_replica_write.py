"""A replica's copy of the master's bytes (CommitLog.write_raw) takes the same write path
as the master's appends: a write that fails part way leaves the log as it was, and
enough dirty bytes wake the flusher at once."""

from __future__ import annotations

import errno
import time
from pathlib import Path

import pytest

from lightqueue.index import ConsumeQueueIndex
from store.commitlog import CommitLog
from store.record import Message
from tests.conftest import free_bytes

RECORDS = 12
BODY = 3000  # a record a little under a page: 12 of them span about 9 pages


def _open(log_dir: Path, index_dir: Path, **kw: object) -> CommitLog:
    log = CommitLog(log_dir, ConsumeQueueIndex(index_dir), **kw)
    log.open()
    return log


def _close(log: CommitLog) -> None:
    log.close()
    log.index.close()


def _master_records(root: Path) -> tuple[list[Message], bytes]:
    """RECORDS messages appended to a real master log, and its bytes as a replica
    copies them (read_raw)."""
    master = _open(root / "master", root / "master-index")
    try:
        sent = [master.append([Message("r/t", bytes([i]) * BODY)], [["r/t"]]).result(10)[0]
                for i in range(RECORDS)]
        data, base = master.read_raw(0, 1 << 20)
        assert base == 0 and len(data) == master.max_offset
        return sent, data
    finally:
        _close(master)


def test_a_raw_write_that_fails_part_way_leaves_the_log_as_it_was(
        tmp_path: Path, small_fs: Path) -> None:
    sent, data = _master_records(tmp_path)
    # The replica's log on a small filesystem, its index elsewhere (only the log fills).
    replica = _open(small_fs / "log", tmp_path / "replica-index")
    try:
        first = sent[2].phys_offset  # a record boundary
        replica.write_raw(0, data[:first], 0)
        segment = small_fs / "log" / f"{0:020d}"
        filler = small_fs / "filler"
        # Room for about two pages of the rest: the kernel writes those, then ENOSPC.
        filler.write_bytes(b"\0" * (free_bytes(small_fs) - 2 * 4096))
        with pytest.raises(OSError) as info:
            replica.write_raw(first, data[first:], 0)
        assert info.value.errno == errno.ENOSPC
        assert replica.max_offset == first
        assert segment.stat().st_size == first  # no bytes left past the log's end
        filler.unlink()  # space is back: the same copy again lands where it belongs
        copied = replica.write_raw(first, data[first:], 0)
        assert [m.phys_offset for m in copied] == [m.phys_offset for m in sent[2:]]
        assert replica.max_offset == len(data) == segment.stat().st_size
        for m in sent:
            assert replica.read(m.phys_offset).body == m.body
    finally:
        (small_fs / "filler").unlink(missing_ok=True)  # else closing cannot checkpoint
        _close(replica)
    # Recovery finds every record whole: nothing to cut.
    replica = _open(small_fs / "log", tmp_path / "replica-index")
    try:
        assert replica.max_offset == len(data)
        assert [m.body for m in replica.scan(0)] == [m.body for m in sent]
    finally:
        _close(replica)


def test_a_raw_write_that_makes_enough_bytes_dirty_wakes_the_flusher(tmp_path: Path) -> None:
    sent, data = _master_records(tmp_path)
    # An interval longer than the test: only --flush-bytes can start an fsync in time.
    replica = _open(tmp_path / "log", tmp_path / "replica-index", flush="async",
                    flush_interval_ms=600_000, flush_bytes=16 * 1024)
    try:
        first = sent[1].phys_offset  # a record boundary
        replica.write_raw(0, data[:first], 0)  # dirty, well under flush_bytes
        time.sleep(0.3)  # the flusher takes that wake-up and waits out the interval
        assert replica.flushed_offset == 0
        replica.write_raw(first, data[first:], 0)  # now past flush_bytes
        deadline = time.monotonic() + 5
        while replica.flushed_offset < len(data) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert replica.flushed_offset == len(data)
    finally:
        _close(replica)


def test_a_raw_write_rolls_where_the_master_rolled_and_a_failed_one_is_undone(
        tmp_path: Path, small_fs: Path) -> None:
    sent, data = _master_records(tmp_path)
    replica = _open(small_fs / "log", tmp_path / "replica-index")
    try:
        first = sent[3].phys_offset  # a record boundary
        replica.write_raw(0, data[:first], 0)
        filler = small_fs / "filler"
        filler.write_bytes(b"\0" * (free_bytes(small_fs) - 4096))
        # The master's next segment starts at `first`: the replica rolls, then fails.
        with pytest.raises(OSError):
            replica.write_raw(first, data[first:], first)
        assert replica.segments() == [(0, first)]
        assert sorted(p.name for p in (small_fs / "log").iterdir() if p.name.isdigit()) \
            == [f"{0:020d}"]
        filler.unlink()
        replica.write_raw(first, data[first:], first)
        assert replica.segments() == [(0, first), (first, len(data) - first)]
        assert [replica.read(m.phys_offset).body for m in sent] == [m.body for m in sent]
    finally:
        (small_fs / "filler").unlink(missing_ok=True)
        _close(replica)
