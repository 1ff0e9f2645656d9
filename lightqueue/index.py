"""Consume-queue index of the light queues, in RocksDB (WAL off: the CommitLog is the log).

Everything lives in ONE column family on purpose: with the WAL disabled, RocksDB only
guarantees that what survives a crash is a prefix of the writes within a column family,
so the checkpoint record and the entries it covers must share one.

Keys:
    b"q" + queue name + b"\\0" + offset (u64 BE) -> a run: the entries of consecutive
        offsets from that one on, each phys offset u64 | size u32 | store_ts u64
        (20 bytes). One append batch writes one run per queue: a put per queue and batch,
        not per message and queue (the memtable insert was the append path's largest
        cost). A single entry is a run of one, so indexes written before runs read as is.
    b"k" + message key + b"\\0" + phys offset (u64 BE) -> b""      (lookup by key)
    b"\\0checkpoint" -> end CommitLog offset covered by the index (u64 BE)
    b"f" + queue name -> the queue's lowest next offset: its end when retention removed
        its entries, or past what readers saw after a repair cut the log (u64 BE)
    b"\\0floor" -> the lowest next offset of a queue with neither entries nor a floor of
        its own, set when the index was rebuilt without them (see `set_default_floor`)
Queue names are MQTT topic names/filters, which never contain U+0000, so prefixes are exact.
"""

from __future__ import annotations

import shutil
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from rocksdict import Cache, Rdict, ReadOptions, WriteBatch, WriteOptions

from lightqueue.rocks import bounded_options, memory_usage, uncache_obsolete_files
from lightqueue.sizes import CACHE_MB, MEMTABLE_MB

ENTRY = struct.Struct(">QIQ")
U64 = struct.Struct(">Q")
CHECKPOINT_KEY = b"\x00checkpoint"
DEFAULT_FLOOR_KEY = b"\x00floor"
FLOOR = b"f"  # b"f" + queue name -> lowest offset the queue may hand out next
_MAX_U64 = b"\xff" * 8
_MAX_KEY = b"\xff"  # above every key (they start with b"\x00", b"f", b"k" or b"q")
RUN_MAX = 4096  # entries in one run at most (80 KiB): a read of one offset stays small
_PHYS_AT, _TS_AT = 0, 12  # where an entry's phys offset and store time sit in its bytes


class StoredRecord(Protocol):
    """What the index needs of a stored message (the store's Message)."""

    phys_offset: int
    size: int
    store_ts: int
    key: str
    queues: list[tuple[str, int]]


class PackedBatch(Protocol):
    """The index entries of a native dispatch (serving.lightgate_native's DispatchBatch),
    keyed and packed as `write_messages` would."""

    def put_index(self, put: Callable[[bytes, bytes], None]) -> int:
        """`put(key, value)` each entry; how many."""
        ...


# (phys offset, size, store time, queue offset): `read_tuples`, for readers of millions
Entry = tuple[int, int, int, int]


@dataclass(frozen=True, slots=True)
class IndexEntry:
    offset: int
    phys_offset: int
    size: int
    store_ts: int


def queue_prefix(queue: str) -> bytes:
    return b"q" + queue.encode() + b"\x00"


def key_prefix(key: str) -> bytes:
    return b"k" + key.encode() + b"\x00"


