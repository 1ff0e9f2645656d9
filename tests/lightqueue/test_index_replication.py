"""Index reads a store group needs: floors in pages (a replica starting over copies its
master's this way) and the end of what lies within a log offset."""

from __future__ import annotations

from pathlib import Path

from lightqueue.index import ConsumeQueueIndex


def test_floors_come_in_pages_in_name_order(tmp_path: Path) -> None:
    index = ConsumeQueueIndex(tmp_path / "i")
    try:
        want = {f"q/{i:03d}": i * 10 for i in range(25)}
        index.set_floors(want)
        got: dict[str, int] = {}
        after, pages = None, 0
        while True:
            page, after = index.floors_page(after, 7)
            got.update(page)
            pages += 1
            if after is None:
                break
        assert got == want == index.floors() and pages == 4
        assert index.floors_page("q/024", 7) == ({}, None)
        index.reset(500, {"q/x": 3}, 2)  # the first page of a replica starting over
        index.set_floors({"q/y": 4})  # the next one
        assert index.floors() == {"q/x": 3, "q/y": 4} and index.checkpoint() == 500
        assert index.max_offset("q/000") == 2  # no floor of its own: the default
    finally:
        index.close()


def test_the_end_within_a_log_offset(tmp_path: Path) -> None:
    """end_within: the end of what lies at or before a log offset (the acknowledged
    part), across runs; everything past it: the queue's first offset."""
    from dataclasses import dataclass

    @dataclass
    class Rec:
        phys_offset: int
        size: int
        queues: list
        store_ts: int = 0
        key: str = ""

    index = ConsumeQueueIndex(tmp_path / "i")
    try:
        # three batches (three runs) of 10 records of 100 bytes each, offsets 0..29
        for batch in range(3):
            index.write_messages([Rec(1000 * batch + 100 * i, 100, [("q", 10 * batch + i)])
                                  for i in range(10)], 1000 * (batch + 1))
        assert index.max_offset("q") == 30
        assert index.end_within("q", 10**9) == 30
        assert index.end_within("q", 2000 + 500) == 25  # records 20..24 end by 2500
        assert index.end_within("q", 2000 + 450) == 24  # record 24 ends at 2500: not in
        assert index.end_within("q", 2000) == 20  # the middle run whole
        assert index.end_within("q", 1999) == 19  # its last record ends at 2000
        assert index.end_within("q", 100) == 1
        assert index.end_within("q", 50) == 0
        assert index.end_within("none", 50) == 0
    finally:
        index.close()
