"""Shared subscriptions (`$share/{group}/{filter}`): one reader of the filter's light
queue per group, handing each message to one live member.

A message counts as done only when its member acknowledges it (PUBACK/PUBCOMP), never
on the socket write (which lost messages in rocketmq-mqtt): if the member disconnects
first, the message goes back to the front of the group's queue for another member. The
group's resume point (first unacknowledged offset) is kept in the store.

With several gateways over one store, one gateway at a time hands a group's messages
out (store.leases): a gateway holds the group's lease while it asks for it every
LEASE_ASK_S, and stops on its own once LEASE_FENCE_S passed without an answer. A
gateway that takes the lease over resumes at the position its holder last kept: what
that one handed out but had not seen acknowledged is sent again (QoS 1, at least once).
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict, deque
from typing import Protocol

import trio

from gateway.background import Background
from gateway.session import NUL, Session
from store.api import LEASE_ASK_S, LEASE_FENCE_S, Message, Store, StoreError

log = logging.getLogger("lightgate.gateway.shared")

def group_key(group: str, topic_filter: str) -> str:
    return f"share{NUL}{group}{NUL}{topic_filter}"


# What a group needs from the outside, as protocols defined here so that this module
# imports neither the broker (which owns the groups) nor the connection (the members).
class GroupCache(Protocol):
    """The gateway's message cache (gateway.cache.QueueCache)."""

    async def pull(self, queue: str, offset: int, max_count: int = 64
                   ) -> tuple[list[Message], int]: ...


class Leaser(Protocol):
    """The store's leases on shared groups (store.client.RemoteStore)."""

    async def shared_lease(self, gateway_id: str, held: dict[str, bool]
                           ) -> dict[str, str | None]: ...

    async def shared_leave(self, gateway_id: str, names: list[str]) -> dict[str, int]: ...


class Member(Protocol):
    """A member session's live connection (gateway.connection.Connection)."""

    alive: bool
    peer: str

    def has_window(self) -> bool: ...

    async def push_shared(self, group: SharedGroup, msg: Message, buffered: bool = False
                          ) -> bool: ...

    async def flush_out(self) -> None: ...


