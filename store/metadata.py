"""Store metadata in RocksDB column families, updated key by key (never rewritten whole).

Unlike the consume-queue index, this is primary data: the WAL stays on, so a killed
process keeps every completed write.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rocksdict import Cache, Rdict, ReadOptions, WriteBatch, WriteBufferManager

from lightqueue.rocks import bounded_options, memory_usage, uncache_obsolete_files
from store.common import StoreFullError
from store.config import METADATA_CACHE_MB, METADATA_MEMTABLE_MB
from store.record import dumps_json as dumps
from store.record import loads_json as loads
from store.replication.space import no_space

COLUMN_FAMILIES = (
    "topics",  # first-level topic -> {"partitions": n}
    "groups",  # consumer group -> {...}
    "offsets",  # owner NUL ... NUL queue -> position; the queue is always the last part
    "sessions",  # MQTT client id -> session state
    "subscriptions",  # client id \0 filter -> options
    "retained",  # MQTT topic -> retained message
    "wildcards",  # registered wildcard filter -> {"since": ts}
    "inflight",  # client id \0 packet id -> QoS 2 / in-flight state
    "users",
    "acl",
    "producers",  # idempotent producers' ids (store.producer_ids)
)
# Memory bounds by default (the store's --metadata-cache-mb and --metadata-memtable-mb).
CACHE_MB, MEMTABLE_MB = METADATA_CACHE_MB, METADATA_MEMTABLE_MB


MetaOp = tuple[str, str, str, Any]  # ("put"|"delete"|"delete_prefix", cf, key, value)

log = logging.getLogger("lightgate.store.metadata")

FULL = "no space left on the store's disk"  # StoreFullError's text, as the CommitLog's
# Free bytes at which a metadata store stopped by a full disk is opened again.
ROOM_TO_REOPEN = 1 << 20


class Metadata:
    """Named column families of JSON values (bytes allowed inside, stored as base64).

    `on_change`, when set (a store group's master), hears every change as ops, after it
    is written: what replicas copy (store.replication.metalog). `on_copied`, when set
    (a store group's node), hears which column families a copy of the master's changes
    wrote (`apply`, `load_page`), from the thread that wrote them: what a replica keeps
    in memory from them (users, policies) is reloaded then."""

    on_change: Callable[[list[MetaOp]], None] | None = None
    on_copied: Callable[[set[str]], None] | None = None

    def __init__(self, path: str | Path, cache_mb: int = CACHE_MB,
                 memtable_mb: int = MEMTABLE_MB) -> None:
        self.path = Path(path)
        self._sizes = (cache_mb, memtable_mb)
        # A write met a full disk: RocksDB takes no write after a failed WAL append
        # (even once there is room) until it is opened again (`_room`).
        self._full = False
        self._reopening = threading.Lock()
        self._open()

    def _open(self) -> None:
        cache_mb, memtable_mb = self._sizes
        cache = Cache(cache_mb * 1024 * 1024)  # one cache for every column family
        cf_memtable_mb = max(1, memtable_mb // 2)
        opts = bounded_options(write_buffer_mb=cf_memtable_mb, cache=cache)
        opts.create_missing_column_families(True)
        # `memtable_mb` over all column families, not 2 MiB each: past it RocksDB
        # flushes the one holding the oldest data. Otherwise a column family written
        # slowly (offsets, sessions, subscriptions) fills its memtable for most of an
        # hour, a slow rise of RSS the soak test cannot tell from a leak (and its WAL
        # files stay until it is flushed).
        opts.set_write_buffer_manager(WriteBufferManager(memtable_mb * 1024 * 1024, False))
        self._db = Rdict(
            str(self.path), opts,
            column_families={cf: bounded_options(cf_memtable_mb, cache)
                             for cf in COLUMN_FAMILIES},
        )
        self._cfs = {cf: self._db.get_column_family(cf) for cf in COLUMN_FAMILIES}
        self._handles = {cf: self._db.get_column_family_handle(cf) for cf in COLUMN_FAMILIES}
        for db in (self._db, *self._cfs.values()):
            uncache_obsolete_files(db)

    # -- a full disk ---------------------------------------------------------------------
    def _room(self) -> None:
        """Before a write: StoreFullError while a full disk stopped the store's writes;
        once the disk has room again, the store is opened again and the write goes on."""
        if not self._full:
            return
        with self._reopening:
            if not self._full:
                return
            st = os.statvfs(self.path)
            if st.f_bavail * st.f_frsize < ROOM_TO_REOPEN:
                raise StoreFullError(FULL)
            self._close_db()
            try:
                self._open()
            except Exception as exc:  # the old instance not gone yet: the next write
                raise StoreFullError(f"{FULL} (metadata not open again yet: {exc})"
                                     ) from exc
            self._full = False
            log.warning("metadata writes resume: the store's disk has room again")

    def _failed(self, exc: Exception) -> None:
        """A write failed: on a full disk, StoreFullError (and writes are refused without
        asking RocksDB until the disk has room); anything else goes on as it is."""
        if not no_space(exc):
            return
        if not self._full:
            log.error("metadata writes refused: %s (sessions, offsets and in-flight "
                      "messages are not kept until it has %d KiB free)", FULL,
                      ROOM_TO_REOPEN >> 10)
        self._full = True
        raise StoreFullError(FULL) from exc

    def _close_db(self) -> None:
        self._cfs.clear()  # CF handles keep the DB open; drop them first
        self._handles.clear()
        try:
            self._db.close()
        except Exception:  # noqa: BLE001 - stopped by a full disk, it fails to flush
            if not self._full:
                raise

    def _cf(self, cf: str) -> Rdict:
        try:
            return self._cfs[cf]
        except KeyError:
            raise KeyError(f"unknown metadata column family {cf!r}") from None

    def get(self, cf: str, key: str, default: Any = None) -> Any:
        raw = self._cf(cf).get(key.encode())
        return default if raw is None else loads(raw)

    def put(self, cf: str, key: str, value: Any) -> None:
        self._room()
        try:
            self._cf(cf)[key.encode()] = dumps(value)
        except Exception as exc:
            self._failed(exc)
            raise
        if self.on_change is not None:
            self.on_change([("put", cf, key, value)])

    def delete(self, cf: str, key: str) -> None:
        self._room()
        try:
            del self._cf(cf)[key.encode()]
        except Exception as exc:
            self._failed(exc)
            raise
        if self.on_change is not None:
            self.on_change([("delete", cf, key, None)])

    def items(
        self, cf: str, prefix: str = "", limit: int | None = None
    ) -> Iterator[tuple[str, Any]]:
        """(key, value) pairs whose key starts with `prefix`, in key order."""
        ro = ReadOptions()
        raw_prefix = prefix.encode()
        if raw_prefix:
            ro.set_iterate_upper_bound(_prefix_end(raw_prefix))
        it = self._cf(cf).iter(ro)
        it.seek(raw_prefix)
        n = 0
        while it.valid() and (limit is None or n < limit):
            yield it.key().decode(), loads(it.value())
            n += 1
            it.next()

    def delete_prefix(self, cf: str, prefix: str) -> None:
        raw = prefix.encode()
        wb = WriteBatch(raw_mode=True)
        self._room()
        wb.delete_range(raw, _prefix_end(raw), self._handles[cf])
        try:
            self._db.write(wb)
        except Exception as exc:
            self._failed(exc)
            raise
        if self.on_change is not None:
            self.on_change([("delete_prefix", cf, prefix, None)])

    def apply(self, ops: Sequence[MetaOp]) -> None:
        """Apply ops atomically (a replica copying the master's changes)."""
        self.write(ops)
        self._copied({cf for _, cf, _, _ in ops})

    def write(self, ops: Sequence[MetaOp]) -> None:
        """Apply ("put"|"delete"|"delete_prefix", cf, key, value) ops atomically."""
        with self.batch() as batch:
            for op, cf, key, value in ops:
                if op == "put":
                    batch.put(cf, key, value)
                elif op == "delete":
                    batch.delete(cf, key)
                elif op == "delete_prefix":
                    batch.delete_prefix(cf, key)
                else:
                    raise ValueError(f"unknown metadata op {op!r}")

    def page(self, cursor: tuple[str, str] | None, max_bytes: int
             ) -> tuple[list[tuple[str, str, Any]], tuple[str, str] | None]:
        """A page of a snapshot of every column family, for a replica to copy: the
        (column family, key, value) items after `cursor` (the last column family and key
        sent; None: from the start), in column family then key order, until about
        `max_bytes` of keys and values, and the cursor after them (None: no more). Pages
        read at different times: the copier replays the changes since it began."""
        index, after = (0, b"") if cursor is None else (COLUMN_FAMILIES.index(cursor[0]),
                                                         cursor[1].encode())
        out: list[tuple[str, str, Any]] = []
        size = 0
        for cf in COLUMN_FAMILIES[index:]:
            it = self._cf(cf).iter(ReadOptions())
            it.seek(after)
            if after and it.valid() and it.key() == after:
                it.next()
            while it.valid():
                key, raw = it.key(), it.value()
                out.append((cf, key.decode(), loads(raw)))
                size += len(key) + len(raw)
                if size >= max_bytes:
                    return out, (cf, key.decode())
                it.next()
            after = b""
        return out, None

    def load_page(self, items: Sequence[Sequence[Any]], first: bool) -> None:
        """A page of another node's snapshot (see `page`), in one atomic batch; the first
        page replaces everything there was."""
        with self.batch() as batch:
            if first:
                for cf in COLUMN_FAMILIES:
                    batch.delete_prefix(cf, "")
            for cf, key, value in items:
                batch.put(cf, key, value)
        self._copied(set(COLUMN_FAMILIES) if first else {cf for cf, _, _ in items})

    def _copied(self, cfs: set[str]) -> None:
        if self.on_copied is not None and cfs:
            self.on_copied(cfs)

    def memory(self) -> dict[str, int]:
        """What RocksDB holds in memory over all column families (see
        rocks.memory_usage); they share one block cache, so that is counted once."""
        parts = [memory_usage(db) for db in (self._db, *self._cfs.values())]
        total = {k: sum(p[k] for p in parts) for k in ("memtables", "table_readers")}
        return {**total, "block_cache": parts[0]["block_cache"],
                "block_cache_capacity": parts[0]["block_cache_capacity"]}

    def batch(self) -> MetaBatch:
        self._room()  # (the batch takes the column families' handles of the open store)
        return MetaBatch(self)

    def close(self) -> None:
        self._close_db()


class MetaBatch:
    """Several puts/deletes applied atomically: `with meta.batch() as b: b.put(...)`."""

    def __init__(self, meta: Metadata) -> None:
        self._meta = meta
        self._wb = WriteBatch(raw_mode=True)
        self._ops: list[MetaOp] = []

    def put(self, cf: str, key: str, value: Any) -> None:
        self._wb.put(key.encode(), dumps(value), self._meta._handles[cf])
        self._ops.append(("put", cf, key, value))

    def delete(self, cf: str, key: str) -> None:
        self._wb.delete(key.encode(), self._meta._handles[cf])
        self._ops.append(("delete", cf, key, None))

    def delete_prefix(self, cf: str, prefix: str) -> None:
        raw = prefix.encode()
        self._wb.delete_range(raw, _prefix_end(raw), self._meta._handles[cf])
        self._ops.append(("delete_prefix", cf, prefix, None))

    def __enter__(self) -> MetaBatch:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None and not self._wb.is_empty():
            try:
                self._meta._db.write(self._wb)
            except Exception as exc:
                self._meta._failed(exc)
                raise
            if self._meta.on_change is not None:
                self._meta.on_change(self._ops)


def _prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key starting with `prefix`."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\xff" * (len(prefix) + 1)
    return stripped[:-1] + bytes([stripped[-1] + 1])
