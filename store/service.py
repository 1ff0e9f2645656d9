"""The broker service: the store's one async interface, in-process (embedded mode).

The gateway and the native-protocol server talk only to this class (or, in separated
mode, to a client with the same methods). It owns the CommitLog, the consume-queue
index, the metadata and the router, and bridges the writer thread to trio.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import trio

from lightqueue.index import ConsumeQueueIndex, Entry, IndexEntry
from lightqueue.rocks import HEAP_TRIM_INTERVAL_S, trim_heap
from lightqueue.routing import Router, split_partition_queue, validate_first_level
from lightqueue.since import Since, now_ms, parse_since, parse_time
from lightqueue.topic import validate_topic_filter, validate_topic_name
from serving.read_budget import ReadBudget
from store.commitlog import CommitLog, InlineFuture, RecoveryReport
from store.common import HistoryBatch, PullResult, QueueSeek, RawPull, await_future
from store.config import StoreConfig
from store.cursor_key import node_key
from store.history import HistoryReader
from store.metadata import Metadata
from store.outbox import OutboxStats
from store.producer_ids import ProducerIds
from store.producers import Stamp
from store.recent import RecentMessages
from store.record import Message, parse_msg_id
from store.redelivery import CF as NACK_CF
from store.redelivery import gone_records
from store.startup import lock_data_dir

log = logging.getLogger("lightgate.store")

MAX_PULL = 1024
RAW_PULL_BYTES = 4 << 20  # of records in one raw PULL answer (a frame holds 64 MiB)
# Reads of a PULL at most while every record it read was left out (damaged, or gone to
# retention): it answers with none, and where to go on, after that many.
SKIP_READS = 64

WILDCARD_GC_S = 60.0  # how often idle wildcard queues are looked for
PRODUCER_GC_S = 60.0  # how often idle producers are looked for


NATIVE_PARTIAL_TIMEOUT_S = 10.0  # a native connection held back this long is closed


@dataclass
class QueueStats:
    name: str
    min_offset: int
    max_offset: int
    extra: dict[str, Any] = field(default_factory=dict)


def _contiguous(entries: list[IndexEntry], read: list[Message | None], start: int
                ) -> tuple[list[Message], int]:
    """A pull's answer from its index entries and their records (None: gone to
    retention, or damaged): the messages of consecutive offsets from the first record
    read, and where the next pull starts. What could not be read before that first
    record is skipped; a gap after it (a record left out, a queue's floor) ends the
    answer, so every answer is a run of offsets (the gateway's window of a queue takes
    it as one)."""
    messages: list[Message] = []
    nxt = start
    for e, m in zip(entries, read, strict=True):
        if m is None or (messages and e.offset != nxt):
            if messages:
                break
            nxt = e.offset + 1
            continue
        messages.append(m)
        nxt = e.offset + 1
    return messages, nxt


def _within(max_bytes: int, sizes: Iterable[int]) -> int:
    """How many of the leading `sizes` fit in `max_bytes`: one at least."""
    n = total = 0
    for size in sizes:
        total += size
        if n and total > max_bytes:
            break
        n += 1
    return n


class EmbeddedStore:
    """Store in this process. Open with `async with EmbeddedStore.open(cfg) as store`."""

    def __init__(self, config: StoreConfig,
                 notify: Callable[[set[str]], bool | None] | None) -> None:
        self.config = config
        # Partly received native frames, over all the native server's connections.
        self.native_budget = ReadBudget(config.native_max_partial_bytes, NATIVE_PARTIAL_TIMEOUT_S)
        # Answers not yet written, per native connection (store.outbox).
        self.native_answers = OutboxStats(config.native_max_unsent_bytes)
        root = Path(config.data_dir)
        self.index = ConsumeQueueIndex(root / "index", config.index_cache_mb,
                                       config.index_memtable_mb)
        self.meta = Metadata(root / "meta", config.metadata_cache_mb, config.metadata_memtable_mb)
        self.router = Router(config.default_partitions)
        self._notify = notify
        self.recent = RecentMessages(config.recent_per_queue, config.recent_cache_mb << 20)
        self.commitlog = CommitLog(
            root / "commitlog",
            self.index,
            segment_size=config.segment_size,
            flush=config.flush,
            flush_interval_ms=config.flush_interval_ms,
            flush_bytes=config.flush_bytes,
            on_dispatched=self._on_dispatched,
            full_verify=config.full_verify,
            max_producers=config.max_producers,
            verify_bytes_per_s=int(config.verify_mb_per_s * (1 << 20)),
        )
        self.commitlog.on_batch = self._on_batch
        self.producer_ids = ProducerIds(self.meta, config.max_producers)
        self._ids_epoch: int | None = None  # the mastership producer_ids were read in
        self.history_reader = HistoryReader(self.commitlog, self.index, node_key(root))
        self._pending = trio.Semaphore(config.max_pending_appends)
        self._wildcard_seen: dict[str, float] = {}  # filter -> monotonic time last used
        self.wildcards_dropped = 0
        self.recovery: RecoveryReport | None = None
        # A store group's node (store.replication.node.Replication): refuses appends on a
        # replica, holds sync-mode acks until enough replicas have the bytes. None: alone.
        self.replication: Any = None
        self.native_addr: str | None = None  # set by store_node once bound
        self.auth_reload: Callable[[], Awaitable[None]] | None = None  # after a failover
        self._lock: IO[str] | None = None  # the data directory's lock (store.startup)
        self.started_at = time.time()

    @classmethod
    @asynccontextmanager
    async def open(
        cls, config: StoreConfig, notify: Callable[[set[str]], bool | None] | None = None
    ) -> AsyncIterator[EmbeddedStore]:
        """`notify` is called from the writer thread with the names of queues that grew."""
        lock = lock_data_dir(Path(config.data_dir))
        if config.flush == "sync":
            # The writer thread hands each group commit back to the event loop: with
            # Python's default 5 ms GIL switch interval every round trip could wait that
            # long. (flush async appends inline: no thread to hand over to.)
            sys.setswitchinterval(0.0005)
        try:
            store = await trio.to_thread.run_sync(cls, config, notify)
        except BaseException:
            lock.close()
            raise
        store._lock = lock
        try:
            store.recovery = await trio.to_thread.run_sync(store.commitlog.open)
            if store.recovery.truncated_at is not None:
                await trio.to_thread.run_sync(store._keep_readers_ahead)
            store._load_routes()
            if config.engine_threads:
                await trio.to_thread.run_sync(store._start_engine)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(store._retention_loop)
                nursery.start_soon(store._producer_gc_loop)
                nursery.start_soon(store._heap_trim_loop)
                nursery.start_soon(store._wildcard_gc_loop)
                try:
                    yield store
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(store._close)

    def _close(self) -> None:
        self.commitlog.close()
        self.index.close()
        self.meta.close()
        if self._lock is not None:
            self._lock.close()  # only now may another store open this directory
        log.info("store closed cleanly")

    def _keep_readers_ahead(self) -> None:
        """After a repair cut the log, a reader may be past the new end of a queue: it has
        seen offsets that would now be given to new messages. Raise each queue's floor to
        the furthest committed reader, so those offsets are not given again."""
        floors: dict[str, int] = {}
        for key, pos in self.meta.items("offsets"):
            queue = key.rsplit("\x00", 1)[-1]
            seen = pos.get("next", pos.get("acked", 0)) if isinstance(pos, dict) else int(pos)
            if seen > self.index.max_offset(queue):
                floors[queue] = max(floors.get(queue, 0), seen)
        if floors:
            self.index.set_floors(floors)
            log.warning("after the repair, %d queues resume past their readers' positions",
                        len(floors))

    def _load_routes(self) -> None:
        now = time.monotonic()  # a gateway's touch comes well within the idle time
        for topic_filter, _ in self.meta.items("wildcards"):
            self.router.register_wildcard(topic_filter)
            self._wildcard_seen[topic_filter] = now
        for topic, info in self.meta.items("topics"):
            self.router.set_partitions(topic, int(info.get("partitions", 1)))

    def _start_engine(self) -> None:
        """The native engine takes the log's tail over, with the routes Python knows
        (its native publishes are routed by its own copy of them)."""
        engine = self.commitlog.start_engine(self.config.engine_threads,
                                             self.config.default_partitions)
        self.recent.want = engine.want_queues  # the records its readers read come along
        for topic_filter in self.router.wildcards():
            engine.register_wildcard(topic_filter)
        for topic, info in self.meta.items("topics"):
            engine.set_partitions(topic, int(info.get("partitions", 1)))
        log.info("the native engine writes the log (%d I/O threads)", self.config.engine_threads)

    @property
    def engine(self) -> Any:
        """The native engine that writes the log (serving.lightgate_native.Engine), or None."""
        return self.commitlog.engine

    def _on_dispatched(self, messages: list[Message]) -> bool:
        """The writer thread, before the acks: keep the newest messages of queues being
        read, then tell readers which queues grew. False if nobody in this process
        heard (see EngineTail: the next dispatch may wait)."""
        kept = self.recent.add(messages)
        told = None
        if self._notify is not None:
            told = self._notify({name for m in messages for name, _ in m.queues})
        return kept or told is not False

    def _on_batch(self, messages: list[Message], grown: dict[str, int]) -> bool:
        """`_on_dispatched` for a batch of the native engine's: `messages` are those whose
        bodies this process has (its own appends, the publishes its readers read),
        `grown` every queue that grew with its end. Costs a call per message here and
        per queue a reader here reads, not per queue or message of the batch."""
        kept = self.recent.add(messages) if messages else False
        self.recent.grew(grown)  # a ring its queue outgrew (messages came without bodies)
        told = None
        if self._notify is not None:  # with their ends: a reader there need not pull
            told = self._notify(grown)
        if messages:
            return kept or told is not False
        return self._notify is not None and told is not False

    def readers_left(self, queues: list[str]) -> None:
        """A gateway's reader of these queues went to the native plane: their new messages
        no longer come whole for the recent rings (store.recent `unwant`)."""
        self.recent.unwant(queues)

    # -- writes -----------------------------------------------------------------------
    async def append(
        self, messages: list[Message], queues: Sequence[Sequence[str]]
    ) -> list[Message]:
        """Append with explicit target queues; returns once durable per the flush mode."""
        async with self._pending:
            return await await_future(self._append(messages, queues))

    def _append(self, messages: list[Message], queues: Sequence[Sequence[str]],
                stamp: Stamp | None = None) -> Future | InlineFuture:
        """The CommitLog append, through the store group's gate when there is one."""
        repl = self.replication
        if repl is None:
            return self.commitlog.append(messages, queues, stamp)
        refused = repl.refused()
        if refused is not None:
            fut: Future = Future()
            fut.set_exception(refused)
            return fut
        return repl.acked(self.commitlog.append(messages, queues, stamp))

    async def publish(self, messages: list[Message]) -> list[Message]:
        """Append MQTT messages, each routed by its topic (exact, wildcards, partition)."""
        async with self._pending:
            return await await_future(self.publish_start(messages))

    def publish_start(self, messages: list[Message], *, validated: bool = False,
                      producer: Stamp | None = None) -> Future | InlineFuture:
        """Submit without waiting: requests are appended in submission order, so a
        connection can pipeline its publishes and still keep them in order. `validated`:
        the caller checked every topic name already (the MQTT codec does). `producer`:
        an idempotent producer's publishes (a gateway's; its topic is
        store.producers.PUBLISHES), stored once however often they are sent."""
        if not validated:
            for m in messages:
                validate_topic_name(m.topic)
        return self._append(messages, [self.router.route(m.topic) for m in messages],
                            producer)

    async def send(self, topic: str, messages: list[Message]) -> list[Message]:
        """Append server-app messages to first-level `topic`; a message whose .topic is an
        MQTT topic under it is also routed to MQTT subscribers (a command to devices)."""
        async with self._pending:
            return await await_future(self.send_start(topic, messages))

    def send_start(self, topic: str, messages: list[Message], producer: Stamp | None = None
                   ) -> Future | InlineFuture:
        """`send` without waiting (submitted in call order); raises ValueError at once.
        `producer`: an idempotent producer's request (see store.producers; its topic is
        `topic`), stored once however often it is sent."""
        validate_first_level(topic)
        routes = []
        for m in messages:
            if m.topic and m.topic != topic:
                validate_topic_name(m.topic)
                if m.topic.split("/", 1)[0] != topic:
                    raise ValueError(f"MQTT topic {m.topic!r} is not under {topic!r}")
                routes.append(self.router.route(m.topic))
            else:
                m.topic = topic
                routes.append([self.router.partition_for(topic, m.key or m.client_id or "")])
        return self._append(messages, routes, producer)

    # -- idempotent producers -----------------------------------------------------------
    def _ids(self) -> ProducerIds:
        """The issued producer ids, read again from the metadata when this node became
        master since (a replica's copy of them changed behind the cache's back)."""
        epoch = 0 if self.replication is None else self.replication.epoch
        if self._ids_epoch != epoch:
            self.producer_ids.load()
            self._ids_epoch = epoch
        return self.producer_ids

    async def init_producer(self, user: str, name: str | None = None) -> str:
        """A producer id for `user` (with a name: the one that name has, if any)."""
        return self._ids().issue(user, name, now_ms()).id

    def check_producer(self, producer: object, user: str) -> str:
        """The id, if the store issued it to `user`: else UnknownProducer (410) or
        NotYourProducer (403), ValueErrors with a status."""
        return self._ids().check(producer, user)

    async def _producer_gc_loop(self) -> None:
        while True:  # the idle time (more than 0) read each round: SIGHUP may change it
            await trio.sleep(min(PRODUCER_GC_S, self.config.producer_idle_s / 2))
            try:
                await trio.to_thread.run_sync(self.expire_producers)
            except Exception:  # the next round tries again; appends are unaffected
                log.exception("producer clean-up failed")

    def expire_producers(self, idle_s: float | None = None) -> list[str]:
        """Forget the sequences that nothing was appended to for `idle_s` (on every node:
        each keeps its own table from the records), and on a master the ids whose
        producers sent nothing for as long (a replica copies the master's deletions).
        Returns the ids forgotten."""
        idle = self.config.producer_idle_s if idle_s is None else idle_s
        before = now_ms() - int(idle * 1000)
        log_ = self.commitlog
        with log_._write_lock:
            log_.producers.expire(before)
        if self.replication is not None and self.replication.role != "master":
            return []
        with log_._write_lock:
            seen = log_.producers.last_seen()
        if log_.native_sequences is not None:  # (the native server's are newer)
            changed, held = log_.native_sequences()
            if changed:
                log_.producers.dirty = True  # (the next snapshot has them all the same)
            for pid, last, _ in held:
                seen[pid] = max(seen.get(pid, -1), last)
        gone = self._ids().expire(before, lambda: seen)
        if gone:
            with log_._write_lock:
                log_.producers.forget(set(gone))
            log.info("forgot %d idempotent producers idle for %.0f s", len(gone), idle)
        return gone

    # -- reads ------------------------------------------------------------------------
    async def pull(self, queue: str, offset: int, max_count: int = 32,
                   max_bytes: int | None = None) -> PullResult:
        """Messages of `queue` from `offset` (clamped to the queue's minimum). A reader at
        the head of its queue is served from memory, in this thread (see store.recent);
        then `min_offset` is only the lowest offset held there. `max_bytes`: at most
        that many bytes of messages, but one message at least."""
        recent = self.pull_recent(queue, offset, max_count, max_bytes)
        if recent is not None and (recent.messages or not self.commitlog.undispatched()):
            return recent
        # "Nothing more" from the ring holds only once what the engine appended is
        # dispatched: it answers a native publish before that, and a reader told of
        # the message meanwhile (another gateway delivered it) asks at its offset.
        return await self.pull_stored(queue, offset, max_count, max_bytes)

    async def pull_stored(self, queue: str, offset: int, max_count: int = 32,
                          max_bytes: int | None = None) -> PullResult:
        """`pull` from the index and the log (a worker thread), for a caller that already
        asked the ring (`pull_now`) and was told no."""
        return await trio.to_thread.run_sync(self.pull_sync, queue, offset, max_count,
                                             max_bytes)

    def pull_now(self, queue: str, offset: int, max_count: int = 32) -> PullResult | None:
        """`pull` without waiting, when it can be answered in this thread: from the ring
        of recent messages, or, when appends are inline (flush async, where the event
        loop writes the index itself), from the index and the page cache. None: use
        `pull`. A reader that fell behind under a flood from many publishers must catch
        up within its own scheduler step; a worker-thread round trip per pull gave it one
        pull per pass of the loop while each publisher appended a whole read, and it
        starved for seconds (fan-in 100->1, 500k messages)."""
        recent = self.pull_recent(queue, offset, max_count)
        if recent is not None or not self.commitlog.inline:
            return recent
        return self.pull_sync(queue, offset, max_count)

    def pull_recent(self, queue: str, offset: int, max_count: int = 32,
                    max_bytes: int | None = None) -> PullResult | None:
        """`pull` when the ring of recent messages can answer (no I/O, no waiting: safe
        to call from the event loop), else None."""
        max_count = max(1, min(max_count, MAX_PULL))
        recent = self.recent.get(queue, offset, max_count)
        if recent is None:
            return None
        messages, end = recent
        if max_bytes is not None:
            messages = messages[:_within(max_bytes, (len(m.body) for m in messages))]
        return PullResult(messages, offset + len(messages), offset, end)

    def pull_sync(self, queue: str, offset: int, max_count: int = 32,
                  max_bytes: int | None = None) -> PullResult:
        max_count = max(1, min(max_count, MAX_PULL))
        self.commitlog.catch_up()
        lo = self.index.min_offset(queue)
        hi = self.index.max_offset(queue)
        # Below the minimum: retention took it. Beyond the end: a repaired (cut) log gave
        # those offsets back; a reader that was past them resumes at the new end.
        start = min(max(offset, lo), hi)
        for _ in range(SKIP_READS):
            entries = self.index.read(queue, start, max_count)
            if max_bytes is not None:  # cut before reading: the sizes are in the index
                entries = entries[:_within(max_bytes, (e.size for e in entries))]
            read = self.commitlog.read_run([(e.phys_offset, e.size) for e in entries])
            messages, next_offset = _contiguous(entries, read, start)
            if messages or len(entries) < max_count:
                break
            start = next_offset  # every one skipped (damaged, or gone): read on
        return PullResult(messages, next_offset, lo, hi)

    def queue_runs(self, positions: Sequence[tuple[str, int]], max_entries: int
                   ) -> tuple[list[tuple[str, int, list[tuple[int, bytes]], bool]], int]:
        """What the index holds of each (queue, position) as stored (see
        ConsumeQueueIndex.read_runs_raw): (queue, start, runs, full), `start` the position
        moved past what retention took (as `pull` moves it); and the log position the index
        covers, every entry below it present. Blocking (a worker thread's)."""
        self.commitlog.catch_up()
        horizon = self.commitlog.max_offset  # read before the runs: they hold all below it
        out = []
        for queue, offset in positions:
            lo, hi = self.index.min_offset(queue), self.index.max_offset(queue)
            start = min(max(offset, lo), hi)
            runs, full = self.index.read_runs_raw(queue, start, max_entries)
            out.append((queue, start, runs, full))
        return out, horizon

    def pull_raw(self, queue: str, offset: int, max_count: int = MAX_PULL,
                 read_limit: int | None = None, max_bytes: int = RAW_PULL_BYTES) -> RawPull:
        """`pull` as the log holds the records (CommitLog.read_records): runs of records
        back to back, not decoded, for a reader that decodes them itself (the Spark
        source): the store's work per record is its index entry, its share of a pread
        and its CRC. `read_limit`: a log position not to hand out records past (sync
        replication). No I/O wait beyond the page cache's: callable from the event loop
        when appends are inline."""
        max_count = max(1, min(max_count, MAX_PULL))
        self.commitlog.catch_up()
        lo, hi = self.index.min_offset(queue), self.index.max_offset(queue)
        start = min(max(offset, lo), hi)
        entries = self._raw_entries(queue, start, max_count, read_limit)
        for _ in range(SKIP_READS):
            runs, data, looked = self.commitlog.read_records(entries, max_bytes)
            # Past the last entry looked at (max_bytes may have cut the rest): its record
            # handed out, or left out (gone to retention, damaged); or where it started.
            nxt = entries[looked - 1][3] + 1 if looked else start
            if runs or looked < len(entries) or len(entries) < max_count:
                break
            start = nxt  # every one left out: read on
            entries = self._raw_entries(queue, start, max_count, read_limit)
        return RawPull(runs, data, nxt, lo, hi)

    def _raw_entries(self, queue: str, start: int, max_count: int,
                     read_limit: int | None) -> list[Entry]:
        entries = self.index.read_tuples(queue, start, max_count)
        if read_limit is not None:
            for i, (phys, size, _, _) in enumerate(entries):
                if phys + size > read_limit:
                    return entries[:i]
        return entries

    def queue_range(self, queue: str, read_limit: int | None = None) -> tuple[int, int]:
        """The queue's first and end offsets; with a read limit (the acknowledged log
        offset in sync replication), the end of what readers may see."""
        return self.index.min_offset(queue), self._end(queue, read_limit)

    def _end(self, queue: str, read_limit: int | None) -> int:
        self.commitlog.catch_up()
        if read_limit is None:
            return self.index.max_offset(queue)
        return self.index.end_within(queue, read_limit)

    # -- replay -----------------------------------------------------------------------
    async def seek_time(self, queue: str, ms: int) -> QueueSeek:
        """The first offset of `queue` stored at or after `ms` (store time, ms since the
        epoch): a binary search over its index entries, never a scan."""
        return await trio.to_thread.run_sync(self.history_reader.seek, queue, int(ms))

    async def history(self, topic_filter: str, since: str | Since = "earliest", *,
                      until: str | int | None = None, cursor: str | None = None,
                      max_count: int = 1024, max_bytes: int = 4 << 20,
                      read_limit: int | None = None) -> HistoryBatch:
        """A batch of the stored messages of every topic `topic_filter` matches, from
        `since` (see lightqueue.since; durations count back on this store's clock) to
        `until`, in store order; pass the batch's cursor back (with the same filter) for
        the next one. The first batch fixes the end after every append submitted before
        it is written. `read_limit`: a log position readers may not pass (the
        acknowledged offset in sync replication). See store.history for the guarantees.
        ValueError (a CursorError, a SinceError) for bad input."""
        reader = self.history_reader
        if cursor is not None:
            return await trio.to_thread.run_sync(reader.next, cursor, topic_filter,
                                                 max_count, max_bytes, read_limit)
        now = now_ms()
        start = since if isinstance(since, Since) else parse_since(since, now)
        end_ms = until if until is None or isinstance(until, int) else parse_time(until, now)
        await self._written()
        return await trio.to_thread.run_sync(reader.first, topic_filter, start, end_ms,
                                             self.index.checkpoint(), max_count, max_bytes,
                                             read_limit)

    async def _written(self) -> None:
        """Return once every append submitted before is written and indexed. Inline
        appends are by the time they return; the writer thread takes requests in order,
        so an empty one comes back after all before it."""
        if not self.commitlog.inline:
            await await_future(self.commitlog.append([], []))
        else:
            self.commitlog.catch_up()

    async def get_message(self, msg_id: str) -> Message:
        return await trio.to_thread.run_sync(self.commitlog.read, parse_msg_id(msg_id))

    async def last_key_offset(self, key: str) -> int | None:
        """Physical offset of the newest record with this key (None: there is none)."""
        return await trio.to_thread.run_sync(self.index.last_key, key)

    async def find_by_key(self, key: str, limit: int = 100) -> list[Message]:
        def find() -> list[Message]:
            out = []
            for phys in self.index.find_key(key, limit):
                try:
                    out.append(self.commitlog.read(phys))
                except KeyError:
                    continue
            return out

        return await trio.to_thread.run_sync(find)

    # -- metadata, as the gateway sees it (async: a network call in separated mode) ----
    async def meta_get(self, cf: str, key: str) -> Any:
        return self.meta.get(cf, key)

    async def meta_put(self, cf: str, key: str, value: Any) -> None:
        self.meta.put(cf, key, value)

    async def meta_delete(self, cf: str, key: str) -> None:
        self.meta.delete(cf, key)

    async def meta_items(
        self, cf: str, prefix: str = "", limit: int | None = None
    ) -> list[tuple[str, Any]]:
        return list(self.meta.items(cf, prefix, limit))

    async def meta_write(self, ops: Sequence[tuple[str, str, str, Any]]) -> None:
        """Apply ("put"|"delete"|"delete_prefix", cf, key, value) ops atomically."""
        self.meta.write(ops)

    def meta_write_now(self, ops: Sequence[tuple[str, str, str, Any]]) -> None:
        """`meta_write`, called without a task: the native plane's records of a
        persistent session's sends are written where its reports are taken, in their
        order (gateway.handover)."""
        self.meta.write(ops)

    async def add_wildcard(self, topic_filter: str) -> None:
        self.register_wildcard(topic_filter)

    async def add_wildcards(self, filters: Sequence[str]) -> None:
        """Register (or keep registered: a touch) every filter; gateways call this for
        the wildcard filters their sessions use, periodically."""
        for topic_filter in filters:
            self.register_wildcard(topic_filter)

    async def get_stats(self) -> dict[str, Any]:
        return self.stats()

    async def cluster(self) -> dict[str, Any]:
        """The store group's view (one master row when this store is not in a group)."""
        from store.replication.ops import cluster_view
        return cluster_view(self)

    async def queue_ends(self, queues: Sequence[str], read_limit: int | None = None
                         ) -> dict[str, int]:
        """End offsets of many queues at once (the poll fallback when notify is down),
        with a read limit as `queue_range` takes it."""
        return {q: self._end(q, read_limit) for q in queues}

    async def queue_end(self, queue: str) -> int:
        """One past the last entry of `queue`: where a new subscription starts."""
        self.commitlog.catch_up()
        return self.index.max_offset(queue)

    async def queue_tail_start(self, queue: str, start: int, max_bytes: int) -> int:
        """Where a reader at `start` resumes if it may be at most `max_bytes` behind."""
        self.commitlog.catch_up()
        return self.index.tail_start(queue, start, max_bytes)

    # -- routing metadata -------------------------------------------------------------
    def register_wildcard(self, topic_filter: str) -> bool:
        """Index future messages matching `topic_filter` into its wildcard queue."""
        validate_topic_filter(topic_filter)
        self._wildcard_seen[topic_filter] = time.monotonic()
        if not self.router.register_wildcard(topic_filter):
            return False
        if self.engine is not None:
            self.engine.register_wildcard(topic_filter)
        self.meta.put("wildcards", topic_filter, {"since": int(time.time() * 1000)})
        return True

    def unregister_wildcard(self, topic_filter: str) -> bool:
        self._wildcard_seen.pop(topic_filter, None)
        if not self.router.unregister_wildcard(topic_filter):
            return False
        if self.engine is not None:
            self.engine.unregister_wildcard(topic_filter)
        self.meta.delete("wildcards", topic_filter)
        return True

    def create_topic(self, topic: str, partitions: int) -> None:
        self.router.set_partitions(topic, partitions)
        if self.engine is not None:
            self.engine.set_partitions(topic, partitions)
        self.meta.put("topics", topic, {"partitions": partitions})

    def topic_queues(self, topic: str) -> list[str]:
        return [f"{topic}#{p}" for p in range(self.router.partitions(topic))]

    def list_queues(self, prefix: str = "", limit: int = 1000) -> list[QueueStats]:
        out = []
        for name in self.index.queues(prefix, limit):
            lo, hi = self.queue_range(name)
            kind = (
                "partition"
                if split_partition_queue(name)
                else ("wildcard" if ("+" in name or "#" in name) else "topic")
            )
            out.append(QueueStats(name, lo, hi, {"kind": kind}))
        return out

    # -- housekeeping -----------------------------------------------------------------
    async def _retention_loop(self) -> None:
        cfg = self.config  # read each round: SIGHUP may change it (lightgate.reloading)
        while True:
            await trio.sleep(cfg.retention_check_s)
            if cfg.retention_hours is None and cfg.retention_bytes is None:
                continue
            if await self.enforce_retention():
                await trio.to_thread.run_sync(self._drop_gone_nacks)

    def _drop_gone_nacks(self) -> None:
        """Records of NACKed deliveries whose message retention just removed."""
        if self.replication is not None and self.replication.role != "master":
            return  # a replica's metadata is the master's copy
        gone = list(gone_records(self.meta, self.index.min_offset))
        if gone:
            self.meta.write([("delete", NACK_CF, key, None) for key in gone])

    async def _wildcard_gc_loop(self) -> None:
        while True:  # the idle time read each round: SIGHUP may change it
            idle = self.config.wildcard_idle_s
            await trio.sleep(min(WILDCARD_GC_S, idle / 2) if idle > 0 else WILDCARD_GC_S)
            if self.config.wildcard_idle_s <= 0:
                continue
            if self.replication is not None and self.replication.role != "master":
                continue  # a replica's wildcards are the master's (copied metadata)
            try:
                await self.drop_idle_wildcards()
            except Exception:  # the next round tries again; appends are unaffected
                log.exception("wildcard clean-up failed")

    async def drop_idle_wildcards(self, idle: float | None = None) -> list[str]:
        """Unregister wildcard queues unused for `wildcard_idle_s`: not touched by any
        gateway (they touch what their sessions read) and named by no stored reader
        position (an offline persistent session, a shared group). Messages stop being
        indexed into them; what is there stays until retention, and a later SUBSCRIBE
        registers the filter again, its offsets going on where they were. `idle`: the
        configured wildcard_idle_s unless given."""
        idle = self.config.wildcard_idle_s if idle is None else idle
        now = time.monotonic()
        stale = {f for f, seen in self._wildcard_seen.items() if now - seen > idle}
        if not stale:
            return []
        held = await trio.to_thread.run_sync(self._queues_with_positions, stale)
        dropped = []
        for topic_filter in sorted(stale - held):
            # Touched while the positions were read (a SUBSCRIBE): keep it.
            if time.monotonic() - self._wildcard_seen.get(topic_filter, 0.0) <= idle:
                continue
            if self.unregister_wildcard(topic_filter):
                dropped.append(topic_filter)
        if dropped:
            self.wildcards_dropped += len(dropped)
            log.info("unregistered %d wildcard queues nobody used for %.0f s: %s",
                     len(dropped), idle, ", ".join(dropped[:10]))
        return dropped

    def _queues_with_positions(self, queues: set[str]) -> set[str]:
        """Which of `queues` a stored reader position names (the queue is the last part
        of every key in the offsets family)."""
        held = set()
        for key, _ in self.meta.items("offsets"):
            queue = key.rsplit("\x00", 1)[-1]
            if queue in queues:
                held.add(queue)
        return held

    async def _heap_trim_loop(self) -> None:
        """RocksDB's blocks and Python's buffers share the heap: see lightqueue.rocks."""
        if not trim_heap():
            return  # not glibc
        while True:
            await trio.sleep(HEAP_TRIM_INTERVAL_S)
            await trio.to_thread.run_sync(trim_heap)

    async def enforce_retention(self) -> list[int]:
        return await trio.to_thread.run_sync(
            self.commitlog.enforce_retention,
            self.config.retention_hours,
            self.config.retention_bytes,
        )

    def stats(self) -> dict[str, Any]:
        segs = self.commitlog.segments()
        return {
            "commitlog": {
                "min_offset": self.commitlog.min_offset,
                "max_offset": self.commitlog.max_offset,
                "flushed_offset": self.commitlog.flushed_offset,
                "segments": len(segs),
                "bytes": sum(size for _, size in segs),
                "flush": self.config.flush,
                **self.commitlog.stats,
                "damaged_records": self.commitlog.damage.count,
                "damaged_bytes": self.commitlog.damage.bytes,
                "offset_mark_writes": self.commitlog.marks.writes,
            },
            "index_checkpoint": self.index.checkpoint(),
            "queues_active": len(self.index._next),  # queues written since start
            "wildcards": len(self.router.wildcards()),
            "wildcards_dropped": self.wildcards_dropped,
            "recent": self.recent.stats(),  # reads served from memory, see store.recent
            "memory": {"index": self.index.memory(), "metadata": self.meta.memory()},
            "native_read_budget": self.native_budget.stats(),
            "native_answer_budget": self.native_answers.stats(),
            "producers": {"ids": len(self.producer_ids),
                          "sequences": len(self.commitlog.producers),
                          "limit": self.config.max_producers,
                          "refused": self.producer_ids.refused
                          + self.commitlog.producers.refused},
            "uptime_s": round(time.time() - self.started_at, 3),
        }
