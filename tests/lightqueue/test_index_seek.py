"""Seeking a light queue by store time and by log position: the binary search over runs
must give what a scan of every entry gives, across run edges, gaps (a repair's floor),
retention and empty queues."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from lightqueue.index import ConsumeQueueIndex
from tests.lightqueue.test_index_runs import Rec


@pytest.fixture
def idx(tmp_path: Path) -> ConsumeQueueIndex:
    i = ConsumeQueueIndex(tmp_path / "index")
    yield i
    i.close()


def fill(idx: ConsumeQueueIndex, rng: random.Random, batches: int, queue: str = "q"
         ) -> list[Rec]:
    """Append batches of 1..300 records (runs of those sizes), store times rising in
    steps of 0..3 ms (equal times are common: one batch shares one)."""
    pos, ts, recs = 0, 1_000, []
    for _ in range(batches):
        ts += rng.randrange(0, 4)
        batch = [Rec(pos + i * 50, 50, ts, queues=idx.assign([queue]))
                 for i in range(rng.randrange(1, 300))]
        pos += 50 * len(batch)
        idx.write_messages(batch, pos)
        recs.extend(batch)
    return recs


def scan_time(recs: list[Rec], ms: int, end: int) -> int:
    return next((r.queues[0][1] for r in recs if r.store_ts >= ms), end)


def scan_phys(recs: list[Rec], phys: int, end: int) -> int:
    return next((r.queues[0][1] for r in recs if r.phys_offset >= phys), end)


@pytest.mark.parametrize("seed", range(4))
def test_seek_matches_a_scan(idx: ConsumeQueueIndex, seed: int) -> None:
    rng = random.Random(seed)
    recs = fill(idx, rng, 60)
    end = idx.max_offset("q")
    times = sorted({r.store_ts for r in recs})
    probes = [0, times[0], times[-1], times[-1] + 1, *rng.sample(range(900, times[-1] + 5), 60)]
    for ms in probes:
        assert idx.offset_at_time("q", ms) == scan_time(recs, ms, end), ms
    for phys in [0, 1, 49, 50, 51, recs[-1].phys_offset, recs[-1].phys_offset + 1,
                 *rng.sample(range(0, recs[-1].phys_offset + 100), 60)]:
        assert idx.offset_at_position("q", phys) == scan_phys(recs, phys, end), phys


def test_gaps_retention_and_empty_queues(idx: ConsumeQueueIndex) -> None:
    rng = random.Random(7)
    recs = fill(idx, rng, 10)
    first_end = idx.max_offset("q")
    idx.set_floors({"q": first_end + 500})  # a repair left a gap of 500 offsets
    idx.forget_allocations()
    later = [Rec(10**7 + i * 50, 50, 10**6 + i, queues=idx.assign(["q"])) for i in range(40)]
    idx.write_messages(later, 10**7 + 2000)
    assert later[0].queues[0][1] == first_end + 500
    end = idx.max_offset("q")
    every = recs + later
    for ms in (999, recs[-1].store_ts, recs[-1].store_ts + 1, 10**6, 10**6 + 39, 10**6 + 40):
        assert idx.offset_at_time("q", ms) == scan_time(every, ms, end), ms
    assert idx.offset_at_position("q", recs[-1].phys_offset + 1) == first_end + 500
    # Retention took the first part: the search starts at what is kept.
    idx.delete_below({"q": first_end}, [])
    assert idx.offset_at_time("q", 0) == first_end + 500
    assert idx.entry_before("q", first_end + 500) is None
    assert idx.entry_before("q", first_end + 501)[3] == first_end + 500
    assert idx.entry_before("q", end)[3] == end - 1
    # A queue never written, and one whose entries are all gone: the end either way.
    assert idx.offset_at_time("nobody", 5) == 0
    idx.delete_below({"q": end}, [])
    assert idx.offset_at_time("q", 0) == end == idx.offset_at_position("q", 0)


def test_read_tuples_is_read(idx: ConsumeQueueIndex) -> None:
    recs = fill(idx, random.Random(3), 8)
    for start, n in ((0, 5), (3, 700), (len(recs) - 2, 10), (len(recs), 4), (120, 1)):
        assert idx.read_tuples("q", start, n) == [
            (e.phys_offset, e.size, e.store_ts, e.offset) for e in idx.read("q", start, n)]


def unpack_runs(runs: list[tuple[int, bytes]], start: int, n: int) -> list[tuple]:
    """Entries of raw runs from `start`, as read_tuples gives them, `n` at most."""
    out = []
    for first, entries in runs:
        for i in range(len(entries) // 20):
            if first + i >= start and len(out) < n:
                e = entries[i * 20:(i + 1) * 20]
                out.append((int.from_bytes(e[:8], "big"), int.from_bytes(e[8:12], "big"),
                            int.from_bytes(e[12:], "big"), first + i))
    return out


def test_raw_runs_are_read_tuples(idx: ConsumeQueueIndex) -> None:
    """What a native reader is handed decodes to exactly read_tuples, from any offset,
    across a repair's gap and retention; `full` says whether more may follow."""
    recs = fill(idx, random.Random(5), 8)
    first_end = idx.max_offset("q")
    idx.set_floors({"q": first_end + 100})
    idx.forget_allocations()
    later = [Rec(10**7 + i * 50, 50, 10**6 + i, queues=idx.assign(["q"])) for i in range(40)]
    idx.write_messages(later, 10**7 + 2000)
    end = idx.max_offset("q")

    def check() -> None:
        for start, n in ((0, 5), (3, 700), (len(recs) - 2, 10), (first_end, 4),
                         (first_end + 120, 1), (end, 4), (120, 1), (0, 10**6)):
            runs, full = idx.read_runs_raw("q", start, n)
            want = idx.read_tuples("q", start, n)
            assert unpack_runs(runs, start, n) == want, (start, n)
            assert full == (len(want) == n and bool(runs) and
                            len(unpack_runs(runs, start, 10**9)) >= n), (start, n)

    check()
    idx.delete_below({"q": first_end}, [])  # retention took the first part
    assert idx.read_runs_raw("q", 0, 10)[0][0][0] == first_end + 100
    check()
