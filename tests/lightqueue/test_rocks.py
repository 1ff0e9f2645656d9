"""The memory settings of lightqueue.rocks reach RocksDB and glibc (the soak test measures
what they do over time; these check they are in effect)."""

from __future__ import annotations

import platform
import time
from pathlib import Path

import pytest

from lightqueue.index import ConsumeQueueIndex
from lightqueue.rocks import keep_memtables_off_the_heap, trim_heap
from store.metadata import Metadata

GLIBC = platform.libc_ver()[0] == "glibc"


def newest_options(db_dir: Path) -> str:
    return max(db_dir.glob("OPTIONS-*"), key=lambda p: int(p.name.split("-")[1])).read_text()


def test_the_index_uncaches_blocks_of_deleted_files(tmp_path: Path) -> None:
    index = ConsumeQueueIndex(tmp_path / "index")
    try:
        opts = newest_options(tmp_path / "index")
        assert "uncache_aggressiveness=300" in opts
        assert "write_buffer_size=16777216" in opts
    finally:
        index.close()


def test_the_metadata_bounds_memtables_over_all_column_families(tmp_path: Path) -> None:
    """1.5 MB in each of three column families is under each one's 2 MiB memtable, but
    over the 4 MiB they share: RocksDB flushes one of them instead of holding 4.5 MB."""
    meta = Metadata(tmp_path / "meta")
    try:
        for cf in ("offsets", "sessions", "subscriptions"):
            for i in range(1500):
                meta.put(cf, f"k{i:06d}", {"v": "x" * 1000})
        deadline = time.monotonic() + 10
        while not list((tmp_path / "meta").glob("*.sst")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list((tmp_path / "meta").glob("*.sst")), "nothing flushed: memtables unbounded"
        opts = newest_options(tmp_path / "meta")
        # every column family: [CFOptions "sessions"] ... uncache_aggressiveness=300
        assert opts.count("uncache_aggressiveness=300") == opts.count("[CFOptions ")
    finally:
        meta.close()


@pytest.mark.skipif(not GLIBC, reason="mallopt and malloc_trim are glibc's")
def test_glibc_is_asked_to_keep_arenas_mmapped_and_to_trim() -> None:
    assert keep_memtables_off_the_heap()
    assert trim_heap()