class SharedGroup:
    def __init__(self, cache: GroupCache, group: str, topic_filter: str, cursor: int) -> None:
        self.cache = cache
        self.group = group
        self.filter = topic_filter
        self.queue = topic_filter
        self.cursor = cursor  # next offset to hand out
        self.members: list[Session] = []
        self.pending: OrderedDict[int, Message] = OrderedDict()  # offset -> handed out
        self.retry: deque[Message] = deque()  # taken back from members that left
        self.wakeup = trio.Event()
        self._rr = 0
        self.dirty = True
        self.delivered = 0
        self.redelivered = 0
        # Until when this gateway may hand out (trio's clock): always, alone over the
        # store; with other gateways, while it holds the group's lease (fenced).
        self.lease_until = math.inf

    @property
    def name(self) -> str:
        return f"$share/{self.group}/{self.filter}"

    @property
    def serving(self) -> bool:
        return trio.current_time() < self.lease_until

    def acked_offset(self) -> int:
        offsets = [*self.pending, *(m.offset_in(self.queue) for m in self.retry)]
        return min(offsets) if offsets else self.cursor

    def wake(self) -> None:
        self.wakeup.set()

    # -- members ------------------------------------------------------------------------
    def add(self, s: Session) -> None:
        if s not in self.members:
            self.members.append(s)
        self.wake()

    def remove(self, s: Session) -> None:
        if s in self.members:
            self.members.remove(s)

    def take_back(self, msg: Message) -> None:
        """A member left with `msg` unacknowledged: hand it to someone else, first."""
        off = msg.offset_in(self.queue)
        if self.pending.pop(off, None) is not None:
            self.retry.appendleft(msg)
            self.redelivered += 1
            self.wake()

    def acked(self, offset: int) -> None:
        if self.pending.pop(offset, None) is not None:
            self.dirty = True

    def _pick(self) -> Member | None:
        """A live member with room in its in-flight window, round-robin."""
        n = len(self.members)
        for i in range(n):
            s = self.members[(self._rr + i) % n]
            conn = s.connection
            if conn is not None and conn.has_window():
                self._rr = (self._rr + i + 1) % n
                return conn
        return None

    # -- the group's reader -------------------------------------------------------------
    async def run(self) -> None:
        while True:
            await self.wakeup.wait()
            self.wakeup = trio.Event()
            try:
                await self._hand_out()
            except StoreError as exc:  # the store is away: try again shortly
                log.warning("shared group %s paused: %s", self.name, exc)
                await trio.sleep(0.5)
                self.wake()
            except Exception:  # a bug: this group pauses, the broker must not end with it
                log.exception("shared group %s failed; retrying in 1 s", self.name)
                await trio.sleep(1.0)
                self.wake()

    async def _hand_out(self) -> None:
        """Hand out what the queue has, a pulled batch at a time, round-robin; each
        member's share goes out as one write at the end (or as its window fills)."""
        touched: set[Member] = set()  # connections with buffered pushes
        try:
            await self._hand_out_batches(touched)
        finally:
            with trio.CancelScope(shield=True):
                for conn in touched:
                    await conn.flush_out()

    async def _hand_out_batches(self, touched: set[Member]) -> None:
        cache = self.cache
        while self.serving:
            from_retry = bool(self.retry)
            if from_retry:
                batch = [self.retry[0]]
            else:
                batch, start = await cache.pull(self.queue, self.cursor, 64)
                if start != self.cursor:
                    self.cursor, self.dirty = start, True
                if not batch:
                    return
            for msg in batch:
                if not self.serving:
                    return  # the lease ran out while the pull waited (a cut link)
                if self.retry and not from_retry:
                    break  # a member left with messages: those go first
                conn = self._pick()
                if conn is None:
                    return  # woken again by an ack, a new member or a connect
                if from_retry:
                    self.retry.popleft()
                else:
                    self.cursor = msg.offset_in(self.queue) + 1
                self.dirty = True
                off = msg.offset_in(self.queue)
                self.pending[off] = msg
                touched.add(conn)
                try:
                    sent = await conn.push_shared(self, msg, buffered=True)
                except Exception:
                    log.exception("shared delivery of %s to %s failed", msg.msg_id, conn.peer)
                    sent = False
                if sent:
                    self.delivered += 1
                elif off in self.pending:
                    # Not taken (the member is closing, has left the group, or failed): it
                    # goes first to the next member, never stays pending with no one on
                    # it; the rest of the batch is pulled again after it.
                    del self.pending[off]
                    self.retry.appendleft(msg)
                    self.redelivered += 1
                    if conn.alive:
                        return  # this member refused it: retry on the next wake-up, no spin
                    break


