"""Native connections the native server carries (serving.lightgate_native.StoreServer,
native/src/server.rs): a store node's side of "one connection, two owners in turn".

Python accepts a native connection and answers its HELLO (store.server). A connection
whose rights cover every request (authentication off, a node user, a Super user, a
store node: what gateways and the other nodes use) then goes to the native server with
the HELLO's answer and the bytes read past it. That side appends its PUBLISH frames
through the engine (the log's one writer) and answers them; every other request comes
back here with its request id, runs through the same handlers as any connection's
(`NativeServer._start`: the checks, the handlers, the outbox's budget), and its answer
is written there.

Idempotent producers: the native side checks the sequence of a producer's publishes
while a connection it carries holds it. A connection's first stamped PUBLISH asks here
(`claim`): the id must be the connection's user's (store.producer_ids), and the
sequence as the producers' table holds it goes over. A sequence comes back into the
table (`sync_released`) when no carried connection holds it any more, or before one of
its frames is handled here; the table's snapshots add the sequences held natively
(`CommitLog.native_sequences`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from store import protocol as p
from store.auth import Subject
from store.outbox import Outbox
from store.producers import PUBLISHES, ProducerBudgetError
from store.record import loads_json

# store.server's NativeServer and ConnCtx (it imports this module: named, not imported).
NativeServer = Any
ConnCtx = Any

log = logging.getLogger("lightgate.store.native")

# How often the carried connections' users are checked again: one disabled or deleted
# (or no longer a node) is closed, as Python refuses its next request.
REVALIDATE_S = 1.0


class _NoLimit:
    """The native side bounds a connection's requests in Python (server.rs MAX_UP)."""

    def release(self) -> None:
        pass


_NO_LIMIT = _NoLimit()


@dataclass
class Carried:
    ctx: ConnCtx
    outbox: Outbox
    scope: trio.CancelScope


