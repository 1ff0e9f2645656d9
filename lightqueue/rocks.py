"""RocksDB options with bounded memory, shared by the index and the metadata store.

Without these, memory grows with the data: memtables default to 64 MiB each and every
SST file's index and filter blocks stay in memory outside any cache.

That bound is not yet what the process holds, as the soak test (tests/soak) measured:
a cache fills with blocks of deleted files (`uncache_obsolete_files`), and on glibc the
memtables and the freed space around long-lived blocks stay in the heap
(`keep_memtables_off_the_heap`, `trim_heap`)."""

from __future__ import annotations

import ctypes
import functools
import logging
import sys

from rocksdict import BlockBasedIndexType, BlockBasedOptions, Cache, Options, Rdict

log = logging.getLogger("lightgate.store.rocks")

# glibc <malloc.h>: mallopt parameter number of M_MMAP_THRESHOLD.
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 256 * 1024  # the metadata's 2 MiB memtables grow in 256 KiB blocks
HEAP_TRIM_INTERVAL_S = 10.0


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (mallopt and malloc_trim mean what we want)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it (not musl)
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    return libc


@functools.cache
def keep_memtables_off_the_heap() -> bool:
    """Fix glibc's mmap threshold at 256 KiB, once per process; True if it was set.

    RocksDB grows a memtable in arena blocks of write_buffer_size / 8 (2 MiB for the
    index, 256 KiB for the metadata) and frees them all when the memtable is flushed.
    glibc mmaps the first such blocks, but freeing an mmapped block raises its dynamic
    mmap threshold above that size, so from then on every block comes from the heap.
    There the holes a flushed memtable leaves are taken by small long-lived allocations
    (block cache entries, Python objects) and the next memtable extends the heap instead:
    in the soak test RSS rose by 100-180 MB/hour, the heap's free space growing from 5
    to 40 MB in ten minutes while the memory in use stayed flat. A fixed threshold keeps
    the blocks mmapped, so a flushed memtable goes back to the OS at once. Python's
    allocations above 256 KiB (a large commit batch) are mmapped too: a syscall beside
    the write of that size.
    """
    libc = _glibc()
    return bool(libc and libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def trim_heap() -> bool:
    """Give the free pages inside glibc's heaps back to the OS (malloc_trim(0)); False
    where there is no glibc to ask.

    free() only ever shrinks a heap from its top. The main thread's heap holds both
    Python's short-lived buffers (socket reads, joins) and RocksDB's long-lived blocks of
    the metadata, so it fills with free holes that stay resident: 30-60 MB/hour of RSS in
    the soak test even with the memtables mmapped. A trim every few seconds takes well
    under a millisecond and keeps those pages out of RSS (reused, they are faulted in
    again, zeroed)."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def bounded_options(write_buffer_mb: int, cache: Cache | None = None) -> Options:
    """Options with `write_buffer_mb` memtables (two at most) and SST blocks, index and
    filter blocks included, in `cache` (pass one Cache to share it across column
    families; by default a 32 MiB one of their own)."""
    keep_memtables_off_the_heap()
    opts = Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.set_write_buffer_size(write_buffer_mb * 1024 * 1024)
    opts.set_max_write_buffer_number(2)
    table = BlockBasedOptions()
    table.set_block_cache(cache if cache is not None else Cache(32 * 1024 * 1024))
    table.set_cache_index_and_filter_blocks(True)  # charged to the cache, not unbounded
    table.set_pin_l0_filter_and_index_blocks_in_cache(True)
    # A partitioned index: a file's index in 4 KiB blocks under a small top level, pinned.
    # One index block per file grows with the file (746 KB at 1M entries), more than a
    # shard of the block cache holds (capacity / 64), so it was read from the file again
    # for every new iterator and every get: 0.4 ms each, a queue's end 0.8 ms.
    table.set_index_type(BlockBasedIndexType.two_level_index_search())
    table.set_pin_top_level_index_and_filter(True)
    opts.set_block_based_table_factory(table)
    return opts


def uncache_obsolete_files(db: Rdict) -> None:
    """Erase a file's blocks from the block cache when compaction or retention makes the
    file obsolete (RocksDB's uncache_aggressiveness; set on `db`'s column family).

    By default they stay until the LRU pushes them out, so a cache fills to its capacity
    with blocks of files long deleted: in the soak test the index's cache grew by
    ~12 MB/hour, compaction after compaction, towards its 32 MiB, while what the reads
    need is well under a megabyte. 300 is the value RocksDB means to make its default."""
    try:
        db.set_options({"uncache_aggressiveness": "300"})
    except Exception as exc:  # a RocksDB older than 9.x: the LRU alone bounds the cache
        log.debug("uncache_aggressiveness not set: %s", exc)


# What `memory_usage` reads, by the name it reports each under.
_MEMORY_PROPERTIES = {
    "block_cache": "rocksdb.block-cache-usage",
    "block_cache_capacity": "rocksdb.block-cache-capacity",
    "memtables": "rocksdb.size-all-mem-tables",
    "table_readers": "rocksdb.estimate-table-readers-mem",
}


def memory_usage(db: Rdict) -> dict[str, int]:
    """What RocksDB holds in memory for `db` (one column family), in bytes: its block
    cache's usage and capacity (a cache shared by column families reports the same
    figures through each), its memtables, and index and filter blocks held outside the
    cache. A property this RocksDB does not know reads 0."""
    return {name: db.property_int_value(prop) or 0  # None: a property it does not know
            for name, prop in _MEMORY_PROPERTIES.items()}
