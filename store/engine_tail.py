"""The CommitLog's tail in the hands of the native engine (`lightgate serve` with
LIGHTGATE_NATIVE=1): the part of `store.commitlog.CommitLog` that starts the engine at
the tail recovery left, appends through it, feeds the index from its appends in log
order, and stops it.

The engine (serving.lightgate_native.Engine) is then the log's one writer: the MQTT publishes of
the connections it carries and every append of this process's go through it, so the
queue offsets it gives out inside the append never collide, and it leaves each append's
index rows in log order. One dispatch path at a time (`_dispatch_lock`) takes them into
the index and `on_dispatched`: a thread the engine wakes for its own publishes, an
appender of this process's before its ack, a reader of the index before it reads
(`catch_up`). The CommitLog keeps what is Python's: the idempotent producers' checks,
recovery, reads, retention, the flusher and the checkpoint.

A drain costs Python the same few calls however many messages it takes, except for the
messages Python holds or reads: the engine hands over one `DispatchBatch` that writes
the index's entries (one put per run, made natively), names the queues that grew with
their new ends, and carries the records of the queues Python's readers read (they tell
the engine which: `want_queues`), so that nothing is read back from the log.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from setproctitle import setthreadtitle

from lightqueue.index import RUN_MAX
from serving import plane
from serving.rate_limited_log import RateLimitedLog
from store import record
from store.common import StoreError, StoreFullError
from store.record import Message
from store.segment import Segment, fdatasync, segment_name

log = logging.getLogger("lightgate.store.commitlog")
_refused = RateLimitedLog(log, logging.ERROR)  # a full disk refuses every append

# After the engine says it appended, the dispatcher waits this long before it takes the
# rows: at a few thousand messages a second, a wake-up of the interpreter per message
# cost more than the message. Native subscribers are not kept waiting (the engine
# delivers to them itself); readers of the index dispatch first (`catch_up`).
DISPATCH_COALESCE_S = 0.005
# ... and this long when nobody in Python heard of the last batch (`on_dispatched` said
# False: every reader of those queues is a native subscriber): the index and the
# counters may lag that much, a reader of the index dispatches first anyway, and one
# that starts reading (`catch_up`) cuts the wait short; the flusher does not wait for
# the dispatch, and none is taken while a reader waits (`waiting`). A drain costs ~220
# us of interpreter however few rows it takes: at 2,000 msg/s from native publishers to
# native subscribers, 5 ms batches cost 18 us of CPU per message, 50 ms ones 2.7 us, 250
# ms ones 0.7 us. Longer is cheaper, but a subscriber in Python (TLS, WebSocket) waits
# that long for the first message after a spell in which nobody in Python heard of any.
DISPATCH_LAZY_S = 0.1
# How much less the dispatch's thread weighs for the scheduler than the reactors' (a
# nice value: each step is ~1.25x less CPU share when cores are contended).
DISPATCH_NICE = 10
# Rows a drain takes from the engine at once: a dispatch far behind a flood (its readers
# want every body) holds that many in Python, not the whole lag. The engine paces native
# publishers once the lag passes its own budget (16,384 rows).
DRAIN_ROWS = 2048
# Tries of the engine's stop while another thread is inside a call of it, 10 ms apart.
STOP_TRIES = 200

# A message as the engine takes it (PyEngine.append_messages): born_ts, qos, retain,
# client_id, topic, key, properties (as stored), body, queues, marks.
Row = tuple[Any, ...]
# Requests (store.commitlog's _Append) with their messages as rows, for one engine append.
Chunk = list[tuple[Any, list[Row]]]


def _background() -> None:
    """Lower the calling thread's CPU priority (the dispatch is background work): on a
    machine whose cores the reactors share with other processes, a drain of thousands
    of rows held a core for milliseconds at once, and the messages the reactors were
    carrying meanwhile waited for it (the p99 of a 20,000 msg/s stream)."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), DISPATCH_NICE)


