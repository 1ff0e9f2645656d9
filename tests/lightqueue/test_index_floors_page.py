"""Floors in pages (a replica starting over copies its master's this way)."""

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
