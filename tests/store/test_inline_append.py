"""flush async appends inline, in the caller's thread (a hop to the writer thread per
append cost more than the write): the future is done when
`append` returns, the writer thread is only a flusher, and the flusher still keeps its
promise (fsync every flush interval, at once past flush_bytes) whatever rolls happen."""

from __future__ import annotations

import os
import threading
import time

from store.commitlog import CommitLog
from store.record import Message


def wait_flushed(log: CommitLog, timeout: float = 5.0) -> float:
    """Seconds until everything written is fsync'd (fails after `timeout`)."""
    t0 = time.monotonic()
    while log.flushed_offset < log.max_offset:
        assert time.monotonic() - t0 < timeout, (log.flushed_offset, log.max_offset)
        time.sleep(0.005)
    return time.monotonic() - t0


def test_async_append_is_done_on_return_and_runs_in_the_callers_thread(logs) -> None:
    seen: list[int] = []
    log = logs.open(flush="async", flush_interval_ms=50)
    log.on_dispatched = lambda msgs: seen.append(threading.get_ident())
    fut = log.append([Message("a/b", b"x")], [["a/b"]])
    assert fut.done()
    assert fut.result()[0].offset_in("a/b") == 0
    assert seen == [threading.get_ident()]
    assert [e.offset for e in log.index.read("a/b", 0, 10)] == [0]  # dispatched already


def test_sync_appends_still_go_through_the_writer_thread(logs) -> None:
    seen: list[int] = []
    log = logs.open(flush="sync")
    log.on_dispatched = lambda msgs: seen.append(threading.get_ident())
    log.append([Message("a/b", b"x")], [["a/b"]]).result(10)
    assert seen and seen[0] != threading.get_ident()
    assert log.flushed_offset == log.max_offset


def test_the_flusher_syncs_within_the_interval(logs) -> None:
    log = logs.open(flush="async", flush_interval_ms=50)
    for round_ in range(3):  # each time the log goes from clean to dirty
        log.append([Message("t", b"%d" % round_)], [["t"]])
        assert log.flushed_offset < log.max_offset
        assert wait_flushed(log) < 2.0
    assert log.stats["fsyncs"] >= 3


def test_the_flusher_syncs_after_a_roll(logs) -> None:
    """A roll marks the log clean up to the old segment's end; what the same write puts in
    the new segment must still reach the flusher."""
    log = logs.open(flush="async", flush_interval_ms=50, segment_size=4096)
    bodies = [os.urandom(1000) for _ in range(12)]
    log.append([Message("t", b) for b in bodies], [["t"]] * len(bodies))
    assert len(log.segments()) > 1
    wait_flushed(log)
    log.append([Message("t", os.urandom(3000)) for _ in range(3)], [["t"]] * 3)
    wait_flushed(log)


def test_past_flush_bytes_the_flusher_does_not_wait_for_the_interval(logs) -> None:
    log = logs.open(flush="async", flush_interval_ms=60_000, flush_bytes=64 * 1024,
                    segment_size=1 << 20)  # no roll (a roll fsyncs by itself)
    log.append([Message("t", b"small")], [["t"]])
    time.sleep(0.2)
    assert log.flushed_offset < log.max_offset  # the interval is a minute away
    log.append([Message("t", os.urandom(8192)) for _ in range(10)], [["t"]] * 10)
    assert wait_flushed(log, timeout=5.0) < 5.0


def test_read_run_reads_adjacent_records_once_and_skips_what_is_gone(logs) -> None:
    log = logs.open(flush="async", segment_size=4096)
    sent = log.append([Message("r", os.urandom(500) + bytes([i])) for i in range(20)],
                      [["r"]] * 20).result()
    assert len(log.segments()) > 1  # runs are cut at segment ends
    positions = [(m.phys_offset, m.size) for m in sent]
    assert [m.body for m in log.read_run(positions)] == [m.body for m in sent]
    gaps = positions[::3]  # not adjacent: one read each
    assert [m.body for m in log.read_run(gaps)] == [m.body for m in sent[::3]]
    removed = log.enforce_retention(retention_bytes=4096)
    assert removed
    got = log.read_run(positions)
    assert got[0] is None
    assert [m.body for m in got if m is not None] == [m.body for m in sent
                                                      if m.phys_offset >= log.min_offset]