class Carrier:
    def __init__(self, server: NativeServer, native: Any) -> None:
        self.server = server
        self.native = native  # serving.lightgate_native.StoreServer
        self.conns: dict[int, Carried] = {}
        self._nursery: trio.Nursery | None = None
        self.carried = 0  # connections handed over since the start
        # Native appends were made (a store group's master: see native_master).
        self.on_appended: Callable[[], None] | None = None
        # Replicas' fetches were answered natively: [(node, addr, offset, meta_inc,
        # meta_seq)], each replica's last (a store group's master).
        self.on_fetched: Callable[[list], None] | None = None
        commitlog = server.store.commitlog
        self._table = commitlog.producers
        self._write_lock = commitlog._write_lock
        commitlog.native_sequences = self.native.producer_entries
        # One budget for partial frames, the carried connections' and Python's.
        self._budget = server.store.native_budget
        self._budget.share(server.store.engine)

    def may_carry(self, ctx: ConnCtx) -> bool:
        """Whether every request of this connection is allowed (its appends are then
        not checked one by one)."""
        auth = self.server.auth
        if self._nursery is None:
            return False
        if not auth.enabled or ctx.store_node is not None:
            return True
        subject = ctx.subject
        return subject is not None and self._all_allowed(subject)

    def _all_allowed(self, subject: Subject) -> bool:
        auth = self.server.auth
        return auth.still_valid(subject) and (auth.is_node(subject) or auth.is_super(subject))

    def adopt(self, fd: int, hello_answer: bytes, unread: bytes, ctx: ConnCtx) -> None:
        """Hand the connection over (its socket detached from trio: `fd`)."""
        assert self._nursery is not None
        # Its REPL_FETCH is answered natively only if Python would allow it.
        conn = self.native.adopt(fd, hello_answer, unread, self.server.may_fetch(ctx))
        channel, recv = trio.open_memory_channel[bytes](256)
        outbox = Outbox(channel, self.server.store.native_answers)
        ctx.outbox = outbox
        scope = trio.CancelScope()
        self.conns[conn] = Carried(ctx, outbox, scope)
        self.carried += 1
        self._nursery.start_soon(self._writer, conn, recv, outbox, scope)

    async def _writer(self, conn: int, recv: Any, outbox: Outbox,
                      scope: trio.CancelScope) -> None:
        with scope:
            async for data in recv:
                self.native.answer(conn, data)
                outbox.written(len(data))

    def close_all(self) -> None:
        for conn in list(self.conns):
            self.native.close(conn)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        native = self.native
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                while True:
                    with trio.move_on_after(REVALIDATE_S) as waited:
                        await trio.lowlevel.wait_readable(native.wake_fd)
                    if self._budget.limit:  # the native side may have freed some
                        self._budget.refresh()
                    if waited.cancelled_caught:
                        self.revalidate()
                        continue
                    native.clear_wake()
                    self.sync_released()
                    for item in native.take_up():
                        try:
                            self._up(nursery, item)
                        except Exception:  # a bug: that connection ends, never the rest
                            log.exception("a carried native connection's request failed")
                            native.close(item[1])
        finally:
            self._nursery = None
            self.server.store.commitlog.native_sequences = None
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(native.stop)
            self.sync_released()

    def _up(self, nursery: trio.Nursery, item: tuple) -> None:
        kind, conn = item[0], item[1]
        if kind == "appended":
            if self.on_appended is not None:
                self.on_appended()
            return
        if kind == "fetched":
            if self.on_fetched is not None:
                self.on_fetched(item[2])
            return
        if kind == "closed":
            c = self.conns.pop(conn, None)
            if c is not None:
                c.outbox.close()
                c.scope.cancel()
            return
        c = self.conns.get(conn)
        if c is None:
            return
        if kind == "claim":
            self._claim(conn, c, item[2], item[3])
            return
        _, _, code, rid, raw, body = item
        try:
            header = loads_json(raw) if raw else {}
        except ValueError as exc:
            self.native.answer(conn, p.encode_error(code, rid, 400, f"bad header JSON: {exc}"))
            return
        frame = p.Frame(p.REQUEST, code, rid, header, body)
        if code == p.HELLO:
            nursery.start_soon(self._hello, conn, c, frame)
            return
        self.server._start(nursery, frame, c.outbox, _NO_LIMIT, c.ctx)

    async def _hello(self, conn: int, c: Carried, frame: p.Frame) -> None:
        """A HELLO again: answered as Python answers it; one that leaves the connection
        with fewer rights than the native side assumes closes it."""
        answer = await self.server._hello(frame, c.ctx)
        if not self.may_carry(c.ctx):
            answer = p.encode_error(frame.code, frame.request_id, 403,
                            "this connection is carried for a user every request is allowed "
                            "to; authenticate as another user on a new connection")
            self.native.answer(conn, answer)
            self.native.close(conn)
            return
        # (before the answer: the frames after the HELLO wait for it)
        self.native.may_fetch(conn, self.server.may_fetch(c.ctx))
        self.native.answer(conn, answer)

    def _claim(self, conn: int, c: Carried, rid: int, producer: str) -> None:
        """May `conn` stamp its publishes with `producer`? As `_producer_stamp` checks
        it; then its sequence goes over."""
        try:
            pid = self.server.store.check_producer(producer, self.server._user(c.ctx))
        except ValueError as exc:
            self.native.refuse(conn, p.encode_error(p.PUBLISH, rid, getattr(exc, "status", 400),
                                            str(exc)))
            return
        table = self._table
        with self._write_lock:
            entry = table.get((pid, PUBLISHES))
            if entry is None and len(table) >= table.max_sequences:
                table.refused += 1
                exc = ProducerBudgetError(
                    f"the store remembers {table.max_sequences} producer sequences (a "
                    "producer id and a topic it writes to: --max-producers); idle ones are "
                    "forgotten after --producer-idle-s")
                self.native.refuse(conn, p.encode_error(p.PUBLISH, rid, exc.status, str(exc)))
                return
        self.native.claimed(conn, pid, None if entry is None else (entry[0], list(entry[1])))

    def sync_released(self) -> None:
        """The sequences the native side gave back, into the producers' table."""
        released = self.native.take_released()
        if not released:
            return
        with self._write_lock:
            for pid, seen, batches in released:
                self._table.put((pid, PUBLISHES),
                                (seen, tuple(tuple(b) for b in batches)))

    def revalidate(self) -> None:
        """Close the carried connections whose user lost its rights since."""
        if not self.server.auth.enabled:
            return
        for conn, c in list(self.conns.items()):
            ctx = c.ctx
            if ctx.store_node is None and (ctx.subject is None
                                           or not self._all_allowed(ctx.subject)):
                log.info("closing a carried native connection of %s: its rights changed",
                         ctx.subject.name if ctx.subject else "?")
                self.native.close(conn)