class ConsumeQueueIndex:
    """Light-queue entries and per-queue offset allocation on one node."""

    def __init__(self, path: str | Path, cache_mb: int = CACHE_MB,
                 memtable_mb: int = MEMTABLE_MB) -> None:
        self.path = Path(path)
        self._sizes = (cache_mb, memtable_mb)
        self._db = self._open(self.path, *self._sizes)
        self._no_wal = WriteOptions()
        self._no_wal.disable_wal = True
        # Next offset of every queue touched since start. Owned by the single writer
        # thread; filled lazily from RocksDB (one seek, never a scan).
        self._next: dict[str, int] = {}
        self._prefixes: dict[str, bytes] = {}  # encoded key prefix per queue (writer only)
        self._default_floor = self._read_default_floor()

    @staticmethod
    def _open(path: Path, cache_mb: int, memtable_mb: int) -> Rdict:
        db = Rdict(str(path), bounded_options(write_buffer_mb=memtable_mb,
                                              cache=Cache(cache_mb * 1024 * 1024)))
        uncache_obsolete_files(db)
        return db

    # -- offset allocation (writer thread only) ---------------------------------------
    def next_offset(self, queue: str) -> int:
        nxt = self._next.get(queue)
        if nxt is None:
            nxt = self.max_offset(queue)
            self._next[queue] = nxt
        return nxt

    def assign(self, queues: Iterable[str]) -> list[tuple[str, int]]:
        """Give each queue its next offset; the caller rolls back with `unassign` on failure."""
        out = []
        nxt = self._next
        for q in queues:  # once per message and queue: next_offset inlined
            off = nxt.get(q)
            if off is None:
                off = self.next_offset(q)
            nxt[q] = off + 1
            out.append((q, off))
        return out

    def unassign(self, assigned: Iterable[tuple[str, int]]) -> None:
        for q, off in assigned:
            if self._next.get(q, -1) > off:
                self._next[q] = off

    def forget_allocations(self) -> None:
        self._next.clear()
        self._prefixes.clear()

    # -- dispatch ---------------------------------------------------------------------
    def write_messages(self, msgs: Iterable[StoredRecord], checkpoint: int) -> int:
        """The entries of stored messages (and their key refs) in one batch, as runs:
        per queue, the consecutive offsets of these messages under one key."""
        # Runs never overlap: a batch's run of a queue starts at that queue's next offset,
        # and what goes (retention, a cut tail) goes from a queue's start or to its end.
        wb = WriteBatch(raw_mode=True)
        put = wb.put
        pack = ENTRY.pack
        u64 = U64.pack
        prefixes = self._prefixes
        runs: dict[str, list] = {}  # queue -> [first offset, next offset, entries]
        n = 0
        for m in msgs:
            value = pack(m.phys_offset, m.size, m.store_ts)
            for queue, offset in m.queues:
                run = runs.get(queue)
                if run is None or run[1] != offset or len(run[2]) >= RUN_MAX:
                    if run is not None:  # a gap (a floor) or a full run: write it
                        put(self._prefix(prefixes, queue) + u64(run[0]), b"".join(run[2]))
                    run = runs[queue] = [offset, offset, []]
                run[2].append(value)
                run[1] = offset + 1
            n += len(m.queues)
            if m.key:
                put(key_prefix(m.key) + u64(m.phys_offset), b"")
        for queue, (first, _, entries) in runs.items():
            put(self._prefix(prefixes, queue) + u64(first), b"".join(entries))
        put(CHECKPOINT_KEY, u64(checkpoint))
        self._db.write(wb, self._no_wal)
        return n

    def write_batch(self, batch: PackedBatch, checkpoint: int) -> None:
        """`write_messages` of a native dispatch's batch (serving.lightgate_native's
        DispatchBatch), whose entries come packed and keyed already: it puts each of its
        runs and key references into the write batch itself, so that this costs the
        interpreter a few calls however many runs the batch holds."""
        wb = WriteBatch(raw_mode=True)
        batch.put_index(wb.put)
        wb.put(CHECKPOINT_KEY, U64.pack(checkpoint))
        self._db.write(wb, self._no_wal)

    @staticmethod
    def _prefix(prefixes: dict[str, bytes], queue: str) -> bytes:
        prefix = prefixes.get(queue)
        if prefix is None:
            prefix = prefixes[queue] = queue_prefix(queue)
        return prefix

    def checkpoint(self) -> int:
        raw = self._db.get(CHECKPOINT_KEY)
        return U64.unpack(raw)[0] if raw else 0

    def memory(self) -> dict[str, int]:
        """What RocksDB holds in memory for the index (see rocks.memory_usage)."""
        return memory_usage(self._db)

    # -- reads ------------------------------------------------------------------------
    def _run(self, it: Rdict, prefix: bytes) -> tuple[int, bytes] | None:
        """(first offset, entries) of the run `it` is at, if it is one of this queue's."""
        if not it.valid():
            return None
        key = it.key()
        if len(key) != len(prefix) + 8 or not key.startswith(prefix):
            return None
        return U64.unpack_from(key, len(prefix))[0], it.value()

    def _run_at(self, prefix: bytes, offset: int) -> tuple[int, bytes] | None:
        """The run holding the entry of `offset`, if there is one."""
        it = self._db.iter()
        it.seek_for_prev(prefix + U64.pack(offset))
        run = self._run(it, prefix)
        if run is not None and offset < run[0] + len(run[1]) // ENTRY.size:
            return run
        return None

    def _last_offset(self, queue: str) -> int | None:
        prefix = queue_prefix(queue)
        it = self._db.iter()
        it.seek_for_prev(prefix + _MAX_U64)
        run = self._run(it, prefix)
        return None if run is None else run[0] + len(run[1]) // ENTRY.size - 1

    def min_offset(self, queue: str) -> int:
        prefix = queue_prefix(queue)
        it = self._db.iter()
        it.seek(prefix)
        if it.valid() and it.key().startswith(prefix):
            return U64.unpack_from(it.key(), len(prefix))[0]
        return self.max_offset(queue)  # empty: where the next one goes (floor included)

    def max_offset(self, queue: str) -> int:
        """One past the last entry (the offset the next message will get), never below
        the queue's floor (see `set_floors`)."""
        last = self._last_offset(queue)
        end = 0 if last is None else last + 1
        floor = self._db.get(FLOOR + queue.encode())
        if floor:
            return max(end, U64.unpack(floor)[0])
        return self._default_floor if last is None else end

    def _read_default_floor(self) -> int:
        raw = self._db.get(DEFAULT_FLOOR_KEY)
        return U64.unpack(raw)[0] if raw else 0

    def set_default_floor(self, floor: int) -> None:
        """A queue with no entries and no floor of its own starts at `floor`, not 0. For
        an index rebuilt from a log that retention has trimmed: queues whose every record
        is gone left no trace to rebuild from, and `floor` must be at least any end they
        had (their readers may be that far)."""
        if floor > self._default_floor:
            self._db.put(DEFAULT_FLOOR_KEY, U64.pack(floor))  # WAL on: not derived data
            self._default_floor = floor
            self._next.clear()

    @property
    def default_floor(self) -> int:
        return self._default_floor

    def floors(self) -> dict[str, int]:
        """Every queue's own floor (see `max_offset`)."""
        return self.floors_page(None, 1 << 62)[0]

    def floors_page(self, after: str | None, limit: int) -> tuple[dict[str, int], str | None]:
        """Up to `limit` queues' own floors in name order, after the queue `after` (None:
        from the first), and the last name given when more may follow (else None)."""
        ro = ReadOptions()
        ro.set_iterate_upper_bound(b"g")
        it = self._db.iter(ro)
        start = FLOOR if after is None else FLOOR + after.encode()
        it.seek(start)
        if after is not None and it.valid() and it.key() == start:
            it.next()
        out: dict[str, int] = {}
        while it.valid():
            name = it.key()[1:].decode()
            out[name] = U64.unpack(it.value())[0]
            if len(out) >= limit:
                return out, name
            it.next()
        return out, None

    def queue_ends(self) -> dict[str, int]:
        """The end of every queue (a skip-scan: one seek per queue; for repairs only)."""
        return {q: self.max_offset(q) for q in self.queues(limit=10**12)}

    def set_floors(self, floors: dict[str, int]) -> None:
        """Never give offsets below these again. After a repair cut the log, offsets that
        readers may already have seen are not handed out a second time: the queue has a
        gap instead, and readers that were past it carry on."""
        wb = WriteBatch(raw_mode=True)
        for queue, floor in floors.items():
            wb.put(FLOOR + queue.encode(), U64.pack(floor))
        self._db.write(wb)
        for queue in floors:
            self._next.pop(queue, None)

    def _seek(self, queue: str, offset: int) -> tuple[Rdict, bytes, int]:
        """An iterator at the run holding `queue`'s entry at `offset` (clamped to 0), or
        at the next run; the queue's key prefix; the offset."""
        prefix = queue_prefix(queue)
        offset = max(offset, 0)
        it = self._db.iter()
        it.seek_for_prev(prefix + U64.pack(offset))  # the run holding it, if any
        if self._run(it, prefix) is None:
            it.seek(prefix + U64.pack(offset))
        return it, prefix, offset

    def read(self, queue: str, offset: int, max_count: int) -> list[IndexEntry]:
        it, prefix, offset = self._seek(queue, offset)
        out: list[IndexEntry] = []
        unpack = ENTRY.unpack_from
        while len(out) < max_count and (run := self._run(it, prefix)) is not None:
            first, entries = run
            for i in range(max(0, offset - first), len(entries) // ENTRY.size):
                phys, size, ts = unpack(entries, i * ENTRY.size)
                out.append(IndexEntry(first + i, phys, size, ts))
                offset = first + i + 1  # (runs never overlap; if they did, no repeats)
                if len(out) >= max_count:
                    break
            it.next()
        return out

    def read_tuples(self, queue: str, offset: int, max_count: int) -> list[Entry]:
        """`read` as (phys offset, size, store time, offset) tuples, unpacked a run at a
        time: a replay reads millions, and an object per entry cost more than the read."""
        it, prefix, offset = self._seek(queue, offset)
        out: list[Entry] = []
        while len(out) < max_count and (run := self._run(it, prefix)) is not None:
            first, entries = run
            skip = max(0, offset - first)
            n = min(len(entries) // ENTRY.size - skip, max_count - len(out))
            if n > 0:
                view = memoryview(entries)[skip * ENTRY.size:(skip + n) * ENTRY.size]
                out.extend((phys, size, ts, o) for o, (phys, size, ts) in
                           enumerate(ENTRY.iter_unpack(view), first + skip))
                offset = out[-1][3] + 1
            it.next()
        return out

    def read_runs_raw(self, queue: str, offset: int, max_entries: int
                      ) -> tuple[list[tuple[int, bytes]], bool]:
        """The runs holding `queue`'s entries from `offset` as stored: (first offset,
        packed entries), the first one perhaps beginning before `offset`, until at least
        `max_entries` entries from it; and whether the read stopped there (more may
        follow). For a reader that unpacks them itself (the native plane's, for a
        subscriber that fell behind): no object per entry here."""
        it, prefix, offset = self._seek(queue, offset)
        runs: list[tuple[int, bytes]] = []
        n = 0
        while n < max_entries and (run := self._run(it, prefix)) is not None:
            first, entries = run
            count = len(entries) // ENTRY.size - max(0, offset - first)
            if count > 0:
                runs.append(run)
                n += count
            it.next()
        return runs, n >= max_entries

    def offset_at_time(self, queue: str, ms: int) -> int:
        """The first offset whose message was stored at or after `ms` (store time, ms
        since the epoch), or the queue's end when none was: a binary search over the
        runs, a seek and a value per probe (~20 at 1M single-entry runs), never a scan.
        Store times are taken as non-decreasing along the queue (each append stamps its
        batch with the clock); after the clock stepped back the answer is some offset
        between the two readings."""
        return self._bisect(queue, ms, _TS_AT)

    def offset_at_position(self, queue: str, phys: int) -> int:
        """The first offset whose record starts at or after CommitLog offset `phys`, or
        the queue's end: where a reader of this queue picks up a log position."""
        return self._bisect(queue, phys, _PHYS_AT)

    def _bisect(self, queue: str, value: int, field_at: int) -> int:
        prefix = queue_prefix(queue)
        lo, hi = self.min_offset(queue), self.max_offset(queue)
        best = hi  # the smallest offset known to hold a value >= `value`
        it = self._db.iter()
        unpack = U64.unpack_from
        while lo < hi:
            mid = (lo + hi) // 2
            run = self._run_from(it, prefix, mid)
            if run is None:  # no entry at mid or after it (a gap to the end)
                hi = mid
                continue
            first, entries = run
            n = len(entries) // ENTRY.size
            if unpack(entries, (n - 1) * ENTRY.size + field_at)[0] < value:
                lo = first + n
            elif unpack(entries, field_at)[0] >= value:
                best, hi = first, min(first, mid)  # (first > mid: a gap from mid on)
            else:  # the boundary is inside this run: its first entry is below `value`
                a, b = 1, n - 1
                while a < b:
                    m = (a + b) // 2
                    if unpack(entries, m * ENTRY.size + field_at)[0] < value:
                        a = m + 1
                    else:
                        b = m
                return first + a
        return best

    def _run_from(self, it: Rdict, prefix: bytes, offset: int) -> tuple[int, bytes] | None:
        """The run holding `offset`, else the first run after it, if any."""
        it.seek_for_prev(prefix + U64.pack(offset))
        run = self._run(it, prefix)
        if run is not None and offset < run[0] + len(run[1]) // ENTRY.size:
            return run
        it.seek(prefix + U64.pack(offset))
        return self._run(it, prefix)

    def entry_before(self, queue: str, offset: int) -> Entry | None:
        """The last entry below `offset` (gaps skipped), if any."""
        if offset <= 0:
            return None
        prefix = queue_prefix(queue)
        it = self._db.iter()
        it.seek_for_prev(prefix + U64.pack(offset - 1))
        run = self._run(it, prefix)
        if run is None:
            return None
        first, entries = run
        i = min(offset - 1 - first, len(entries) // ENTRY.size - 1)
        phys, size, ts = ENTRY.unpack_from(entries, i * ENTRY.size)
        return phys, size, ts, first + i

    def tail_start(self, queue: str, start: int, max_bytes: int) -> int:
        """The lowest offset >= `start` from which the entries to the queue's end hold
        at most `max_bytes` message bytes: where a reader that may fall at most that far
        behind resumes. Walks back from the end, so it costs what it keeps."""
        prefix = queue_prefix(queue)
        start = max(start, 0)
        it = self._db.iter(ReadOptions())  # (rocksdict's lower bound misleads seek_for_prev)
        it.seek_for_prev(prefix + _MAX_U64)
        total = 0
        keep = None
        while (run := self._run(it, prefix)) is not None:
            first, entries = run
            for i in range(len(entries) // ENTRY.size - 1, -1, -1):
                if first + i < start:
                    return start  # all of it fits
                total += ENTRY.unpack_from(entries, i * ENTRY.size)[1]
                if total > max_bytes:
                    return keep if keep is not None else self.max_offset(queue)
                keep = first + i
            it.prev()
        return start

    def end_within(self, queue: str, phys_limit: int) -> int:
        """The queue's end counting only the entries whose records end at or before
        `phys_limit` (in sync replication, the acknowledged part of the log): where a new
        reader starts that must never see a message a failover may cut. Walks back from
        the end over runs; what lies past the limit is milliseconds of appends."""
        prefix = queue_prefix(queue)
        it = self._db.iter(ReadOptions())  # (rocksdict's lower bound misleads seek_for_prev)
        it.seek_for_prev(prefix + _MAX_U64)
        end = self.max_offset(queue)
        while (run := self._run(it, prefix)) is not None:
            first, entries = run
            for i in range(len(entries) // ENTRY.size - 1, -1, -1):
                phys, size, _ = ENTRY.unpack_from(entries, i * ENTRY.size)
                if phys + size <= phys_limit:
                    return end
                end = first + i
            it.prev()
        return end

    def holds(self, phys_offset: int, queues: list[tuple[str, int]], key: str) -> bool:
        """Whether the index has the message at `phys_offset` (whose queues and key are
        these) under its first queue or, with no queue, under its key."""
        if queues:
            queue, offset = queues[0]
            run = self._run_at(queue_prefix(queue), offset)
            if run is None:
                return False
            first, entries = run
            return U64.unpack_from(entries, (offset - first) * ENTRY.size)[0] == phys_offset
        return bool(key) and self._db.get(key_prefix(key) + U64.pack(phys_offset)) is not None

    def last_key(self, key: str) -> int | None:
        """Physical offset of the newest message stored with this key, if any."""
        prefix = key_prefix(key)
        it = self._db.iter(ReadOptions())
        it.seek_for_prev(prefix + _MAX_U64)
        if it.valid():
            found = it.key()
            if found.startswith(prefix) and len(found) == len(prefix) + 8:
                return U64.unpack_from(found, len(prefix))[0]
        return None

    def find_key(self, key: str, limit: int = 100) -> list[int]:
        """Physical offsets of the messages stored with this key, oldest first."""
        prefix = key_prefix(key)
        ro = ReadOptions()
        ro.set_iterate_upper_bound(prefix[:-1] + b"\x01")
        it = self._db.iter(ro)
        it.seek(prefix)
        out = []
        while it.valid() and len(out) < limit:
            out.append(U64.unpack_from(it.key(), len(prefix))[0])
            it.next()
        return out

    def queues(self, prefix: str = "", limit: int = 1000) -> Iterator[str]:
        """Distinct queue names starting with `prefix` (skips from queue to queue)."""
        it = self._db.iter()
        start = b"q" + prefix.encode()
        it.seek(start)
        n = 0
        while it.valid() and n < limit:
            key = it.key()
            if not key.startswith(start):
                break
            name, _, _ = key[1:].partition(b"\x00")
            yield name.decode()
            n += 1
            it.seek(b"q" + name + b"\x01")

    # -- retention --------------------------------------------------------------------
    def delete_below(self, queue_ends: dict[str, int], keys: Iterable[tuple[str, int]]) -> None:
        """Drop entries below `end` of each queue and the given key refs, in one batch.
        Each queue keeps `end` as its floor: once all its entries are gone, the next
        offset must still follow them (after a restart it was 0 again, and a persistent
        session past the old offsets never saw the new messages)."""
        wb = WriteBatch(raw_mode=True)
        for queue, end in queue_ends.items():
            prefix = queue_prefix(queue)
            if end > 0 and (run := self._run_at(prefix, end - 1)) is not None:
                first, entries = run
                if first + len(entries) // ENTRY.size > end:  # it goes on past `end`:
                    # its key falls in the range deleted below; its rest moves to `end`
                    wb.put(prefix + U64.pack(end), entries[(end - first) * ENTRY.size:])
            wb.delete_range(prefix, prefix + U64.pack(end))
            floor_key = FLOOR + queue.encode()
            old = self._db.get(floor_key)  # a repair may have set a higher one
            if old is None or U64.unpack(old)[0] < end:
                wb.put(floor_key, U64.pack(end))
        for key, phys in keys:
            wb.delete(key_prefix(key) + U64.pack(phys))
        self._db.write(wb, self._no_wal)

    # -- replication: a forked tail cut ---------------------------------------------------
    def remove_entries(self, entries: Iterable[tuple[str, int]], keys: Iterable[tuple[str, int]],
                       checkpoint: int) -> None:
        """Drop these (queue, offset) entries and key refs (the records of a CommitLog tail
        a replica cuts off: its log forked from the master's), set the checkpoint to the
        new log end, and forget allocations (the next offsets come from the index again).
        A cut tail holds each queue's newest offsets, so a queue loses everything from
        the lowest of them on: the run holding it keeps only what comes before."""
        lowest: dict[str, int] = {}
        for queue, offset in entries:
            if offset < lowest.get(queue, offset + 1):
                lowest[queue] = offset
        wb = WriteBatch(raw_mode=True)
        for queue, cut in lowest.items():
            prefix = queue_prefix(queue)
            run = self._run_at(prefix, cut)
            if run is not None and run[0] < cut:
                first, run_entries = run
                wb.put(prefix + U64.pack(first), run_entries[:(cut - first) * ENTRY.size])
            wb.delete_range(prefix + U64.pack(cut), prefix[:-1] + b"\x01")
        for key, phys in keys:
            wb.delete(key_prefix(key) + U64.pack(phys))
        wb.put(CHECKPOINT_KEY, U64.pack(checkpoint))
        self._db.write(wb, self._no_wal)
        self.forget_allocations()

    # -- lifecycle --------------------------------------------------------------------
    def flush(self) -> None:
        """Persist memtables, so a crash after this needs no re-dispatch before it."""
        self._db.flush()

    def clear(self) -> None:
        """Drop every entry (for a rebuild from the CommitLog). The floors stay: they are
        not derived from the log, and a queue whose records retention removed has no
        other trace of where its offsets had got to."""
        floors, default = self.floors(), self._default_floor
        self._db.close()
        shutil.rmtree(self.path, ignore_errors=True)
        self._db = self._open(self.path, *self._sizes)
        self._default_floor = 0
        self.forget_allocations()
        if floors:
            self.set_floors(floors)
        self.set_default_floor(default)

    def reset(self, checkpoint: int, floors: dict[str, int], default_floor: int) -> None:
        """Start over, empty, as the index of a log that begins at `checkpoint`, with
        another index's floors: a replica that takes its master's log from the master's
        start, once retention there removed what would follow its own. The master's floors
        and the queue offsets in the records it copies give every queue the master's end.
        One batch of deletes, not a new database: readers and retention may be in it."""
        wb = WriteBatch(raw_mode=True)
        wb.delete_range(b"\x00", _MAX_KEY)  # every key: b"\x00...", b"f", b"k", b"q"
        for queue, floor in floors.items():
            wb.put(FLOOR + queue.encode(), U64.pack(floor))
        wb.put(DEFAULT_FLOOR_KEY, U64.pack(default_floor))
        wb.put(CHECKPOINT_KEY, U64.pack(checkpoint))
        self._db.write(wb)  # WAL on: floors are not derived from the log
        self._default_floor = default_floor
        self.forget_allocations()
        self.flush()

    def close(self) -> None:
        try:
            self._db.flush()
        finally:
            self._db.close()
