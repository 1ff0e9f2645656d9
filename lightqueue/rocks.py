"""RocksDB options with bounded memory, shared by the index and the metadata store.

Without these, memory grows with the data: memtables default to 64 MiB each and every
SST file's index and filter blocks stay in memory outside any cache."""

from __future__ import annotations

from rocksdict import BlockBasedOptions, Cache, Options


def bounded_options(write_buffer_mb: int, cache: Cache | None = None) -> Options:
    """Options with `write_buffer_mb` memtables (two at most) and SST blocks, index and
    filter blocks included, in `cache` (pass one Cache to share it across column
    families; by default a 32 MiB one of their own)."""
    opts = Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.set_write_buffer_size(write_buffer_mb * 1024 * 1024)
    opts.set_max_write_buffer_number(2)
    table = BlockBasedOptions()
    table.set_block_cache(cache if cache is not None else Cache(32 * 1024 * 1024))
    table.set_cache_index_and_filter_blocks(True)  # charged to the cache, not unbounded
    table.set_pin_l0_filter_and_index_blocks_in_cache(True)
    opts.set_block_based_table_factory(table)
    return opts
