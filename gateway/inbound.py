"""Publishes into the store, batched across connections: what one pass of the event loop
read from every client goes to the store as one append (one CommitLog write, one index
batch), and each publisher's ack goes out once the store holds its message at the
configured durability (`flush = sync`: fsync'd; async: written).

With one message in flight per device (QoS 1, each waiting for its PUBACK) every
message is its own read; appending them one by one cost a CommitLog write and an index
batch each. The reactor (gateway.reactor) calls `flush` at the end of each pass; a
connection read by a task of its own (TLS, WebSocket) stages and lets the flusher task
append after the pass."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import trio

from gateway.cache import QueueCache
from gateway.mqtt import Publish
from gateway.mqtt import reason as rc
from gateway.session import Session
from gateway.stats import Stats
from serving.rate_limited_log import RateLimitedLog
from store.api import (
    FutureLike,
    Message,
    Store,
    StoreError,
    StoreFullError,
    StoreUnavailable,
)

log = logging.getLogger("lightgate.gateway.inbound")
_refused = RateLimitedLog(log)  # appends the store refuses (a full disk: every one)

MAX_BATCH = 1024  # messages per append, at most
# A refused publish's Reason String: this, then why (the native plane is given it too).
NOT_STORED = "not stored: "


def not_stored(exc: BaseException) -> str:
    return f"{NOT_STORED}{exc}"



class Publisher(Protocol):
    """A client connection, as the pipeline sees it (gateway.connection.Connection)."""

    session: Session | None  # once connected

    def stored(self, p: Publish, ticket: int, code: int, text: str = "") -> None: ...

    def flush(self) -> None: ...


class Host(Protocol):
    """The broker, as the pipeline sees it (gateway.broker.Broker)."""

    store: Store
    stats: Stats
    cache: QueueCache

    def retaining(self, msg: Message) -> None: ...

    def stored_here(self, stored: list[Message]) -> None: ...

    async def set_retained(self, msg: Message) -> None: ...

    async def remember_incoming_qos2(self, s: Session, pid: int, done: bool,
                                     phys: int = -1) -> None: ...


Staged = tuple[Publisher, Message, Publish, int]


class Inbound:
    def __init__(self, broker: Host) -> None:
        self.broker = broker
        self._staged: list[Staged] = []
        self._wake: trio.Event | None = None  # the flusher's, when it waits
        self._pending: dict[Publisher, int] = {}  # submitted, not finished, per client
        self._drained: dict[Publisher, trio.Event] = {}
        self._token: trio.lowlevel.TrioToken | None = None
        self._thread = 0
        self._nursery: trio.Nursery | None = None
        self.in_pass = False  # the reactor is in a pass: it flushes at its end
        self._started = 0  # appends started, numbered from 0
        self._unsettled: dict[int, None] = {}  # appends not answered yet, oldest first
        self._held: deque[tuple[int, Callable[[Any], None], Any]] = deque()

    # -- staging ---------------------------------------------------------------------------
    def stage(self, conn: Publisher, msg: Message, p: Publish, ticket: int) -> None:
        """Append `msg` with the next batch; `conn.stored` answers it."""
        self._staged.append((conn, msg, p, ticket))
        self._pending[conn] = self._pending.get(conn, 0) + 1
        if not self.in_pass and self._wake is not None:
            self._wake.set()  # not the reactor's: the flusher appends after this pass
        elif len(self._staged) >= MAX_BATCH:
            self.flush()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """The flusher: appends what stream readers staged, once per pass."""
        self._token = trio.lowlevel.current_trio_token()
        self._thread = threading.get_ident()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                self._wake = trio.Event()
                if not self._staged:
                    await self._wake.wait()
                self.flush()
                await trio.lowlevel.checkpoint()

    # -- appending -------------------------------------------------------------------------
    def flush(self) -> None:
        """Append everything staged, in arrival order."""
        while self._staged:
            batch, self._staged = self._staged[:MAX_BATCH], self._staged[MAX_BATCH:]
            self._append(batch)

    def _append(self, batch: list[Staged]) -> None:
        started = time.perf_counter()
        # Counted as under way from before the call: an embedded store may tell of the
        # queues it grew from inside it (see after_appends).
        seq, self._started = self._started, self._started + 1
        self._unsettled[seq] = None
        try:
            fut = self.broker.store.publish_start([m for _, m, _, _ in batch],
                                                  validated=True)  # by the codec
        except Exception as exc:  # noqa: BLE001 - every publisher hears of it
            self._answered(seq, batch, None, started, exc)
            return
        if fut.done():
            self._answered(seq, batch, fut, started)
            return

        def done(_: FutureLike) -> None:
            if threading.get_ident() == self._thread:
                self._answered(seq, batch, fut, started)
            elif self._token is not None:
                try:
                    self._token.run_sync_soon(self._answered, seq, batch, fut, started)
                except trio.RunFinishedError:
                    pass

        fut.add_done_callback(done)

    def after_appends(self, fn: Callable[[Any], None], arg: Any) -> bool:
        """Hold `fn(arg)` until every append started so far is answered; False if none
        is waiting (the caller goes on at once). The store's news that a queue grew can
        reach this thread before the answer to the append that grew it (the dispatch
        and the writer's callback race here): held, a publisher's PUBACK goes out before
        its message reaches its own subscription, on every transport and both planes."""
        if not self._unsettled:
            return False
        self._held.append((self._started, fn, arg))
        return True

    def _answered(self, seq: int, batch: list[Staged], fut: FutureLike | None,
                  started: float, exc: BaseException | None = None) -> None:
        try:
            if fut is None:
                self._failed(batch, exc or RuntimeError("no answer"))
            else:
                self._settled(batch, fut, started)
        finally:
            del self._unsettled[seq]
            oldest = next(iter(self._unsettled), self._started)
            while self._held and self._held[0][0] <= oldest:
                _, fn, arg = self._held.popleft()
                fn(arg)

    def _settled(self, batch: list[Staged], fut: FutureLike, started: float) -> None:
        try:
            stored: list[Message] = fut.result()
        except Exception as exc:  # noqa: BLE001 - a StoreError, or anything: refused
            self._failed(batch, exc)
            return
        broker = self.broker
        broker.stats.observe_append(time.perf_counter() - started)
        broker.cache.offer(stored)
        later = []
        for (conn, _, p, ticket), msg in zip(batch, stored, strict=True):
            if p.retain or (p.qos == 2 and conn.session is not None
                            and conn.session.persistent):
                if p.retain:
                    broker.retaining(msg)
                later.append((conn, msg, p, ticket))  # effects in the store first
                continue
            conn.stored(p, ticket, 0)
            self._done(conn)
        if later:
            self._spawn(self._effects, later)
        for conn in {c for c, _, _, _ in batch}:
            conn.flush()
        broker.stored_here(stored)  # after the publishers' acks: theirs wait for nothing

    async def _effects(self, items: list[Staged]) -> None:
        """What follows a stored publish before its ack: the retained store, a persistent
        session's QoS 2 marker. Run even when the publisher left meanwhile
        (`mosquitto_pub -r` sends CONNECT, PUBLISH and DISCONNECT in one write)."""
        broker = self.broker
        for conn, msg, p, ticket in items:
            try:
                if p.retain:
                    await broker.set_retained(msg)
                if p.qos == 2 and conn.session is not None:
                    await broker.remember_incoming_qos2(conn.session, p.packet_id, False,
                                                        msg.phys_offset)
                conn.stored(p, ticket, 0)
            except StoreError as exc:
                log.warning("publish effects of %r not kept: %s", msg.client_id, exc)
                conn.stored(p, ticket, rc.UNSPECIFIED_ERROR, not_stored(exc))
            finally:
                self._done(conn)
            conn.flush()

    def _failed(self, batch: list[Staged], exc: BaseException) -> None:
        broker = self.broker
        broker.stats.publish_errors += len(batch)
        if not isinstance(exc, StoreError):
            log.error("append of %d publishes failed", len(batch), exc_info=exc)
        code = rc.QUOTA_EXCEEDED if isinstance(exc, StoreFullError) else rc.UNSPECIFIED_ERROR
        clients = {}
        for conn, msg, p, ticket in batch:
            clients[conn] = msg.client_id
            conn.stored(p, ticket, code, not_stored(exc))
            self._done(conn)
        # Without a store connection the store client (and a gateway cut off from its
        # master, gateway.store_link) says so once: not once per publish. Otherwise
        # once in a while: a full disk refuses every append.
        for conn, client_id in clients.items():
            if isinstance(exc, StoreUnavailable):
                log.debug("publishes from %r not stored: %s", client_id, exc)
            else:
                _refused.note(f"publishes not stored: {exc}")
            conn.flush()

    def _done(self, conn: Publisher) -> None:
        n = self._pending.get(conn, 0) - 1
        if n > 0:
            self._pending[conn] = n
            return
        self._pending.pop(conn, None)
        ev = self._drained.pop(conn, None)
        if ev is not None:
            ev.set()

    def idle(self, conn: Publisher) -> bool:
        """Nothing `conn` staged waits to be stored or answered."""
        return conn not in self._pending

    async def drained(self, conn: Publisher) -> None:
        """Until every publish `conn` staged has been stored (or refused) and answered."""
        if conn not in self._pending:
            return
        self.flush()
        if conn not in self._pending:  # the flush stored and answered them at once
            return
        ev = self._drained.get(conn)
        if ev is None:
            ev = self._drained[conn] = trio.Event()
        await ev.wait()

    def _spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(fn, *args)
