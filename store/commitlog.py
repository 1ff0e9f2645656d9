"""The CommitLog: every message of every topic, appended once, in segment files.

An append assigns light-queue offsets inside the append, writes the batch with one
`write`, makes it as durable as the flush mode asks, writes the consume-queue entries to
RocksDB in one WriteBatch, and only then completes the caller's future.

Who does that depends on the flush mode:
- `sync`: one writer thread owns the tail. It takes every pending request at once (group
  commit), so that one fsync covers them all, and completes their futures after it.
- `async`: the caller appends inline (the event loop, in a server): the write lands in the
  page cache in microseconds, and handing every message to a thread and back cost far
  more (a GIL hand-off and a wake-up of the loop each way, ~90 µs a message at low rates).
  The thread is then only a flusher: it fsyncs every `flush_interval_ms` (or once
  `flush_bytes` are dirty) and writes the checkpoint.

Where the native engine runs (`start_engine`, store.engine_tail), it writes instead, for
this process and for the connections it carries: the producers' checks stay here, the
offsets, records and writes are its, and the index follows its appends in log order.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import logging
import mmap
import os
import queue
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from setproctitle import setthreadtitle

from lightqueue.index import ConsumeQueueIndex
from serving.rate_limited_log import RateLimitedLog
from store import producers, record
from store.common import StoreClosedError, StoreError, StoreFullError
from store.damage import QUARANTINE_DIR, DamagedRanges
from store.engine_tail import EngineTail
from store.highwater import HighWater
from store.producers import Plan, ProducerTable, Stamp
from store.record import MARK_FIRST, MARK_MORE, CorruptRecord, Message
from store.segment import Segment, fdatasync, fsync_dir, is_segment_name, segment_name

log = logging.getLogger("lightgate.store.commitlog")
_full = RateLimitedLog(log, logging.ERROR)  # a full disk refuses each append

ABORT_FILE = "abort"  # present while running; left behind by a crash (as RocketMQ's)
CHECKPOINT_FILE = "checkpoint"
PRODUCERS_FILE = "producers"  # the producers' table as of a log offset (store.producers)
REDISPATCH_BATCH = 5000
VERIFY_CHUNK = 1 << 20  # bytes the background verification reads between its pauses
__all__ = ["QUARANTINE_DIR"]


@dataclass
class RecoveryReport:
    clean_shutdown: bool
    verified_from: int
    end: int
    records_verified: int = 0
    truncated_at: int | None = None
    truncated_bytes: int = 0
    quarantined: list[str] = field(default_factory=list)
    damaged: int = 0  # damaged ranges found (and read around), not cut
    index_rebuilt: bool = False
    redispatched: int = 0
    producer_records: int = 0  # read to rebuild the idempotent producers' sequences
    marked_queues: int = 0  # queues started at their high-water mark (store.highwater)
    seconds: float = 0.0

    def __str__(self) -> str:
        """In words, for the log (the first line a server writes)."""
        how = "after a clean shutdown" if self.clean_shutdown else "after a crash"
        parts = [f"{self.records_verified} records verified from offset "
                 f"{self.verified_from}, log end {self.end}"]
        if self.truncated_at is not None:
            parts.append(f"a torn tail of {self.truncated_bytes} bytes cut at offset "
                         f"{self.truncated_at}")
        if self.quarantined:
            parts.append(f"{len(self.quarantined)} later segment(s) moved to quarantine: "
                         f"{', '.join(self.quarantined)}")
        if self.index_rebuilt:
            parts.append("the index rebuilt")
        if self.redispatched:
            parts.append(f"{self.redispatched} records indexed again")
        if self.producer_records:
            parts.append(f"{self.producer_records} records read for the idempotent "
                         "producers' sequences")
        return f"{how}: {'; '.join(parts)}; in {self.seconds:.3f} s"


class InlineFuture:
    """The future of an inline append: settled before `append` returns. It offers what
    callers use of a concurrent Future, without the lock and condition that cost more
    than the append itself at low rates."""

    __slots__ = ("_result", "_exc")

    def __init__(self) -> None:
        self._result: list[Message] | None = None
        self._exc: BaseException | None = None

    def set_result(self, result: list[Message]) -> None:
        self._result = result

    def set_exception(self, exc: BaseException) -> None:
        self._exc = exc

    def done(self) -> bool:
        return True

    def cancelled(self) -> bool:
        return False

    def result(self, timeout: float | None = None) -> list[Message]:
        if self._exc is not None:
            raise self._exc
        assert self._result is not None
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._exc

    def add_done_callback(self, fn: Callable[[InlineFuture], object]) -> None:
        fn(self)


@dataclass(slots=True)
class _Append:
    messages: list[Message]
    queues: Sequence[Sequence[str]]
    future: Future | InlineFuture
    stamp: Stamp | None = None  # an idempotent producer's request (store.producers)
    plan: Plan | None = None  # how it fits the producer's sequence, once checked
    fresh: list[Message] | None = None  # with a plan: the messages after its duplicates

    def new(self) -> list[Message]:
        """The messages this append writes (a producer's duplicates are not)."""
        return self.messages if self.fresh is None else self.fresh


_STOP = object()
_WAKE = object()  # async mode: the log became dirty, or dirty enough to fsync now


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _bad_records(data: bytes, sizes: Sequence[int]) -> list[int]:
    """Which of the records back to back in `data` (of these sizes, from the index) do
    not check: each one's magic, length and CRC, none of its fields."""
    view = memoryview(data)
    head, crc32 = record.FRAME.unpack_from, zlib.crc32
    bad = []
    pos = 0
    for i, size in enumerate(sizes):
        if len(data) - pos < max(size, record.HEADER_SIZE):
            bad.append(i)
        else:
            magic, total, crc = head(data, pos)
            if (magic != record.MAGIC and magic != record.MAGIC_WIDE) or total != size \
                    or crc32(view[pos + 12:pos + total]) != crc:
                bad.append(i)
        pos += size
    return bad


def _boot_id() -> str | None:
    """This boot of the machine (Linux): a crash with the same one kept the page cache,
    so every write the process made is in the files."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _page_cache_lost(abort: dict | None) -> bool:
    """Whether writes of a run that did not stop cleanly may be lost although the files
    look whole: it appended before its fsyncs (flush async; acks and reads did not wait
    for the disk) and the machine went down since (another boot, or none known)."""
    if abort is None:
        return False
    boot = abort.get("boot")
    return abort.get("flush") != "sync" and (boot is None or boot != _boot_id())


def _holds_producers(seg: Segment) -> bool:
    """Whether a segment may hold an idempotent producer's record (its property name is
    in the bytes): a search at memory speed, so a log with none is not decoded."""
    mm = seg.map()
    if mm is None:
        return False
    try:
        return mm.find(b'"' + record.PRODUCER_PROP.encode() + b'"') >= 0
    finally:
        mm.close()


def _mark(msgs: list[Message], stamp: Stamp, skip: int) -> None:
    """Mark an idempotent producer's records (store.producers): the first carries the
    producer, its epoch and the sequence of that first message."""
    for m in msgs:
        m.mark = MARK_MORE
    if msgs:
        msgs[0].mark = MARK_FIRST
        msgs[0].producer = [stamp.producer, stamp.epoch, stamp.seq + skip]
        if stamp.topic == producers.PUBLISHES:  # (not the first record's first level)
            msgs[0].producer.append(producers.PUBLISHES)


class CommitLog(EngineTail):
    def __init__(
        self,
        directory: str | Path,
        index: ConsumeQueueIndex,
        *,
        segment_size: int = 1 << 30,
        flush: str = "async",
        flush_interval_ms: int = 500,
        flush_bytes: int = 16 << 20,
        on_dispatched: Callable[[list[Message]], bool | None] | None = None,
        full_verify: bool = False,
        max_producers: int = 10_000,
        verify_bytes_per_s: int = 32 << 20,
    ) -> None:
        if flush not in ("sync", "async"):
            raise ValueError("flush must be 'sync' or 'async'")
        self.dir = Path(directory)
        self.index = index
        self.segment_size = segment_size
        self.flush_mode = flush
        self.flush_interval = flush_interval_ms / 1000
        self.flush_bytes = flush_bytes
        self.on_dispatched = on_dispatched
        self.full_verify = full_verify
        self._segments: tuple[Segment, ...] = ()
        self._segments_lock = threading.Lock()
        # Held by the writer over a batch's writes, rolls and their undo, and by retention
        # to remove a segment: a roll undone must find the segment before it still there.
        self._tail_lock = threading.Lock()
        self._bases: tuple[int, ...] = ()
        # async mode: appends run in the caller's thread; this lock serialises them (and
        # the flusher's look at the tail). Re-entrant: a roll under it fsyncs the tail.
        self.inline = flush == "async"
        self._write_lock = threading.RLock()
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._wfd = -1
        self._write_pos = 0  # absolute offset of the end of the log
        self._flushed = 0  # absolute offset up to which the log is fsync'd
        self._dirty_since = 0.0
        self._flush_due = False  # async: the flusher has been told of unsynced bytes
        self._last_checkpoint = 0.0
        self._checkpointed = -1  # the flushed offset the checkpoint file holds
        self._undispatched: list[Message] = []
        self._failed: BaseException | None = None
        self._closed = True
        # Idempotent producers' sequences, checked inside appends (under the write lock)
        # and rebuilt from the records (store.producers; snapshots: store.producer_state).
        self.producers = ProducerTable(max_producers)
        # The sequences the native server checks (store.carried), for the table's
        # snapshots: () -> (changed since the last call, [(producer, seen, batches)]).
        self.native_sequences: Callable[[], tuple[bool, list]] | None = None
        # Each queue's high-water mark, raised before an offset past it is assigned.
        self.marks = HighWater(self.dir)
        # Ranges whose records no longer check: read around, never served.
        self.damage = DamagedRanges(self.dir)
        self._damage_log = RateLimitedLog(log)
        # Segments start-up did not verify are verified after it, at this rate (0: not).
        self.verify_bytes_per_s = verify_bytes_per_s
        self._verifier: threading.Thread | None = None
        self._verify_stop = threading.Event()
        self.stats = {"appends": 0, "messages": 0, "bytes_written": 0, "fsyncs": 0, "batches": 0,
                      "corrupt_reads": 0, "verified_bytes": 0, "verify_pending_bytes": 0}
        self._init_engine_tail()  # no engine until start_engine (store.engine_tail)

    # -- lifecycle --------------------------------------------------------------------
    def open(self) -> RecoveryReport:
        self.dir.mkdir(parents=True, exist_ok=True)
        report = self._recover()
        (self.dir / ABORT_FILE).write_bytes(orjson.dumps(
            {"pid": os.getpid(), "boot": _boot_id(), "flush": self.flush_mode}))
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="commitlog-writer", daemon=True)
        self._thread.start()
        old = [s for s in self._segments if s.base < report.verified_from]
        if old and self.verify_bytes_per_s > 0:
            self.stats["verify_pending_bytes"] = sum(s.size() for s in old)
            self._verifier = threading.Thread(target=self._verify_old, args=(old,),
                                              name="commitlog-verify", daemon=True)
            self._verifier.start()
        return report

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._verify_stop.set()
        self._requests.put(_STOP)
        if self._thread:
            self._thread.join()
        if self._verifier is not None:
            self._verifier.join()
        with self._write_lock:  # an inline append that began before _closed was set
            pass
        if self.engine is not None:
            self._stop_engine()
        if self._wfd >= 0:
            os.fsync(self._wfd)
            os.close(self._wfd)
            self._wfd = -1
        self._flushed = self._write_pos
        self._write_checkpoint()
        self._save_producers(self._write_pos, self.producers.snapshot())
        # The log holds every record whole now: the marks are of no more use. The
        # index first, with any floors recovery set from them.
        self.index.flush()
        self.marks.clear()
        self.marks.close()
        for seg in self._segments:
            seg.close()
        (self.dir / ABORT_FILE).unlink(missing_ok=True)

    # -- public API -------------------------------------------------------------------
    @property
    def min_offset(self) -> int:
        return self._bases[0] if self._bases else 0

    @property
    def max_offset(self) -> int:
        return self._write_pos

    @property
    def flushed_offset(self) -> int:
        return self._flushed

    def segments(self) -> list[tuple[int, int]]:
        """(base, size) of every live segment, oldest first."""
        return [(s.base, s.size()) for s in self._segments]

    def append(self, messages: list[Message], queues: Sequence[Sequence[str]],
               stamp: Stamp | None = None) -> Future | InlineFuture:
        """Queue `messages` (each indexed into its list of queues) for the writer.

        The future resolves to the same messages with phys_offset, size, store_ts and
        queue offsets filled in, once they are as durable as the flush mode promises.
        `stamp`: an idempotent producer's request, checked against its sequence inside
        the append (store.producers): the messages already stored are answered as the
        log holds them, not appended again; a SequenceError fails the future.
        """
        if self._closed or self._failed:
            closed: Future = Future()
            closed.set_exception(
                StoreClosedError(f"commitlog unavailable: {self._failed or 'closed'}")
            )
            return closed
        if len(messages) != len(queues):
            raise ValueError("one list of queues per message")
        if self.inline:
            done = InlineFuture()
            with self._write_lock:
                written = self._write_batch([_Append(messages, queues, done, stamp)])
            self._announce(written)
            return done
        fut: Future = Future()
        self._requests.put(_Append(messages, queues, fut, stamp))
        return fut

    def read(self, phys_offset: int, size: int | None = None) -> Message:
        """Read and verify the record at `phys_offset`."""
        seg = self._segment_for(phys_offset)
        if seg is None or not seg.acquire():
            raise KeyError(f"offset {phys_offset} is not in the log (min {self.min_offset})")
        try:
            pos = phys_offset - seg.base
            if size is not None:  # from the index: a record starts there
                return self._checked(seg.pread(size, pos), phys_offset, size)
            # Any id may come from a client: an offset inside a record reads a garbage
            # length, which must not become a 4 GiB pread.
            magic, size = record.frame_length(seg.pread(record.FRAME.size, pos))
            if magic not in (record.MAGIC, record.MAGIC_WIDE) or not (
                    record.HEADER_SIZE <= size <= min(record.MAX_RECORD, seg.size() - pos)):
                raise CorruptRecord(f"no message at offset {phys_offset}")
            try:
                msg = record.decode(seg.pread(size, pos), 0, phys_offset)
            except CorruptRecord as exc:
                self._note_corrupt(phys_offset, exc)
                raise
        finally:
            seg.release()
        # Magic, length and CRC also hold for a record a client sent as a message body:
        # only the index knows where records start.
        if not self.index.holds(phys_offset, msg.queues, msg.key):
            raise CorruptRecord(f"no message at offset {phys_offset}")
        return msg

    def read_run(self, entries: Sequence[tuple[int, int]]) -> list[Message | None]:
        """Read the records at these (phys_offset, size) positions, taken from the index:
        records that lie back to back in one segment (one topic's burst) are read with one
        pread. None where a record is gone (retention)."""
        out: list[Message | None] = []
        i = 0
        while i < len(entries):
            start, size = entries[i]
            seg = self._segment_for(start)
            if seg is None or not seg.acquire():
                out.append(None)
                i += 1
                continue
            try:
                j, end = i + 1, start + size
                limit = seg.base + seg.size()
                while (j < len(entries) and entries[j][0] == end
                       and end + entries[j][1] <= limit and end - start < (1 << 20)):
                    end += entries[j][1]
                    j += 1
                data = seg.pread(end - start, start - seg.base)
            finally:
                seg.release()
            pos = 0
            for phys, n in entries[i:j]:
                try:
                    out.append(record.decode(data, pos, phys))
                except CorruptRecord as exc:  # read around it: the rest are served
                    out.append(None)
                    self.note_damaged(phys, n, exc, data, pos)
                pos += n
            i = j
        return out

    def _checked(self, data: bytes, phys: int, size: int) -> Message:
        """The record read from an index entry (CorruptRecord, counted, if it does not
        check)."""
        try:
            return record.decode(data, 0, phys)
        except CorruptRecord as exc:
            self.note_damaged(phys, size, exc, data, 0)
            raise

    def note_damaged(self, phys: int, size: int, exc: Exception, data: bytes, pos: int
                     ) -> None:
        """A reader found the record of an index entry damaged: counted, and its bytes
        (the entry says where it ends) listed as damaged."""
        self._note_corrupt(phys, exc)
        if len(data) - pos >= size:
            self.damage.add(phys, phys + size, str(exc), memoryview(data)[pos:pos + size])

    def _note_corrupt(self, phys: int, exc: Exception) -> None:
        self.stats["corrupt_reads"] += 1
        self._damage_log.note("a damaged CommitLog record was skipped by a reader (each "
                              "damaged range is logged once when found; /metrics: "
                              "lightgate_commitlog_corrupt_reads_total)")

    def read_records(self, entries: Sequence[tuple[int, int, int, int]], max_bytes: int
                     ) -> tuple[list[list[int]], bytes, int]:
        """The records at these index entries ((phys offset, size, store time, queue
        offset), in queue order) as the log holds them, CRC checked, not decoded: what a
        reader that decodes records itself is handed (PULL `raw`). Returns the runs
        [phys offset, bytes, first queue offset, records] of records that lie back to
        back (one pread each) and their bytes concatenated; at most about `max_bytes`
        (one record at least), and how many of the entries were looked at. Records gone
        to retention, and damaged ones, are left out."""
        runs: list[list[int]] = []
        parts: list[bytes] = []
        total = 0
        i, n = 0, len(entries)
        bases = self._bases
        while i < n and (total < max_bytes or not parts):
            start, size, _, first = entries[i]
            k = bisect.bisect_right(bases, start) - 1
            seg = self._segment_for(start)
            if seg is None or not seg.acquire():
                i += 1
                continue
            try:
                limit = bases[k + 1] if k + 1 < len(bases) else self._write_pos
                j, end = i + 1, start + size
                while (j < n and entries[j][0] == end and entries[j][3] == first + j - i
                       and end + entries[j][1] <= limit and total + end - start < max_bytes):
                    end += entries[j][1]
                    j += 1
                data = seg.pread(end - start, start - seg.base)
            finally:
                seg.release()
            bad = _bad_records(data, [e[1] for e in entries[i:j]])
            if bad:  # read around them: the runs between are served
                self._split_run(entries[i:j], data, bad, runs, parts)
            else:
                runs.append([start, end - start, first, j - i])
                parts.append(data)
            total += end - start
            i = j
        return runs, b"".join(parts), i

    def _split_run(self, run: Sequence[tuple[int, int, int, int]], data: bytes, bad: list[int],
                   runs: list[list[int]], parts: list[bytes]) -> None:
        """The records of a run read at once, less the damaged ones (counted, listed)."""
        start = run[0][0]
        lo = 0
        for k in [*bad, len(run)]:
            if k > lo:
                a, b = run[lo][0] - start, run[k - 1][0] + run[k - 1][1] - start
                runs.append([run[lo][0], b - a, run[lo][3], k - lo])
                parts.append(data[a:b])
            if k < len(run):
                phys, size = run[k][0], run[k][1]
                at = phys - start
                why = CorruptRecord("bad frame")
                try:
                    record.decode(data[at:at + size], 0, phys)
                except CorruptRecord as exc:
                    why = exc
                self.note_damaged(phys, size, why, data, at)
            lo = k + 1

    def read_bytes(self, pos: int, size: int) -> tuple[bytes, int]:
        """Up to `size` bytes of the log from any position `pos` (a record start or not),
        clipped to its segment and the log's end, and that segment's end: what a search
        for records by position (the history reader's seek by time) reads. b"" past the
        end or where retention removed the segment."""
        seg = self._segment_for(pos)
        if seg is None or not seg.acquire():
            return b"", pos
        try:
            seg_end = min(seg.base + seg.size(), self._write_pos)
            return seg.pread(max(0, min(size, seg_end - pos)), pos - seg.base), seg_end
        finally:
            seg.release()

    def scan(self, start: int, end: int | None = None) -> Iterator[Message]:
        """Every record from `start` (a record boundary) to `end`, verified."""
        end = self._write_pos if end is None else end
        for seg in self._segments:
            if seg.end <= start or seg.base >= end:
                continue
            if not seg.acquire():
                continue
            try:
                yield from self._scan_segment(seg, max(start, seg.base), end)
            finally:
                seg.release()

    # -- writer thread ----------------------------------------------------------------
    def _run(self) -> None:
        # Named for the OS (Python does not), so /proc, top -H and the benchmark's
        # per-thread CPU show what this thread costs.
        setthreadtitle("commitlog-flush" if self.inline else "commitlog-write")
        while True:
            timeout = None
            if self.engine is not None:
                # The checkpoint follows what the engine made durable; and its appends
                # are dirty from their write, not from their dispatch, which may come
                # later (`DISPATCH_LAZY_S`): the interval holds however late it runs.
                timeout = min(1.0, self.flush_interval)
            if self._flushed < self._write_pos:
                timeout = max(0.0, self._dirty_since + self.flush_interval - time.monotonic())
                if self._write_pos - self._flushed >= self.flush_bytes:
                    timeout = 0.0
            try:
                first = self._requests.get(timeout=timeout)
            except queue.Empty:
                with contextlib.suppress(OSError):  # logged and latched in _fsync_tail
                    self._fsync_tail()
                continue
            batch = [first]
            with contextlib.suppress(queue.Empty):
                while len(batch) < 10_000:
                    batch.append(self._requests.get_nowait())
            stop = _STOP in batch
            appends = [b for b in batch if b is not _STOP and b is not _WAKE]
            if appends:
                with self._write_lock:
                    written = self._write_batch(appends)
                self._announce(written)
            if stop:
                return

    def _plan(self, req: _Append) -> Sequence[Sequence[str]]:
        """Check an idempotent producer's request against its sequence (SequenceError if
        it does not fit) and mark the messages it appends; the queues of those."""
        if req.stamp is None:
            return req.queues
        req.plan = self.producers.plan(req.stamp, len(req.messages))
        if req.plan.skip:
            req.fresh = req.messages[req.plan.skip:]
        _mark(req.new(), req.stamp, req.plan.skip)
        return req.queues[req.plan.skip:]

    def _write_batch(self, batch: list[_Append]) -> list[_Append]:
        """Write and index a batch of appends; the ones written, for `_announce`."""
        if self._failed:
            for req in batch:
                req.future.set_exception(StoreClosedError(f"commitlog failed: {self._failed}"))
            return []
        if self.engine is not None:
            return self._write_batch_engine(batch)
        now = _now_ms()
        accepted: list[_Append] = []
        chunks: list[tuple[Segment | None, list[bytes]]] = [(None, [])]  # None = active
        pos = self._write_pos
        active_base = self._segments[-1].base
        assigned_all: list[tuple[str, int]] = []
        sequenced: list = []  # what the producers' table must take back if the write fails
        for req in batch:
            assigned_req: list[tuple[str, int]] = []
            try:
                queues = self._plan(req)
                encoded = []
                for msg, qs in zip(req.new(), queues, strict=True):
                    msg.queues = self.index.assign(qs)
                    assigned_req.extend(msg.queues)
                    msg.store_ts = now
                    if msg.mark and req.stamp is None:
                        msg.mark = 0  # read from the log and appended again: not a producer's
                    encoded.append((msg, record.encode(msg)))
            except Exception as exc:  # one bad request must not sink the batch
                self.index.unassign(assigned_req)
                req.future.set_exception(exc)
                continue
            start = pos
            for msg, rec in encoded:
                if pos - active_base + len(rec) > self.segment_size and pos > active_base:
                    active_base = pos  # roll: the next segment starts where this one ends
                    chunks.append((None, []))
                msg.phys_offset = pos
                msg.size = len(rec)
                chunks[-1][1].append(rec)
                pos += len(rec)
            if req.stamp is not None and encoded:
                assert req.plan is not None
                sequenced.append(self.producers.appended(
                    req.stamp, req.stamp.seq + req.plan.skip, len(encoded), start, pos, now))
            assigned_all.extend(assigned_req)
            accepted.append(req)
        if not accepted:
            return []
        try:
            self.marks.cover(assigned_all)  # before a reader can be given these offsets
            if any(c for _, c in chunks):  # (a producer's duplicates alone write nothing)
                self._write_chunks([c for _, c in chunks])
        except OSError as exc:
            self.producers.undo(reversed(sequenced))
            self.index.unassign(reversed(assigned_all))
            err: StoreError = (
                StoreFullError()
                if exc.errno == errno.ENOSPC
                else StoreError(f"commitlog write failed: {exc}")
            )
            if isinstance(err, StoreFullError):  # every append until space is freed
                _full.note(f"appends refused: {exc}")
            else:
                log.error("append of %d requests failed: %s", len(accepted), exc)
            for req in accepted:
                req.future.set_exception(err)
            return []
        msgs = [m for req in accepted for m in req.new()]
        self._dispatch(msgs)
        self.stats["batches"] += 1
        self.stats["appends"] += len(accepted)
        self.stats["messages"] += len(msgs)
        return accepted

    def _write_batch_engine(self, batch: list[_Append]) -> list[_Append]:
        """`_write_batch` through the engine: the producers' sequences are checked here,
        the offsets, records and writes are the engine's. Requests of one producer to
        one topic go in separate engine appends, each checked against the one before."""
        now = _now_ms()
        accepted: list[_Append] = []
        chunk: list[tuple[_Append, list[tuple]]] = []
        keys: set[tuple[str, str]] = set()
        for req in batch:
            key = None if req.stamp is None else (req.stamp.producer, req.stamp.topic)
            if key is not None and key in keys:
                accepted += self._engine_append(chunk, now)
                chunk, keys = [], set()
            try:
                queues = self._plan(req)
                rows = []
                for msg, qs in zip(req.new(), queues, strict=True):
                    if msg.mark and req.stamp is None:
                        msg.mark = 0  # read from the log and appended again: not a producer's
                    body = msg.body if type(msg.body) is bytes else bytes(msg.body)
                    rows.append((msg.born_ts, msg.qos, msg.retain, msg.client_id, msg.topic,
                                 msg.key, record.stored_properties(msg), body, qs, msg.mark))
            except Exception as exc:  # one bad request must not sink the batch
                req.future.set_exception(exc)
                continue
            if key is not None:
                keys.add(key)
            chunk.append((req, rows))
        accepted += self._engine_append(chunk, now)
        with self._dispatch_lock:
            try:
                self._drain_locked()  # the index holds them (and what came before) before the acks
            except Exception:  # noqa: BLE001 - the records are in the log; recovery indexes them
                log.exception("dispatch after an append failed")
            if self._own:  # what a drain took before they were known here
                for req in accepted:
                    for m in req.new():
                        self._own.pop(m.phys_offset, None)
        self.stats["batches"] += 1
        self.stats["appends"] += len(accepted)  # (their messages count as they are taken)
        return accepted

    def _announce(self, written: list[_Append]) -> None:
        """Tell readers what a batch appended (`on_dispatched`), then settle its futures:
        outside the write lock, so that what readers do (a gateway writing to its
        subscribers' sockets) never holds up the next append or fsync."""
        if not written:
            return
        new = [m for req in written for m in req.new()]
        if self.engine is not None:
            new = []  # the dispatch told them already, in log order
        if self.on_dispatched and new:  # before the acks: readers hear of it at once
            try:
                self.on_dispatched(new)
            except Exception:
                log.exception("on_dispatched callback failed")
        for req in written:
            if req.plan is not None and req.plan.skip:
                req.future.set_result(self._stored_again(req))
            else:
                req.future.set_result(req.messages)

    def _stored_again(self, req: _Append) -> list[Message]:
        """A producer's request whose first messages the log holds already: those as the
        log holds them (their original offsets), then the ones appended now. Stored
        messages older than the appends the producers' table keeps come back as they
        were sent, with no offsets (phys_offset -1)."""
        plan = req.plan
        assert plan is not None
        dups: list[Message] = []
        for start, end, first, count in plan.stored or ():
            try:
                held = list(self.scan(start, end))[first:first + count]
            except (KeyError, CorruptRecord):  # removed by retention meanwhile
                held = []
            dups.extend(held)
        if len(dups) != plan.skip:
            dups = req.messages[:plan.skip]
            for m in dups:
                m.phys_offset, m.queues = -1, []
        return dups + req.new()

    def _write_chunks(self, chunks: list[list[bytes]], roll_first: bool = False) -> None:
        """Write each chunk to its segment (a new chunk = a roll; `roll_first`: the first
        chunk too); undo everything on error. The one write path of the log: a master's
        appends and a replica's copies of them."""
        with self._tail_lock:
            start_pos = self._write_pos
            start_segments = len(self._segments)
            try:
                for i, parts in enumerate(chunks):
                    if i > 0 or roll_first:
                        self._roll()
                    data = b"".join(parts)
                    view = memoryview(data)
                    while view:
                        n = os.write(self._wfd, view)
                        view = view[n:]
                    self._write_pos += len(data)
                    self.stats["bytes_written"] += len(data)
                if self.flush_mode == "sync":
                    self._fsync_tail()
                else:
                    self._dirtied(start_pos)
            except OSError:
                self._undo_write(start_pos, start_segments)
                raise

    def _dirtied(self, before: int) -> None:
        """async: the log grew from `before`; tell the flusher that its interval starts
        now, or that enough bytes are dirty to fsync at once."""
        if not self._flush_due:
            self._flush_due = True
            self._dirty_since = time.monotonic()
            self._requests.put(_WAKE)
        elif self._write_pos - self._flushed >= self.flush_bytes > before - self._flushed:
            self._requests.put(_WAKE)

    def _undo_write(self, start_pos: int, start_segments: int) -> None:
        """Cut the log back to `start_pos` after a failed write (e.g. disk full)."""
        try:
            while len(self._segments) > start_segments:
                seg = self._segments[-1]
                self._update_segments(lambda segs: segs[:-1])
                seg.doom()
            active = self._segments[-1]
            os.close(self._wfd)
            os.truncate(active.path, start_pos - active.base)
            self._wfd = os.open(active.path, os.O_WRONLY | os.O_APPEND)
            self._write_pos = start_pos
            self._flushed = min(self._flushed, start_pos)
        except OSError as exc:  # cannot even restore the tail: stop taking writes
            self._failed = exc
            log.critical("commitlog cannot restore its tail after a failed write: %s", exc)

    def _roll(self) -> None:
        os.fsync(self._wfd)  # a closed segment is always durable
        os.close(self._wfd)
        self._flushed = self._write_pos
        seg = Segment(self.dir / segment_name(self._write_pos), self._write_pos)
        # The new file's directory entry must be durable before anything in it is acked:
        # fdatasync of the file alone does not persist its name (power loss, --flush sync).
        fsync_dir(self.dir)
        self._update_segments(lambda segs: (*segs, seg))
        self._wfd = os.open(seg.path, os.O_WRONLY | os.O_APPEND)

    def _fsync_tail(self) -> None:
        """fsync what was written so far. The flusher thread runs this beside inline
        appends: it takes the tail under the lock, but syncs a duplicate of the fd outside
        it, so an append never waits for the disk (and a roll may close the original)."""
        if self.engine is not None:
            self._fsync_engine()
            return
        with self._write_lock:
            if self._flushed == self._write_pos or self._wfd < 0:
                return  # (-1: the engine took the tail meanwhile; the next round syncs it)
            pos = self._write_pos
            fd = os.dup(self._wfd)
            self._flush_due = False  # a write after this point needs another fsync
            due = time.monotonic() - self._last_checkpoint >= 1.0
            # The producers' table as of `pos`, saved once `pos` is durable.
            snap = self.producers.snapshot() if due and self.producers.dirty else None
        try:
            fdatasync(fd)
        except OSError as exc:
            # After a failed fsync the page cache state is unknown (fsyncgate): stop.
            self._failed = exc
            log.critical("fsync failed, commitlog stops taking writes: %s", exc)
            raise
        finally:
            os.close(fd)
        self.stats["fsyncs"] += 1
        self._flushed = max(self._flushed, pos)
        if due:
            self._write_checkpoint()
        if snap is not None:
            self._save_producers(pos, snap)

    def _fsync_engine(self) -> None:
        """`_fsync_tail` with the engine writing: its fdatasync, outside every lock."""
        with self._write_lock:  # between this process's appends: the producers' table
            engine = self.engine  # (a group's master stepping down hands it back)
            if engine is None:
                return
            with self._dispatch_lock:  # fits the log up to `pos`
                self._flush_due = False
            pos = engine.write_pos
            due = time.monotonic() - self._last_checkpoint >= 1.0
            native: tuple[bool, list] = (False, [])
            if due and self.native_sequences is not None:
                # After `pos` was read: every native append written before it is in them.
                native = self.native_sequences()
            dirty = self.producers.dirty or native[0]
            due = due and (self._checkpointed != engine.flushed or dirty)
            if self._flushed >= pos and not due:
                return
            # A replica's native copy: the table follows the dispatch, behind `pos`;
            # recovery reads on from the snapshot before (close saves one at the end).
            snap = (self._snapshot_with(native[1]) if due and dirty and not self.copying
                    else None)
        if self._flushed < pos:
            try:
                flushed = engine.flush()
            except (OSError, ValueError) as exc:
                if self.engine is not engine:
                    return  # stopped meanwhile: it synced its tail as it stopped
                if isinstance(exc, ValueError):
                    raise
                self._failed = exc
                log.critical("fsync failed, commitlog stops taking writes: %s", exc)
                raise
            self.stats["fsyncs"] += 1
            self._flushed = max(self._flushed, flushed)
        else:  # sync mode: the engine synced each append
            with contextlib.suppress(ValueError):  # (unless stopped meanwhile)
                self._flushed = max(self._flushed, engine.flushed)
        if due:
            self._write_checkpoint()
        if snap is not None:
            self._save_producers(pos, snap)

    def _snapshot_with(self, native: list) -> tuple[dict[producers.Key, producers.Entry],
                                                    producers.Key | None]:
        """The producers' table with the sequences the native server holds (theirs are
        newer than the table's: it took them back, if at all, when they were given up)."""
        entries, open_key = self.producers.snapshot()
        for pid, seen, batches in native:
            entries[(pid, producers.PUBLISHES)] = (seen, tuple(tuple(b) for b in batches))
        return entries, open_key

    def _save_producers(self, offset: int,
                        snap: tuple[dict[producers.Key, producers.Entry],
                                    producers.Key | None]) -> None:
        """The producers' table as of log offset `offset` (written and durable by then):
        recovery reads it and the records after it, not the whole log."""
        tmp = self.dir / (PRODUCERS_FILE + ".tmp")
        try:
            tmp.write_bytes(producers.dump(offset, snap))
            os.replace(tmp, self.dir / PRODUCERS_FILE)
        except OSError as exc:  # the next one may do; recovery reads more records
            log.warning("producers' snapshot not written: %s", exc)

    def _rebuild_producers(self, end: int) -> int:
        """The producers' table as of log offset `end` (a record boundary): the snapshot,
        if it is of an offset at or before `end`, and the records after it; without one
        (a store that never had one, a cut below it), every segment that holds a
        producer's record. Returns the records read."""
        table = self.producers
        start: int | None = None
        try:
            start = producers.load(table, (self.dir / PRODUCERS_FILE).read_bytes())
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:
            log.warning("producers' snapshot unreadable (%s): rebuilt from the log", exc)
        if start is not None and (start > end or (
                start > self.min_offset and not self._at_record(start))):
            start = None
        if start is None:
            table.clear()
        read = 0
        for seg in self._segments:
            lo = max(seg.base, self.min_offset if start is None else start)
            if seg.end <= lo or lo >= end:
                continue
            if start is None and table._open is None and not _holds_producers(seg):
                continue  # no producer's record in it: nothing to look at
            if not seg.acquire():
                continue
            try:
                for msg in self._scan_segment(seg, lo, end):
                    table.observe((msg,))
                    read += 1
            finally:
                seg.release()
        if read or start != end:
            self._save_producers(end, table.snapshot())
        table.dirty = False
        return read

    def _write_checkpoint(self) -> None:
        self._last_checkpoint = time.monotonic()
        self._checkpointed = self._flushed
        tmp = self.dir / (CHECKPOINT_FILE + ".tmp")
        tmp.write_bytes(orjson.dumps({"flushed": self._flushed, "ts": _now_ms()}))
        os.replace(tmp, self.dir / CHECKPOINT_FILE)

    def _dispatch(self, msgs: list[Message]) -> None:
        """Index entries for `msgs` (and any earlier batch whose dispatch failed)."""
        pending = self._undispatched + msgs
        try:
            self._index_write(pending)
            self._undispatched = []
        except Exception:
            # The records are safe in the log; the index catches up on the next batch
            # or, at worst, on recovery.
            log.exception("dispatch of %d messages failed; will retry", len(pending))
            self._undispatched = pending

    def _index_write(self, msgs: list[Message]) -> int:
        if not msgs:
            return 0
        last = msgs[-1]
        return self.index.write_messages(msgs, last.phys_offset + last.size)

    # -- segments ---------------------------------------------------------------------
    def _set_segments(self, segs: tuple[Segment, ...]) -> None:
        # Copy-on-write: readers on other threads see either the old or the new tuple.
        self._segments = segs
        self._bases = tuple(s.base for s in segs)

    def _update_segments(self, change: Callable[[tuple[Segment, ...]], tuple[Segment, ...]]
                         ) -> None:
        """Read, change and set the segment list as one step: the writer (roll, undo) and
        retention (a worker thread) both change it, and one's change must not undo the
        other's."""
        with self._segments_lock:
            self._set_segments(change(self._segments))

    def _segment_for(self, phys_offset: int) -> Segment | None:
        segs, bases = self._segments, self._bases
        i = bisect.bisect_right(bases, phys_offset) - 1
        if i < 0 or phys_offset >= self._write_pos:
            return None
        return segs[i]

    def _scan_segment(self, seg: Segment, start: int, end: int) -> Iterator[Message]:
        """The records of `seg` from `start` (a record start) to `end`, verified; a
        damaged one is stepped over (`_step_over`), the records after it are read."""
        mm = seg.map()
        if mm is None:
            return
        try:
            pos = start - seg.base
            limit = min(len(mm), end - seg.base)
            while pos < limit:
                try:
                    msg = record.decode(mm, pos, seg.base + pos)
                except Exception as exc:  # noqa: BLE001 - whatever a decoder bug raises
                    self._note_corrupt(seg.base + pos, exc)
                    written = min(len(mm), self._write_pos - seg.base)
                    pos = self._step_over(mm, pos, written, seg.base, exc)
                    continue
                yield msg
                pos += msg.size
        finally:
            mm.close()

    def _step_over(self, buf: mmap.mmap, rel: int, limit: int, base: int,
                   exc: Exception) -> int:
        """Where the next record starts after the damaged bytes at `rel` of a mapped
        segment (based at `base`, written up to `limit`), the range between listed as
        damaged."""
        end = self._next_record(buf, rel, limit, base)
        if end <= rel:  # (nothing written past it)
            return limit
        self.damage.add(base + rel, base + end, str(exc), memoryview(buf)[rel:end])
        return end

    def _next_record(self, buf: mmap.mmap | bytes, rel: int, limit: int, base: int) -> int:
        """The first record start after the damaged bytes at `rel` (relative to `base`,
        within `limit`), or `limit`: the end of a range known to be damaged, else the
        first record that checks and that the index knows, or (where it does not cover
        the log yet) that more records follow (record.next_start)."""
        known = self.damage.containing(base + rel)
        if known is not None:
            return min(limit, known[1] - base)
        covered = self.index.checkpoint()

        def trusted(at: int, msg: Message) -> bool | None:
            if base + at < covered and (msg.queues or msg.key):
                return self.index.holds(base + at, msg.queues, msg.key)
            return None

        return record.next_start(buf, rel, limit, trusted)

    def past_damage(self, pos: int) -> int:
        """`pos` (a record start) if a record that checks starts there or the log ends
        there; else where the next one starts after the damaged bytes (listed)."""
        if pos >= self._write_pos or self._segment_for(pos) is None:
            return pos
        return self.skip_damaged(pos)

    def skip_damaged(self, pos: int) -> int:
        """For a reader that walks the log: where the next record starts after bytes at
        `pos` that are not one (the end of its segment when none does). Counted."""
        seg = self._segment_for(pos)
        if seg is None or not seg.acquire():
            return pos + 1
        try:
            mm = seg.map()
            if mm is None:
                return seg.end
            try:
                rel = pos - seg.base
                why = CorruptRecord("does not check")
                try:
                    record.decode(mm, rel, pos)
                    return pos  # it does, now: the caller read it torn
                except CorruptRecord as exc:
                    why = exc
                self._note_corrupt(pos, why)
                limit = min(len(mm), self._write_pos - seg.base)
                end = self._next_record(mm, rel, limit, seg.base)
                self.damage.add(pos, seg.base + end, str(why), memoryview(mm)[rel:end])
                return seg.base + end
            finally:
                mm.close()
        finally:
            seg.release()

    # -- recovery ---------------------------------------------------------------------
    def _load_segments(self) -> None:
        segs = [
            Segment(p, int(p.name))
            for p in sorted(self.dir.iterdir())
            if p.is_file() and is_segment_name(p.name)
        ]
        if not segs:
            segs = [Segment(self.dir / segment_name(0), 0)]
            fsync_dir(self.dir)
        self._set_segments(tuple(segs))

    def _read_checkpoint(self) -> int | None:
        try:
            return int(orjson.loads((self.dir / CHECKPOINT_FILE).read_bytes())["flushed"])
        except (OSError, ValueError, KeyError, TypeError, orjson.JSONDecodeError):
            return None

    def _recover(self) -> RecoveryReport:
        t0 = time.monotonic()
        self._load_segments()
        self.damage.load(self.min_offset)
        abort = self._read_abort()
        clean = abort is None
        ckpt = self._read_checkpoint()
        index_ckpt = self.index.checkpoint()
        if ckpt is None or self.full_verify:
            verify_from = self._segments[0].base  # no checkpoint: trust nothing
        else:
            seg = self._segment_for_any(min(ckpt, index_ckpt))
            verify_from = seg.base
        report = RecoveryReport(clean_shutdown=clean, verified_from=verify_from, end=verify_from)
        end = self._verify_from(verify_from, report)
        report.end = end
        self._write_pos = self._flushed = end
        last = self._segments[-1]
        self._wfd = os.open(last.path, os.O_WRONLY | os.O_APPEND)
        self._write_checkpoint()
        self._recover_index(index_ckpt, report)
        marks = self.marks.load()
        # Records lost, or damaged where the index had not taken their offsets yet.
        unindexed = any(end > index_ckpt for _, end, _ in self.damage.ranges())
        if marks and (report.truncated_at is not None or report.index_rebuilt or unindexed
                      or not clean and _page_cache_lost(abort)):
            report.marked_queues = self._floors_from_marks(marks)
        self.marks.open(marks)
        report.producer_records = self._rebuild_producers(end)
        report.seconds = time.monotonic() - t0
        level = logging.INFO if clean and report.truncated_at is None else logging.WARNING
        log.log(level, "commitlog recovered %s", report)
        return report

    def _read_abort(self) -> dict | None:
        """What the last run left in the abort file (None: it stopped cleanly); {} when
        it says nothing this code can read."""
        try:
            raw = (self.dir / ABORT_FILE).read_bytes()
        except FileNotFoundError:
            return None
        try:
            found = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return {}  # an older version's: its pid alone
        return found if isinstance(found, dict) else {}

    def _floors_from_marks(self, marks: dict[str, int]) -> int:
        """Start each queue at its high-water mark at least: records the log lost may
        have held offsets below it that readers were given. The queues raised."""
        floors = {q: m for q, m in marks.items() if m > self.index.max_offset(q)}
        if floors:
            self.index.set_floors(floors)
            log.warning("%d queues resume at their high-water marks: the records the log "
                        "lost may have held offsets up to there, and readers may have seen "
                        "them", len(floors))
        return len(floors)

    def _segment_for_any(self, offset: int) -> Segment:
        i = max(0, bisect.bisect_right(self._bases, offset) - 1)
        return self._segments[i]

    def _verify_from(self, start: int, report: RecoveryReport) -> int:
        """Walk records from `start`. Damaged bytes that records follow are listed as
        damaged and read around; damage that nothing valid follows in the last segment
        is a torn tail, where the log is cut."""
        segs = [s for s in self._segments if s.base >= start or s.end > start]
        for i, seg in enumerate(segs):
            pos = max(start, seg.base)
            mm = seg.map()
            try:
                rel = pos - seg.base
                size = len(mm) if mm else 0
                while rel < size:
                    try:
                        msg = record.decode(mm, rel, seg.base + rel)
                    except Exception as exc:  # noqa: BLE001 - whatever a decoder bug raises
                        if not isinstance(exc, CorruptRecord):
                            log.error("record at offset %d does not decode (%r): treated "
                                      "as corrupt", seg.base + rel, exc)
                        assert mm is not None
                        nxt = self._next_record(mm, rel, size, seg.base)
                        if nxt >= size and i == len(segs) - 1:  # nothing valid after it
                            self._truncate(seg, rel, [], exc, report)
                            return seg.base + rel
                        if self.damage.add(seg.base + rel, seg.base + nxt, str(exc),
                                           memoryview(mm)[rel:nxt]):
                            report.damaged += 1
                        rel = nxt
                        continue
                    rel += msg.size
                    report.records_verified += 1
            finally:
                if mm is not None:
                    mm.close()
            if i + 1 < len(segs) and segs[i + 1].base != seg.base + size:
                # A gap between segments: the next one cannot be trusted to follow on.
                self._truncate(seg, size, segs[i + 1 :], CorruptRecord("segment gap"), report)
                return seg.base + size
        return self._segments[-1].end

    def _truncate(
        self,
        seg: Segment,
        rel: int,
        later: list[Segment],
        why: Exception,
        report: RecoveryReport,
    ) -> None:
        """Cut `seg` at `rel`, keeping the cut bytes and later segments in quarantine."""
        self.damage.forget_from(seg.base + rel)
        qdir = self.dir / QUARANTINE_DIR
        qdir.mkdir(exist_ok=True)
        tail_size = seg.size() - rel
        if tail_size:
            tail = seg.pread(tail_size, rel)
            (qdir / f"{segment_name(seg.base + rel)}.tail").write_bytes(tail)
        os.truncate(seg.path, rel)
        report.truncated_at = seg.base + rel
        report.truncated_bytes = tail_size
        for other in later:
            report.truncated_bytes += other.size()
            other.close()
            os.replace(other.path, qdir / other.path.name)
            report.quarantined.append(other.path.name)
        self._set_segments(tuple(s for s in self._segments if s not in later))
        # Segments moved out must not come back after a power loss, where new records
        # may follow the cut: make the moves durable before anything is appended.
        fsync_dir(qdir)
        fsync_dir(self.dir)
        log.warning(
            "commitlog cut at offset %d (%s): %d bytes moved to %s",
            seg.base + rel,
            why,
            report.truncated_bytes,
            qdir,
        )

    def _recover_index(self, index_ckpt: int, report: RecoveryReport) -> None:
        """Re-dispatch what the index lost; rebuild it whole if it points past the end."""
        start = max(index_ckpt, self.min_offset)
        old_ends: dict[str, int] = {}
        if index_ckpt > self._write_pos or not self._at_record(start):
            log.warning(
                "index covers %d, beyond log end %d or not at a record: rebuilding",
                index_ckpt, self._write_pos
            )
            old_ends = self.index.queue_ends()  # what readers may have seen
            self.index.clear()
            report.index_rebuilt = True
            start = self.min_offset
        if index_ckpt < self.min_offset:
            # An index that was lost (it is derived data), or is older than the log's
            # start, rebuilt from a log that retention trimmed: a queue whose every record
            # is gone left nothing to rebuild its end from, and its readers may stand
            # anywhere up to that end. Each offset was given to one record of at least
            # HEADER_SIZE bytes before min_offset, which bounds every such end; queues with
            # no entry and no floor start there, not at 0. (Retention flushes the index
            # before it deletes a segment, so a lost index is what leads here.)
            floor = -(-self.min_offset // record.HEADER_SIZE)
            self.index.set_default_floor(floor)
            log.warning("index rebuilt from a trimmed log: queues with no record left "
                        "start at offset %d", floor)
        self.index.forget_allocations()
        batch: list[Message] = []
        for msg in self.scan(start):
            batch.append(msg)
            if len(batch) >= REDISPATCH_BATCH:
                report.redispatched += len(batch)
                self._index_write(batch)
                batch = []
        report.redispatched += len(batch)
        self._index_write(batch)
        if report.redispatched:
            self.index.flush()
        floors = {q: end for q, end in old_ends.items() if end > self.index.max_offset(q)}
        if floors:
            self.index.set_floors(floors)
            log.warning("%d queues keep a gap where the cut records were: their offsets are "
                        "not given again", len(floors))

    def _at_record(self, offset: int) -> bool:
        """Whether a whole, valid record starts at `offset`, or a damaged range (read
        around), or the log ends there."""
        if offset >= self._write_pos:
            return True
        seg = self._segment_for(offset)
        mm = seg.map() if seg is not None else None
        if mm is None:
            return False
        try:
            record.decode(mm, offset - seg.base, offset)
            return True
        except CorruptRecord:
            known = self.damage.containing(offset)
            return known is not None and known[0] == offset
        finally:
            mm.close()

    # -- background verification ---------------------------------------------------------
    def _verify_old(self, segs: list[Segment]) -> None:
        """Verify the segments start-up did not (those before the checkpoint's), at
        `verify_bytes_per_s`: damaged ranges are listed, counted and read around from
        then on (readers find them too, when they come first)."""
        setthreadtitle("commitlog-verify")
        t0 = time.monotonic()
        done = records = 0
        found = self.damage.count
        for seg in segs:
            if self._verify_stop.is_set():
                return
            if not seg.acquire():
                continue  # retention removed it meanwhile
            try:
                n, size = self._verify_segment(seg, t0, done)
            finally:
                seg.release()
            records += n
            done += size
            self.stats["verify_pending_bytes"] = max(0, self.stats["verify_pending_bytes"] - size)
        log.info("background verification of the log done: %d records in %d segments "
                 "(%d bytes) in %.1f s, %d damaged ranges found", records, len(segs), done,
                 time.monotonic() - t0, self.damage.count - found)

    def _verify_segment(self, seg: Segment, t0: float, before: int) -> tuple[int, int]:
        """Each record's frame and CRC, at the verification's rate: (records, bytes)."""
        mm = seg.map()
        if mm is None:
            return 0, 0
        view = memoryview(mm)
        head, crc32 = record.FRAME.unpack_from, zlib.crc32
        try:
            size = len(mm)
            rel = records = 0
            paused_at = 0
            while rel < size and not self._verify_stop.is_set():
                ok = size - rel >= record.HEADER_SIZE
                if ok:
                    magic, total, crc = head(mm, rel)
                    ok = (magic in (record.MAGIC, record.MAGIC_WIDE)
                          and record.HEADER_SIZE <= total <= size - rel
                          and crc32(view[rel + 12:rel + total]) == crc)
                if not ok:
                    exc: Exception = CorruptRecord("does not check")
                    try:
                        record.decode(mm, rel, seg.base + rel)
                    except CorruptRecord as why:
                        exc = why
                    rel = self._step_over(mm, rel, size, seg.base, exc)
                    continue
                rel += total
                records += 1
                self.stats["verified_bytes"] += total
                if rel - paused_at >= VERIFY_CHUNK:
                    paused_at = rel
                    ahead = (before + rel) / self.verify_bytes_per_s - (time.monotonic() - t0)
                    if ahead > 0:
                        self._verify_stop.wait(ahead)
            return records, size
        finally:
            view.release()
            mm.close()

    # -- retention --------------------------------------------------------------------
    def enforce_retention(
        self, retention_hours: float | None = None, retention_bytes: int | None = None
    ) -> list[int]:
        """Delete the oldest whole segments past the age or size limit, with their index
        entries. The active segment is never deleted. Returns the deleted bases."""
        removed: list[tuple[Segment, int]] = []
        now = time.time()
        while len(self._segments) > 1:
            oldest = self._segments[0]
            total = self._write_pos - oldest.base
            too_big = retention_bytes is not None and total > retention_bytes
            age_h = (now - os.stat(oldest.path).st_mtime) / 3600
            too_old = retention_hours is not None and age_h > retention_hours
            if not (too_big or too_old):
                break
            trimmed = self._remove_segment(oldest)
            if trimmed is None:
                break
            removed.append((oldest, trimmed))
        if not removed:
            return []
        # The index is written without a WAL, and re-dispatch from the log is what brings
        # back what it had not flushed when the process died: these segments are the log
        # of their records. Make the index durable (their entries gone, their queues'
        # floors, the entries of any record not yet flushed) before they go.
        try:
            self.index.flush()
        except Exception:
            log.exception("retention: index flush failed; %d segments stay on disk until "
                          "the next start", len(removed))
            return []
        self.damage.forget_below(self.min_offset)
        for seg, trimmed in removed:
            gone = seg.doom()
            log.info(
                "retention: segment %s removed%s (%d queues trimmed)",
                seg.path.name,
                "" if gone else " once its readers finish",
                trimmed,
            )
        return [seg.base for seg, _ in removed]

    def _remove_segment(self, seg: Segment) -> int | None:
        """Take `seg` out of the list and its entries out of the index (the file is for
        the caller to delete); the number of queues trimmed, or None if it is the active
        segment by now (the writer's undo of a failed roll makes the one before it active
        again)."""
        ends: dict[str, int] = {}
        keys: list[tuple[str, int]] = []
        pos = seg.base
        try:
            for msg in self._scan_segment(seg, seg.base, seg.end):
                for name, off in msg.queues:
                    ends[name] = off + 1
                if msg.key:
                    keys.append((msg.key, msg.phys_offset))
                pos = msg.phys_offset + msg.size
        except Exception as exc:  # noqa: BLE001 - old segments are not verified at start
            # The segment goes anyway (it is past retention). Entries of the records from
            # here on stay in the index; readers skip them (their offset is below the log's
            # minimum), and they keep those queues' ends where they were.
            log.warning("retention: segment %s does not decode from offset %d (%s); it is "
                        "removed with the entries of the records before", seg.path.name,
                        pos, exc)
        removed = False

        def drop(segs: tuple[Segment, ...]) -> tuple[Segment, ...]:
            nonlocal removed
            if len(segs) < 2 or segs[-1] is seg or seg not in segs:
                return segs
            removed = True
            return tuple(s for s in segs if s is not seg)

        with self._tail_lock:  # not amid a batch that may roll back into this segment
            self._update_segments(drop)  # no new reader finds it from here on
        if not removed:
            return None
        self.index.delete_below(ends, keys)
        return len(ends)

    # -- replication (store.replication) ----------------------------------------------
    def read_raw(self, offset: int, max_bytes: int) -> tuple[bytes, int]:
        """The log's bytes from `offset` (a record boundary) as a replica copies them:
        whole records of one segment, at most `max_bytes` (one record at least), and the
        base of their segment (a replica rolls where the master rolled)."""
        end = self._write_pos
        seg = self._segment_for(offset)
        if seg is None or offset >= end:
            return b"", offset
        if not seg.acquire():
            raise KeyError(f"offset {offset} is not in the log (min {self.min_offset})")
        try:
            rel = offset - seg.base
            avail = min(end, seg.base + seg.size()) - offset
            data = seg.pread(min(avail, max_bytes), rel)
            pos = 0
            while len(data) - pos >= record.FRAME.size:
                _, size = record.frame_length(data, pos)
                if pos + size > len(data):
                    break
                pos += size
            if pos == 0 and data:  # one record larger than max_bytes: send it whole
                _, size = record.frame_length(data, 0)
                return seg.pread(size, rel), seg.base
            return data[:pos], seg.base
        finally:
            seg.release()

    def write_raw(self, offset: int, data: bytes, base: int) -> list[Message]:
        """A replica writes the master's bytes at the master's offset (whole records),
        rolling to a new segment where the master's starts, and dispatches them to its own
        index as recovery does. Returns the records."""
        self._refuse_engine("a replica's copy")
        with self._write_lock:
            if self._closed or self._failed:
                raise StoreClosedError(f"commitlog unavailable: {self._failed or 'closed'}")
            if offset != self._write_pos:
                raise ValueError(f"replica log ends at {self._write_pos}, not {offset}")
            msgs, pos = [], 0
            while pos < len(data):
                msg = record.decode(data, pos, offset + pos)
                msgs.append(msg)
                pos += msg.size
            # The master's segment starts here: roll so that offsets map to the same files.
            roll = base == offset and self._segments[-1].base != offset and offset > 0
            self._write_chunks([[data]], roll_first=roll)  # on error the log is as it was
            self.producers.observe(msgs)  # the master's sequences travel with its records
            self._dispatch(msgs)
            self.stats["messages"] += len(msgs)
            if self.on_dispatched and msgs:
                try:
                    self.on_dispatched(msgs)
                except Exception:
                    log.exception("on_dispatched callback failed")
            return msgs

    def repair_index(self) -> bool:
        """Rebuild the index from the log if it covers more than the log holds: a
        replica's start-over cut short between its index and its log (see restart_at)
        by a change of master, as recovery does after a crash there. True if it did."""
        self._refuse_engine("a repair of a replica's index")
        with self._write_lock:
            ckpt = self.index.checkpoint()
            if ckpt <= self._write_pos:
                return False
            report = RecoveryReport(clean_shutdown=True, verified_from=ckpt,
                                    end=self._write_pos)
            self._recover_index(ckpt, report)
            return True

    def restart_at(self, offset: int) -> int:
        """Start over, empty, at `offset`: a replica whose whole log is older than what
        its master still holds (retention there removed the bytes that would follow it)
        takes the master's log from its start. Everything here is past the group's
        retention, so it is deleted, not quarantined. Returns the bytes dropped. The
        caller resets the index first (see ConsumeQueueIndex.reset)."""
        self._refuse_engine("a replica's start-over")
        with self._write_lock, self._tail_lock:
            if offset <= self._write_pos:
                raise ValueError(f"cannot restart at {offset}, not past the log end "
                                 f"{self._write_pos}")
            dropped = self._write_pos - self.min_offset
            self.damage.forget_from(0)
            os.close(self._wfd)
            # Files go before the new one is made: a crash in between leaves no log, or
            # the new one alone, never a log with a hole in it.
            for seg in self._segments:
                seg.doom()  # readers keep their open file until they finish
                seg.path.unlink(missing_ok=True)
            fsync_dir(self.dir)
            seg = Segment(self.dir / segment_name(offset), offset)
            fsync_dir(self.dir)
            self._set_segments((seg,))
            self._wfd = os.open(seg.path, os.O_WRONLY | os.O_APPEND)
            self._write_pos = self._flushed = offset
            self._undispatched = []
            self._write_checkpoint()
            # The sequences of the old log stay (a prefix of the master's): the records
            # between its end and `offset` are gone, the producers they hold with them.
            self.producers._open = None
            self._save_producers(offset, self.producers.snapshot())
            return dropped

    def truncate_to(self, offset: int) -> int:
        """Cut the log at `offset` (a record boundary): a tail the group never
        acknowledged, where this node's log forked from the master's. The cut bytes go to
        quarantine, their index entries are removed. Returns the bytes cut."""
        self._refuse_engine("a cut of the log")
        with self._write_lock, self._tail_lock:
            if offset >= self._write_pos:
                return 0
            if offset < self.min_offset:
                raise ValueError(f"cannot cut at {offset}, before the log's start")
            cut = list(self.scan(offset))
            seg = self._segment_for_any(offset)
            later = [s for s in self._segments if s.base > seg.base]
            os.close(self._wfd)
            report = RecoveryReport(clean_shutdown=True, verified_from=offset, end=offset)
            self._truncate(seg, offset - seg.base, later, ValueError("log forked"), report)
            self._write_pos = offset
            self._flushed = min(self._flushed, offset)
            self._wfd = os.open(self._segments[-1].path, os.O_WRONLY | os.O_APPEND)
            self._write_checkpoint()
            self.index.remove_entries(
                [q for m in cut for q in m.queues],
                [(m.key, m.phys_offset) for m in cut if m.key], offset)
            if any(m.mark for m in cut):  # sequences of records cut: as of the cut
                self._rebuild_producers(offset)
            # The index has no WAL: unflushed, a crash would bring back its old checkpoint
            # and entries, pointing into bytes the master's records are about to replace
            # (a restart then found its checkpoint inside a record and stopped).
            self.index.flush()
            return report.truncated_bytes
