"""Queue to device: one connection's deliveries, from the light queues its session reads
(and its shared groups) to the protocol core's `deliver`, within the client's window.

One routine, two ways to run it. When nothing needs waiting for (the message is in the
gateway's cache, the session keeps nothing in the store per message, no HTTP hook is to
be asked), it runs right where the news arrives: the notify callback after an append,
or the ack that freed a window slot. Otherwise a task runs it, started on demand and
gone once there is nothing left to send."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import trio

from gateway import offline_bound, replay
from gateway.cache import QueueCache
from gateway.config import GatewayConfig
from gateway.kept_sends import KeptSends
from gateway.mqtt import PublishTemplate
from gateway.mqtt import protocol as mp
from gateway.output import Output
from gateway.retained import RetainedMessage
from gateway.session import Session, Subscription
from gateway.shared import SharedGroup
from gateway.shared_member import SharedMember
from gateway.stats import Stats
from store.api import Message, Store, StoreError

log = logging.getLogger("lightgate.gateway.delivery")

# What a synchronous drain ended with.
DONE, BLOCKED, NEEDS_TASK = range(3)
PAUSE_S = 0.5  # between tries while the store refuses what a delivery writes


class Host(Protocol):
    """The broker, as delivery sees it (gateway.broker.Broker)."""

    store: Store
    cache: QueueCache
    config: GatewayConfig
    stats: Stats
    queue_subs: dict[str, set[Session]]
    deferred: set[Delivery] | None  # deliveries held for the end of a reactor pass

    def template(self, msg: Message) -> PublishTemplate: ...

    async def persist_outgoing(self, s: Session, o: mp.Outgoing) -> None: ...

    async def retained_for(self, topic_filter: str) -> list[RetainedMessage]: ...


class Client(Protocol):
    """A client connection, as delivery sees it (gateway.connection.Connection)."""

    core: mp.MqttProtocol
    session: Session | None
    broker: Host
    peer: str
    alive: bool
    asks_hook: bool
    checks_delivery: bool
    out: Output  # what waits for its socket

    def flush(self) -> None: ...

    async def release_when_kept(self, o: mp.Outgoing) -> None:
        """PUBREL for `o` once its released state is in the store."""

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None: ...

    def may(self, action: str, name: str, is_filter: bool = False) -> bool: ...

    async def may_ask(self, action: str, name: str, is_filter: bool = False) -> bool: ...


class Delivery(SharedMember):
    __slots__ = ("conn", "core", "session", "broker", "_running", "_stopped", "_resume",
                 "_unsent", "_paused", "waits")

    def __init__(self, conn: Client) -> None:
        self.conn = conn
        self.core = conn.core
        self.session: Session = conn.session  # type: ignore[assignment]
        self.broker = conn.broker
        self._running = False  # the delivery task runs
        self._stopped = False
        self._resume = False
        # QoS 0 messages of a persistent session the socket may not have taken yet:
        # (the output's position after it, its queue, its offset), in output order.
        self._unsent: deque[tuple[int, str, int]] | None = None
        self._paused = False  # the store refused what a delivery writes (logged once)
        # A persistent session's delivery waits for the native plane to take it
        # (gateway.native_sessions `Deferred`): nothing is delivered from here until
        # that lets go of it.
        self.waits = False

    # -- starting -------------------------------------------------------------------------
    def start(self, resume: bool = False) -> None:
        """Deliver whatever the session's queues hold (`resume`: a session back from
        offline first resends what was in flight and skips past its offline bound)."""
        if self.waits:  # (a SUBSCRIBE meanwhile: its queue is read from its position)
            return
        if resume:
            self._resume = True
            self._start_task()
            return
        for queue in self.session.reading():
            self.session.dirty.add(queue)
        self.pump()

    def stop(self) -> None:
        self._stopped = True
        s = self.session
        if s.wakeup is not None:
            s.wakeup.set()

    def notify(self, queue: str, cached_only: bool = False) -> None:
        """`queue` grew (the broker's notify callback). Within a pass of the reactor the
        delivery waits for the pass's end: the pass's appends are all in the gateway's
        cache by then, and one write takes them all. `cached_only`: this gateway's own
        append, acknowledged by a separated store, is served from the cache at once; the
        store's notify, when it comes through the bus, has the rest looked for."""
        s = self.session
        s.dirty.add(queue)
        later = self.broker.deferred
        if later is not None:
            later.add(self)
            return
        self.pump(cached_only)

    def window_freed(self) -> None:
        """A QoS 1/2 send completed, or the socket took its backlog."""
        s = self.session
        if s.wakeup is not None:
            s.wakeup.set()  # a task waiting for room (retained messages, a resend)
        if self._unsent and not self.conn.out.backlog:
            self._unsent.clear()  # all of it on the socket
        if s._replays:
            replay.acked(s, self.conn.out.taken)
        if s._dirty:
            self.pump()

    def pump(self, cached_only: bool = False) -> None:
        """Drain the dirty queues here, or wake (or start) the task for what needs it
        (`cached_only`: leave that to the next news)."""
        s = self.session
        if self._stopped or self.waits:
            return
        if self._running:
            if s.wakeup is not None:
                s.wakeup.set()
            return
        for queue in list(s._dirty or ()):
            outcome = self._drain_now(queue)
            if outcome == DONE:
                s.dirty.discard(queue)
            elif outcome == BLOCKED:
                break
            elif not cached_only:
                self._start_task()
                break
        self.conn.flush()

    def _start_task(self) -> None:
        if not self._running and not self._stopped:
            self._running = True
            self.conn.spawn(self._loop)

    # -- the synchronous path -------------------------------------------------------------
    def _drain_now(self, queue: str) -> int:
        s, conn = self.session, self.conn
        if s._replays and replay.holds(s, queue):
            return NEEDS_TASK  # its history goes first, from the task
        if (queue not in s.subscriptions or s._restored_upto or conn.asks_hook
                or not conn.alive):
            return DONE if queue not in s.subscriptions else NEEDS_TASK
        cache = self.broker.cache
        batch = self.broker.config.pull_batch
        while True:
            cursor = s.cursors.get(queue)
            if cursor is None:
                return NEEDS_TASK  # a new subscription: where it starts is the store's
            got = cache.pull_now(queue, cursor, batch)
            if s.cursors.get(queue) != cursor:
                # A reader's catch-up dispatched the native engine's appends inline, and
                # their notify delivered from this queue meanwhile: go on from there.
                continue
            if got is None:
                return NEEDS_TASK
            msgs, start = got
            if start != cursor:
                s.cursors[queue] = start
                s.offsets_dirty.add(queue)
            if not msgs:
                return DONE
            for msg in msgs:
                if self._blocked(msg.qos):
                    return BLOCKED
                if msg.qos and s.persistent:
                    return NEEDS_TASK  # its in-flight record is written first
                plan = self.plan(queue, msg)
                if plan is not None:
                    qos, retain, sids, offset = plan
                    if self._send(msg, qos, retain, sids, queue, offset) and s.persistent:
                        self._sent0(queue, offset)
                s.cursors[queue] = msg.offset_in(queue) + 1
                s.offsets_dirty.add(queue)
            # A short answer is not the queue's end: the cache's window may stop short of
            # it (a reader's fill started it mid-burst, and appends past the gap are not
            # added to it). Only an empty answer, from the store's side, says "caught up".

    def _sent0(self, queue: str, offset: int) -> None:
        """A QoS 0 message of a persistent session went out: until the socket takes it,
        the session resumes there should the connection end (what was only queued for
        the client is sent again, not lost)."""
        out = self.conn.out
        unsent = self._unsent
        if unsent is None:
            unsent = self._unsent = deque()
        taken = out.taken
        while unsent and unsent[0][0] <= taken:
            unsent.popleft()
        unsent.append((out.written + self.core.pending_output, queue, offset))

    def rewind_unsent(self) -> None:
        """The connection ended: a persistent session resumes each queue at its first
        QoS 0 message the socket did not take, and each replay at its last snapshot the
        socket took. (What the kernel's buffers held when it ended is lost.)"""
        s, out = self.session, self.conn.out
        if not s.persistent:
            return
        taken, first, count = out.taken, {}, {}
        if s._replays:
            replay.rewind(s, taken)
        for at, queue, offset in self._unsent if out.lost and self._unsent else ():
            if at > taken:
                first.setdefault(queue, offset)
                count[queue] = count.get(queue, 0) + 1
        for queue, offset in first.items():
            if s.cursors.get(queue, offset) > offset:
                log.info("client %r left with %d QoS 0 messages of %r unwritten: its session "
                         "resumes at offset %d", s.client_id, count[queue], queue, offset)
                s.cursors[queue] = offset
                s.offsets_dirty.add(queue)

    def _blocked(self, qos: int) -> bool:
        """No room: the client's window (QoS 1/2), or too much waiting for its socket,
        the outbox counted (a drain fills it before its flush: one through a backlog held
        10,000 messages of 1 KiB at once). Past the mark it flushes, and looks again."""
        out, core = self.conn.out, self.core
        if qos and core.window <= 0 or out.over:
            return True
        if core.pending_packets and out.would_pass(core.pending_output, core.pending_packets):
            self.conn.flush()  # (a closed connection writes nothing: still no room)
            return out.over or core.pending_packets > 0
        return False

    def _send(self, msg: Message, qos: int, retain: bool, sids: list[int] | None,
              queue: str | None, offset: int, group: SharedGroup | None = None,
              buffer: list[bytes] | None = None) -> mp.Outgoing | bool:
        tpl = None
        if queue is not None and len(self.broker.queue_subs.get(queue, ())) > 1:
            tpl = self.broker.template(msg)  # encoded once for the queue's readers
        try:
            sent = self.core.deliver(msg, qos, retain, sids, queue, offset, group, tpl,
                                     time.time(), buffer)
        except Exception as exc:  # noqa: BLE001 - one bad message must not stop delivery
            self.broker.stats.dropped += 1
            log.error("message %s on %r cannot be sent to %s and is dropped: %s",
                      msg.msg_id, msg.topic, self.conn.peer, exc)
            return False
        stats = self.broker.stats
        if sent is False:
            stats.dropped += 1
            if self.core.version == 5 and "message_expiry_interval" in msg.properties:
                stats.expired += 1
            return False
        stats.messages_out += 1
        stats.messages_out_qos[qos] += 1
        return sent

    def plan(self, queue: str, msg: Message
             ) -> tuple[int, bool, list[int] | None, int] | None:
        """How `msg` of `queue` goes to this session: (QoS, retain flag, subscription
        ids, offset in the queue), or None when it is not for this session."""
        s = self.session
        offset = msg.offset_in(queue)
        if s._restored_upto:
            upto = s.restored_upto.get(queue)
            if upto is not None:
                if offset <= upto:
                    return None  # sent before a restart: acked, or resent with DUP
                del s.restored_upto[queue]
        if s._replays and replay.replayed(s, queue, offset, msg):
            return None  # live, but the replay before it handed it out
        subs = s.readers(queue, msg.topic)
        if not subs:
            return None
        if self.conn.checks_delivery and not self.conn.may("SUB", msg.topic):
            return None  # a wider filter than the policies allow: not for this topic
        if len(subs) > 1 and s.seen(msg.phys_offset):
            return None  # already sent through an overlapping subscription
        if msg.client_id == s.client_id:  # No Local: a v5 option, or a bridge's
            subs = [x for x in subs if not x.options.no_local]
            if not subs:
                return None
        qos = min(msg.qos, max(x.options.qos for x in subs))
        retain = msg.retain and any(x.options.retain_as_published for x in subs)
        sids = [x.subscription_id for x in subs if x.subscription_id] \
            if self.core.version == 5 else None
        if sids and len(sids) > 1:  # one copy: each distinct identifier once (§3.3.4)
            sids = list(dict.fromkeys(sids))
        return qos, retain, sids, offset

    # -- the task ---------------------------------------------------------------------------
    async def _loop(self) -> None:
        s = self.session
        try:
            if self._resume:
                self._resume = False
                await self._resend_outgoing()
                await offline_bound.apply(s, self.broker)
                for queue in s.reading():
                    s.dirty.add(queue)  # catch up with whatever arrived while offline
            while not self._stopped:
                dirty = s.take_dirty()
                if not dirty:
                    return  # nothing left: the task goes, news starts the sync path
                for queue in dirty:
                    try:
                        await self._drain(queue)
                    except StoreError as exc:  # away, or its disk full: keep the client
                        self.paused(exc)
                        s.dirty.add(queue)
                        await trio.sleep(PAUSE_S)
                    else:
                        self.resumed()
        finally:
            self._running = False
        if s._dirty and not self._stopped:
            self.pump()

    def paused(self, exc: StoreError) -> None:
        """The store refused a write this delivery needs (a message's in-flight record,
        a PUBREL's state): tried again every PAUSE_S, said once."""
        if not self._paused:
            self._paused = True
            log.warning("delivery to %r paused: %s (tried again every %.1f s)",
                        self.session.client_id, exc, PAUSE_S)

    def resumed(self) -> None:
        if self._paused:
            self._paused = False
            log.info("delivery to %r resumed", self.session.client_id)

    async def _drain(self, queue: str) -> None:
        s, cache = self.session, self.broker.cache
        if s._replays and (r := replay.holds(s, queue)) is not None:
            await replay.step(self, queue, r)  # a batch of its history
            return
        while queue in s.subscriptions and not self._stopped:
            cursor = s.cursors.get(queue)
            if cursor is None:
                cursor = s.cursors[queue] = await self.broker.store.queue_end(queue)
            msgs, start = await cache.pull(queue, cursor, self.broker.config.pull_batch)
            if start != cursor:
                s.cursors[queue] = cursor = start
                s.offsets_dirty.add(queue)
            if not msgs:
                return
            kept = KeptSends(lambda sends: self.broker.persist_outgoing(s, *sends),
                             self.core.send_encoded)
            try:
                for msg in msgs:
                    if queue not in s.subscriptions or self._stopped:
                        return
                    if kept.waiting and self._blocked(msg.qos):
                        await kept.keep()
                    await self._wait_room(msg.qos)
                    plan = self.plan(queue, msg)
                    if plan is not None and not (self.conn.asks_hook
                                                 and await self._hook_refuses(msg.topic)):
                        qos, retain, sids, offset = plan
                        if await self._push(msg, qos, retain, sids, queue, offset, kept=kept) \
                                and not qos and s.persistent:
                            self._sent0(queue, offset)
                    s.cursors[queue] = msg.offset_in(queue) + 1
                    s.offsets_dirty.add(queue)
                await kept.keep()
            finally:
                kept.drop(s, queue)  # a write that failed: delivered anew from there
                self.conn.flush()

    async def _hook_refuses(self, topic: str) -> bool:
        """Whether the HTTP hook refuses this delivery to a client it decides for: a
        filter it allowed may catch topics it denies (answers are cached per topic)."""
        return not await self.conn.may_ask("SUB", topic)

    async def _wait_room(self, qos: int) -> None:
        s = self.session
        while self._blocked(qos) and not self._stopped:
            self.conn.flush()
            if s.wakeup is None or s.wakeup.is_set():
                s.wakeup = trio.Event()
            await s.wakeup.wait()

    async def _push(self, msg: Message, qos: int, retain: bool, sids: list[int] | None,
                    queue: str | None, offset: int, group: SharedGroup | None = None,
                    kept: KeptSends | None = None) -> bool:
        """Send one message (the window has room). False if dropped. A persistent
        session's QoS 1/2 PUBLISH goes to the outbox only once its in-flight record is
        in the store (gateway.kept_sends; with `kept`, it waits there for the batch)."""
        s = self.session
        held: list[bytes] | None = [] if (
            qos and s.persistent and queue is not None and group is None) else None
        o = self._send(msg, qos, retain, sids, queue, offset, group, held)
        if o is False:
            return False
        if held and isinstance(o, mp.Outgoing):
            if kept is not None:
                kept.add(o, held[0], msg.offset_in(queue))
                return True
            try:
                await self.broker.persist_outgoing(s, o)
            except BaseException:
                # Never sent: its window slot and packet id are free again, and the
                # message is delivered anew when the delivery goes on.
                if s.outgoing.get(o.packet_id) is o:
                    del s.outgoing[o.packet_id]
                raise
            self.core.send_encoded(held[0])
        return True

    async def _resend_outgoing(self) -> None:
        """Resend what the session had in flight, in order, within this connection's
        Receive Maximum (MQTT 5 §4.9: it may be smaller than the last connection's)."""
        s, core = self.session, self.core
        inflight = list(s.outgoing.values())  # acks change it while this task sends
        held = [o for o in inflight if o.state != "pubrel"]
        for o in inflight:
            if o.state == "pubrel":  # counts against the window, but is always sent
                # Its state may not be in the store yet (the last connection ended
                # before it was kept): kept before the client can complete it.
                await self.conn.release_when_kept(o)
        limit = min(core.receive_maximum, core.limits.max_inflight)
        for i, o in enumerate(held):
            # In flight on this connection: everything outgoing but what is still held
            # (a client may acknowledge a held one it received before the reconnect).
            while s.outgoing.get(o.packet_id) is o and len(s.outgoing) - sum(
                    s.outgoing.get(x.packet_id) is x for x in held[i:]) >= limit:
                self.conn.flush()
                if s.wakeup is None or s.wakeup.is_set():
                    s.wakeup = trio.Event()
                await s.wakeup.wait()
                if self._stopped:
                    return
            if s.outgoing.get(o.packet_id) is not o:
                continue
            core.resend(o, self.broker.template(o.message) if o.message is not None else None)
        self.conn.flush()

    # -- retained messages on SUBSCRIBE -------------------------------------------------------
    async def retained(self, subs: list[Subscription]) -> list[bytes]:
        """The retained messages for new subscriptions, encoded to follow the SUBACK,
        while the window has room; the rest go from a task of their own (waiting here
        for a slot would wait for an ack only this connection's reader could read)."""
        conn = self.conn
        todo = []
        for sub in subs:
            for r in await self.broker.retained_for(sub.topic_filter):
                if conn.checks_delivery and not conn.may("SUB", r.topic) \
                        or conn.asks_hook and await self._hook_refuses(r.topic):
                    continue
                qos = min(r.qos, sub.options.qos)
                sids = [sub.subscription_id] if sub.subscription_id else None
                todo.append((r.to_message(), qos, sids))
        out: list[bytes] = []
        sent, size = 0, 0
        # Within the window and the high-water mark: a SUBSCRIBE to `#` must not put
        # every retained message before a client that does not read.
        while sent < len(todo) and (not todo[sent][1] or self.core.window > 0) \
                and not conn.out.would_pass(size, len(out)):
            msg, qos, sids = todo[sent]
            if self.core.deliver(msg, qos, True, sids if self.core.version == 5 else None,
                                 None, -1, buffer=out, now_s=time.time()) is not False:
                size += len(out[-1])
            self.broker.stats.messages_out += 1
            sent += 1
        if sent < len(todo):
            self.conn.spawn(self._push_retained, todo[sent:])
        return out

    async def _push_retained(self, todo: list[tuple[Message, int, list[int] | None]]) -> None:
        for msg, qos, sids in todo:
            await self._wait_room(qos)
            if self._stopped:
                return
            await self._push(msg, qos, True, sids if self.core.version == 5 else None, None, -1)
            self.conn.flush()

    def send_now(self, msg: Message, retain: bool, sids: list[int] | None) -> bool:
        """A QoS 0 message of the broker's own, now: a `$SYS` value (gateway.statistics)."""
        return self._send(msg, 0, retain, sids, None, -1) is not False