class EngineTail:
    """The engine's half of the CommitLog (a base of `CommitLog`, whose tail state it
    reads and moves: `_segments`, `_write_pos`, `_flushed`, the index, the flusher)."""

    dir: Path
    engine: Any
    marks: Any  # store.highwater.HighWater: the engine raises them through it
    # Told of each batch the dispatch takes: the messages whose bodies Python has (its
    # own appends, and the native publishes of queues its readers read: `want_queues`),
    # in log order, and every queue that grew with its end after the batch. False if
    # nobody heard. Unset: `on_dispatched` gets the messages.
    on_batch: Callable[[list[Message], dict[str, int]], bool | None] | None = None
    # Whether a reader in this process waits for new messages now (a long-polling PULL,
    # such as a Spark trigger waiting for the next reading): the dispatch takes no lazy
    # pause then. Told per batch is not enough: a batch nobody heard of, landing while
    # the reader waits, made the next one wait `DISPATCH_LAZY_S` too.
    waiting: Callable[[], bool] | None = None

    def _init_engine_tail(self) -> None:
        self.engine = None  # serving.lightgate_native.Engine, once start_engine handed it the tail
        self._dispatch_lock = threading.Lock()
        self._draining: int | None = None  # the thread in `_drain`, under that lock
        self._own: dict[int, Message] = {}  # this process's appends, by position, until dispatched
        self._dispatcher: threading.Thread | None = None
        self._dispatch_stop = False
        self._engine_stopped = False
        self._unwritten: list[tuple[list, list]] = []  # index runs a failed write left
        # The engine writes a replica's copy (store.replication.native_copy): the
        # records it hands over are idempotent producers', for the producers' table.
        self.copying = False

    def start_engine(self, io_threads: int = 1, default_partitions: int = 1) -> Any:
        """Hand the tail to a native engine (serving.lightgate_native.Engine) after `open`: from
        here on it writes every append, this process's and its native connections', and
        a dispatcher thread feeds the index from its appends in log order. Returns it."""
        if plane.NATIVE is None:
            raise RuntimeError("the native data plane is not installed")
        if self._closed or self.engine is not None:
            raise RuntimeError("start_engine needs an open log without one")
        with self._write_lock, self._tail_lock:
            self._fsync_fd()
            active = self._segments[-1]
            engine = plane.NATIVE.Engine(
                str(self.dir), self.segment_size, active.base, self._write_pos,
                default_partitions, self.flush_mode == "sync", max(1, io_threads),
                self.index.max_offset, self.marks)
            os.close(self._wfd)
            self._wfd = -1
            self.engine = engine
        self._dispatcher = threading.Thread(target=self._dispatch_loop,
                                            name="commitlog-dispatch", daemon=True)
        self._dispatcher.start()
        return engine

    def _fsync_fd(self) -> None:
        if self._wfd >= 0 and self._flushed < self._write_pos:
            fdatasync(self._wfd)
            self._flushed = self._write_pos

    def catch_up(self) -> None:
        """Dispatch what the engine appended and the index does not hold yet: a reader
        of the index (a pull, history, a queue's end) calls this first, so that it never
        sees a position, or a subscriber's count, past what the index answers."""
        engine = self.engine  # (once: `hand_back` in another thread may clear it)
        if engine is not None:
            if not self._engine_stopped:  # (stopping in another thread: no hurry)
                engine.hurry()  # and the next batch without the lazy pause
            if self._draining == threading.get_ident():
                # Called back from this thread's own drain (a notify delivered inline
                # pulls): the index holds what it told of, and it tells of the rest.
                return
            self._drain()

    def undispatched(self) -> bool:
        """Whether the engine appended records that the index and the rings of recent
        messages may not hold yet (`catch_up` takes them): a native publish is answered
        once appended, before its dispatch. (Read in this order: a drain sets
        `_draining` before it takes rows and moves `_write_pos` before it tells the rings.)"""
        engine = self.engine
        if engine is None:
            return False
        try:
            appended = engine.write_pos
        except ValueError:  # stopping in another thread: what it left is not taken
            return True
        return appended > self._write_pos or self._draining is not None

    def _dispatch_loop(self) -> None:
        setthreadtitle("commitlog-dispatch")
        _background()
        engine = self.engine
        heard = True
        while not self._dispatch_stop:
            try:
                if engine.wait_dispatched(0.5):
                    if heard or (self.waiting is not None and self.waiting()):
                        time.sleep(DISPATCH_COALESCE_S)
                    else:  # cut short by a reader, or native publishers paced to us
                        engine.wait_hurry(DISPATCH_LAZY_S)
                    heard = self._drain()
                self._log_refused()
            except Exception:  # noqa: BLE001 - the thread must outlive one bad batch
                log.exception("commitlog dispatch failed")
                time.sleep(0.1)

    def _log_refused(self) -> None:
        """Say why native publishes were refused (a full disk): their publishers got a
        negative PUBACK (or, on 3.1.1, a closed connection), but the operator reads it
        here, as for Python's appends."""
        whys, batches = self.engine.take_refused()
        if batches:  # (a full disk refuses every one: said once in a while)
            _refused.note("appends of MQTT publishes failed: "
                          + "; ".join(dict.fromkeys(whys)))

    def _drain(self) -> bool:
        with self._dispatch_lock:
            if self.engine is None:  # handed back meanwhile, its last rows drained
                return False
            return self._drain_locked()

    def _drain_locked(self) -> bool:
        """The engine's appends since the last drain, in steps of at most `DRAIN_ROWS`
        (a dispatch far behind holds no more at once). Whether anyone heard of them.
        Under `_dispatch_lock`."""
        heard = False
        self._draining = threading.get_ident()
        try:
            while True:
                taken, step_heard = self._drain_step()
                heard = heard or step_heard
                if taken < DRAIN_ROWS:
                    return heard
        finally:
            self._draining = None

    def _drain_step(self) -> tuple[int, bool]:
        """Up to `DRAIN_ROWS` of the engine's appends into the index, then who waits for
        them (`on_batch`). How many were taken, and whether anyone heard of them."""
        batch = self.engine.take_batch(RUN_MAX, DRAIN_ROWS)
        if new_segments := batch.new_segments:
            segs = tuple(Segment(self.dir / segment_name(b), b) for b in new_segments)
            self._update_segments(lambda old: (*old, *segs))
        end = batch.end
        if end is None:
            return batch.taken, True
        # Every record the engine appended, this process's and the native plane's, is
        # taken here once: counted here (the native ones had no other place).
        self.stats["messages"] += batch.taken
        return batch.taken, self._dispatch_step(batch, end)

    def _dispatch_step(self, batch: Any, end: int) -> bool:
        self._write_index(batch, end)
        before = self._write_pos
        self._write_pos = end
        if not self._engine_stopped:
            self._flushed = max(self._flushed, self.engine.flushed)
        self.stats["bytes_written"] += end - before
        if self.flush_mode == "async":
            self._dirtied(before)
        try:
            done = self._messages(batch)
            if self.copying and done:  # as CommitLog.write_raw: sequences travel with
                self.producers.observe(done)  # the master's records
            if self.on_batch is not None:
                return self.on_batch(done, batch.grown()) is not False
            return bool(self.on_dispatched) and (
                not done or self.on_dispatched(done) is not False)
        except Exception:
            log.exception("on_dispatched callback failed")
            return True

    def _write_index(self, batch: Any, end: int) -> None:
        """The index entries of a drain (and of any before whose write failed: the
        records are safe in the log, and the next drain writes them again)."""
        self._unwritten.append(batch)
        try:
            for b in self._unwritten:
                self.index.write_batch(b, end)
            self._unwritten = []
        except Exception:
            log.exception("dispatch of %d runs failed; will retry",
                          sum(b.runs for b in self._unwritten))

    def _messages(self, batch: Any) -> list[Message]:
        """The batch's messages whose bodies Python has, in log order, made natively:
        this process's appends as their Messages (one a drain took before
        `_engine_append` knew of it comes without its body), the native publishes its
        readers read from the records the engine kept (none is read back)."""
        return batch.messages(Message, self._own, record.decode_properties)

    def _engine_append(self, chunk: Chunk, now: int
                       ) -> list[Any]:
        """One engine append of these requests; a request the engine cannot encode
        fails alone (the others go again), a failed write fails them all."""
        while chunk:
            flat = [row for _, rows in chunk for row in rows]
            try:
                done = self.engine.append_messages(flat, now) if flat else []
            except ValueError as exc:
                if len(exc.args) == 2 and isinstance(exc.args[0], int):
                    i, why = exc.args
                    chunk = self._fail_at(chunk, i, ValueError(why))
                    continue
                return self._one_by_one(chunk, now, exc)
            except OSError as exc:
                why = self.engine.failed
                if why is not None:
                    self._failed = StoreError(why)
                    log.critical("commitlog stops taking writes: %s", why)
                err: StoreError = (
                    StoreFullError()
                    if exc.errno == errno.ENOSPC
                    else StoreError(f"commitlog write failed: {exc}")
                )
                if isinstance(err, StoreFullError):
                    _refused.note(f"appends refused: {exc}")
                else:
                    log.error("append of %d requests failed: %s", len(chunk), exc)
                for req, _ in chunk:
                    req.future.set_exception(err)
                return []
            except (TypeError, OverflowError) as exc:  # a field no record can hold
                return self._one_by_one(chunk, now, exc)
            it = iter(done)
            own = self._own
            for req, _ in chunk:
                new = req.new()
                for msg in new:
                    phys, size, store_ts, queues = next(it)
                    msg.phys_offset, msg.size, msg.store_ts, msg.queues = (
                        phys, size, store_ts, queues)
                    own[phys] = msg
                if req.stamp is not None and new:
                    assert req.plan is not None
                    self.producers.appended(
                        req.stamp, req.stamp.seq + req.plan.skip, len(new),
                        new[0].phys_offset, new[-1].phys_offset + new[-1].size, now)
            return [req for req, _ in chunk]
        return []

    @staticmethod
    def _fail_at(chunk: Chunk, index: int, exc: Exception
                 ) -> Chunk:
        """The chunk without the request that holds flat row `index`, which fails."""
        for n, (req, rows) in enumerate(chunk):
            if index < len(rows):
                req.future.set_exception(exc)
                return chunk[:n] + chunk[n + 1:]
            index -= len(rows)
        return chunk

    def _one_by_one(self, chunk: Chunk, now: int,
                    exc: Exception) -> list[Any]:
        if len(chunk) == 1:
            chunk[0][0].future.set_exception(exc)
            return []
        out: list[Any] = []
        for item in chunk:
            out += self._engine_append([item], now)
        return out

    def _stop_engine(self) -> None:
        """Close with the engine: the dispatcher stops, the engine stops (its reactors
        and their connections, then an fsync of the tail), the rest is dispatched."""
        self._dispatch_stop = True
        self.engine.wake()
        if self._dispatcher is not None:
            self._dispatcher.join()
        self._engine_stopped = True
        try:
            self._flushed = self._stop_native()
        finally:
            with self._dispatch_lock:
                self._drain_locked()  # what the engine left: it hands it over once stopped

    def _stop_native(self) -> int:
        """The engine's stop, once no other thread is inside a call of it (the flusher's
        fsync, a reader's catch-up: the stop needs it to itself, and says "Already
        borrowed" meanwhile)."""
        for _ in range(STOP_TRIES):
            try:
                return int(self.engine.stop())
            except RuntimeError as exc:
                if "borrowed" not in str(exc):
                    raise
                time.sleep(0.01)
        return int(self.engine.stop())

    def hand_back(self) -> None:
        """Stop the engine and take its tail back for the Python writer (a store group's
        master stepping down: a replica's copy is Python's). Whatever the engine wrote
        is dispatched first; later appends go through the Python writer at its end."""
        if self.engine is None:
            return
        with self._write_lock:
            self._stop_engine()
            with self._tail_lock:
                self._wfd = os.open(self._segments[-1].path, os.O_WRONLY | os.O_APPEND)
                self.engine = None
        self._dispatcher = None
        self._dispatch_stop = False
        self._engine_stopped = False

    def _refuse_engine(self, what: str) -> None:
        if self.engine is not None:
            raise StoreError(f"{what} is not for a log the native engine writes (a store "
                             "group's node runs the Python writer)")