class SharedGroups:
    """The gateway's shared groups, by (group, filter) and by queue: made when a first
    member joins, each with its reader task; gone with their position when the last
    one leaves."""

    def __init__(self, store: Store, cache: GroupCache, background: Background) -> None:
        self.store = store
        self.cache = cache
        self.background = background
        self.groups: dict[tuple[str, str], SharedGroup] = {}
        self.by_queue: dict[str, set[SharedGroup]] = {}
        self._scopes: dict[tuple[str, str], trio.CancelScope] = {}
        # Set on a gateway over a store other gateways may share: groups are leased.
        self.gateway_id: str | None = None
        self.leaser: Leaser | None = None

    def lease_with(self, gateway_id: str, leaser: Leaser) -> None:
        """Hand a group out only while this gateway holds its lease (store.leases)."""
        self.gateway_id, self.leaser = gateway_id, leaser

    async def join(self, s: Session, shared: tuple[str, str]) -> SharedGroup:
        g = await self._group(*shared)
        g.add(s)
        s.groups.add(g)
        return g

    async def _group(self, group: str, topic_filter: str) -> SharedGroup:
        key = (group, topic_filter)
        g = self.groups.get(key)
        if g is not None:
            return g
        pos = await self.store.meta_get("offsets", group_key(group, topic_filter))
        cursor = pos["acked"] if pos else await self.store.queue_end(topic_filter)
        g = self.groups[key] = SharedGroup(self.cache, group, topic_filter, cursor)
        self.by_queue.setdefault(topic_filter, set()).add(g)
        scope = self._scopes[key] = trio.CancelScope()
        self.background.start(_run_group, g, scope)
        if self.leaser is not None:
            g.lease_until = -math.inf  # until the store says this gateway holds it
            try:
                await self._ask({key: g})
            except StoreError as exc:  # the next round of keep_leases asks again
                log.warning("shared group %s: lease not asked yet: %s", g.name, exc)
        return g

    async def keep_leases(self) -> None:
        """Ask for the leases of every group here, every LEASE_ASK_S (gateways over a
        store others share: store.leases)."""
        while True:
            await trio.sleep(LEASE_ASK_S)
            try:
                await self._ask(dict(self.groups))
            except StoreError as exc:  # each holder fences itself if this goes on
                log.debug("shared group leases not renewed: %s", exc)

    async def _ask(self, groups: dict[tuple[str, str], SharedGroup]) -> None:
        if not groups or self.leaser is None or self.gateway_id is None:
            return
        asked_at = trio.current_time()
        holders = await self.leaser.shared_lease(
            self.gateway_id, {group_key(*k): g.serving for k, g in groups.items()})
        for key, g in groups.items():
            if self.groups.get(key) is not g:
                continue  # left meanwhile
            if holders.get(group_key(*key)) != self.gateway_id:
                g.lease_until = -math.inf
                continue
            if not g.serving:  # taken over: resume where the last holder kept it
                await self._resume(g)
            g.lease_until = asked_at + LEASE_FENCE_S
            g.wake()

    async def _resume(self, g: SharedGroup) -> None:
        pos = await self.store.meta_get("offsets", group_key(g.group, g.filter))
        g.pending.clear()  # (what members still hold of it: their acks find nothing)
        g.retry.clear()
        if pos is not None:
            g.cursor = pos["acked"]

    async def leave(self, s: Session, shared: tuple[str, str], *, keep: bool = False
                    ) -> None:
        """`s` leaves the group; the last member out deletes its position from the
        store, unless `keep` (its session went on elsewhere: gateway.takeover)."""
        g = self.groups.get(shared)
        if g is None:
            return
        g.remove(s)
        s.groups.discard(g)
        if not g.members:  # nobody left here: the group goes
            del self.groups[shared]
            self.by_queue[g.queue].discard(g)
            if not self.by_queue[g.queue]:
                del self.by_queue[g.queue]
            self._scopes.pop(shared).cancel()
            elsewhere = await self._read_elsewhere(g)  # (leaves its lease, if any)
            if not keep and not elsewhere:
                await self.store.meta_delete("offsets", group_key(*shared))

    async def _read_elsewhere(self, g: SharedGroup) -> bool:
        """Whether other gateways still read `g`, which this one leaves; its holder
        keeps its position for the next first."""
        if self.leaser is None or self.gateway_id is None:
            return False
        name = group_key(g.group, g.filter)
        if g.serving:
            await self.store.meta_put("offsets", name, _position(g))
        left = await self.leaser.shared_leave(self.gateway_id, [name])
        return bool(left.get(name))

    async def flush_offsets(self) -> None:
        ops = []
        for g in self.groups.values():
            if g.dirty and g.serving:  # (only its holder moves a leased group's position)
                g.dirty = False
                ops.append(("put", "offsets", group_key(g.group, g.filter), _position(g)))
        if ops:
            await self.store.meta_write(ops)


def _position(g: SharedGroup) -> dict[str, int]:
    return {"acked": g.acked_offset(), "next": g.cursor}


async def _run_group(g: SharedGroup, scope: trio.CancelScope) -> None:
    with scope:
        await g.run()
