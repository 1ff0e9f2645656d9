"""The consume-queue index keeps each append batch's entries of a queue as one run: reads,
ends, lookups, the tail walk and retention must see exactly the entries one key each
gave before, across runs, inside runs and at their edges."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from lightqueue import index as index_mod
from lightqueue.index import ENTRY, U64, ConsumeQueueIndex, queue_prefix


@dataclass
class Rec:
    phys_offset: int
    size: int
    store_ts: int = 7
    key: str = ""
    queues: list[tuple[str, int]] = field(default_factory=list)


def append(idx: ConsumeQueueIndex, pos: list[int], batch: list[list[str]],
           size: int = 100) -> list[Rec]:
    """One append batch: a record per entry of `batch`, each in those queues."""
    recs = []
    for queues in batch:
        recs.append(Rec(pos[0], size, queues=idx.assign(queues)))
        pos[0] += size
    idx.write_messages(recs, pos[0])
    return recs


@pytest.fixture
def idx(tmp_path: Path) -> ConsumeQueueIndex:
    i = ConsumeQueueIndex(tmp_path / "index")
    yield i
    i.close()


def offsets(idx: ConsumeQueueIndex, queue: str, start: int, n: int) -> list[int]:
    return [e.offset for e in idx.read(queue, start, n)]


def test_runs_read_like_single_entries(idx: ConsumeQueueIndex) -> None:
    pos = [0]
    all_recs = []
    for size in (3, 1, 5, 2):  # four batches, interleaving two topics of one first level
        all_recs += append(idx, pos, [["a/x", "a"] if i % 2 else ["a/y", "a"]
                                      for i in range(size)])
    a = [r for r in all_recs]
    assert offsets(idx, "a", 0, 100) == list(range(11))
    assert [e.phys_offset for e in idx.read("a", 0, 100)] == [r.phys_offset for r in a]
    assert offsets(idx, "a", 2, 3) == [2, 3, 4]  # from inside one run into the next
    assert offsets(idx, "a", 4, 100) == list(range(4, 11))
    assert offsets(idx, "a", 11, 10) == [] and offsets(idx, "a", 50, 10) == []
    assert offsets(idx, "a/x", 0, 100) == list(range(4))
    assert idx.min_offset("a") == 0 and idx.max_offset("a") == 11
    assert idx.max_offset("a/y") == 7 and idx.max_offset("nothing") == 0
    assert list(idx.queues()) == ["a", "a/x", "a/y"]
    for r in all_recs:
        assert idx.holds(r.phys_offset, r.queues, "")
        assert not idx.holds(r.phys_offset + 1, r.queues, "")
    assert not idx.holds(0, [("a", 11)], "")
    # A new index object (a restart) allocates from the last run's end.
    assert idx.assign(["a"]) == [("a", 11)]


def test_tail_start_walks_back_through_runs(idx: ConsumeQueueIndex) -> None:
    pos = [0]
    for size in (4, 4, 4):
        append(idx, pos, [["t"]] * size, size=10)
    assert idx.tail_start("t", 0, 1000) == 0  # all of it fits
    assert idx.tail_start("t", 0, 35) == 9  # the newest three: 9, 10, 11
    assert idx.tail_start("t", 0, 40) == 8
    assert idx.tail_start("t", 10, 35) == 10  # never below where the reader is
    assert idx.tail_start("t", 0, 5) == 12  # not even one: the end


def test_retention_keeps_the_rest_of_a_run_it_cuts(idx: ConsumeQueueIndex) -> None:
    pos = [0]
    recs = append(idx, pos, [["q"]] * 10) + append(idx, pos, [["q"]] * 10)
    idx.delete_below({"q": 14}, [])
    assert idx.min_offset("q") == 14
    assert offsets(idx, "q", 0, 100) == list(range(14, 20))
    assert [e.phys_offset for e in idx.read("q", 0, 3)] == [r.phys_offset for r in recs[14:17]]
    assert idx.holds(recs[15].phys_offset, recs[15].queues, "")
    assert not idx.holds(recs[3].phys_offset, recs[3].queues, "")
    idx.delete_below({"q": 10}, [])  # below what is left: nothing changes
    assert offsets(idx, "q", 0, 100) == list(range(14, 20))
    idx.delete_below({"q": 20}, [])
    assert offsets(idx, "q", 0, 100) == [] and idx.max_offset("q") == 20  # its floor


def test_a_full_run_or_a_gap_starts_a_new_one(idx: ConsumeQueueIndex,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(index_mod, "RUN_MAX", 3)
    pos = [0]
    append(idx, pos, [["q"]] * 7)
    recs = [Rec(pos[0], 100, queues=[("q", 20)]), Rec(pos[0] + 100, 100, queues=[("q", 21)])]
    idx.write_messages(recs, pos[0] + 200)  # past a floor: offsets jump
    keys = []
    it = idx._db.iter()
    it.seek(queue_prefix("q"))
    while it.valid() and it.key().startswith(queue_prefix("q")):
        keys.append((U64.unpack_from(it.key(), 3)[0], len(it.value()) // ENTRY.size))
        it.next()
    assert keys == [(0, 3), (3, 3), (6, 1), (20, 2)]
    assert offsets(idx, "q", 5, 100) == [5, 6, 20, 21]
    assert offsets(idx, "q", 7, 100) == [20, 21]


def test_an_index_of_single_entries_reads_as_runs_of_one(idx: ConsumeQueueIndex) -> None:
    """Indexes written before runs hold one entry per key: each is a run of one."""
    for off in range(5):
        idx._db.put(queue_prefix("old") + U64.pack(off), ENTRY.pack(off * 10, 10, 1))
    assert offsets(idx, "old", 2, 10) == [2, 3, 4]
    assert idx.max_offset("old") == 5
    assert idx.holds(30, [("old", 3)], "")
    pos = [50]
    append(idx, pos, [["old"]] * 2)
    assert offsets(idx, "old", 0, 10) == list(range(7))


def test_a_cut_tail_leaves_the_start_of_its_run(idx: ConsumeQueueIndex) -> None:
    """A replica whose log forked cuts its tail: entries from the cut on go, runs that
    hold the cut keep what came before it, and the next offsets follow what is left."""
    pos = [0]
    append(idx, pos, [["q", "p"]] * 4)
    tail = append(idx, pos, [["q"], ["q", "p"], ["q"]])
    idx.remove_entries([(q, off) for r in tail[1:] for q, off in r.queues], [],
                       tail[1].phys_offset)
    assert offsets(idx, "q", 0, 100) == [0, 1, 2, 3, 4]
    assert offsets(idx, "p", 0, 100) == [0, 1, 2, 3]
    assert idx.assign(["q", "p"]) == [("q", 5), ("p", 4)]
    assert idx.checkpoint() == tail[1].phys_offset
