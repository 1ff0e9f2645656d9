"""The index's memory bounds by default (the store's --index-cache-mb and
--index-memtable-mb): block cache, index and filter blocks included, and each of the (at
most two) memtables. Apart from the index, so that settings name them without loading
RocksDB."""

CACHE_MB = 32
MEMTABLE_MB = 16
