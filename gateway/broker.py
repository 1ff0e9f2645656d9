"""The gateway's shared state: sessions, who is subscribed to which queue, retained
messages, wills, and the notify loop that wakes sessions (DESIGN.md steps 5-7)."""

from __future__ import annotations

import logging
import sys
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

from gateway import replay
from gateway.cache import QueueCache
from gateway.inbound import Inbound
from gateway.limits import SourceRateLimiter
from gateway.mqtt import PublishTemplate, Will
from gateway.mqtt.properties import publish_properties
from gateway.mqtt.protocol import Limits
from gateway.reserved import SERVER_ID
from gateway.retained import RetainedBudget, RetainedLimits, stored_size
from gateway.session import (
    NEVER_EXPIRES,
    NUL,
    Outgoing,
    Session,
    Subscription,
    in_key,
    offset_key,
    out_key,
    qos2_key,
    sub_key,
)
from gateway.shared import SharedGroup, group_key
from lightqueue.topic import is_wildcard, matches
from serving.read_budget import ReadBudget
from store.api import AUTH_EVENT, AuthManager, Message, Store, StoreError

log = logging.getLogger("lightgate.gateway")


@dataclass
class GatewayConfig:
    max_inflight: int = 32  # QoS 1/2 messages unacknowledged per client (server side)
    max_packet_size: int = 1024 * 1024  # as EMQX; a larger payload belongs in object storage
    # Before CONNECT nobody is authenticated: the first packet may not be larger.
    max_connect_packet: int = 64 * 1024
    # Bytes of partially received packets the whole node holds before the connections
    # holding the most stop reading; closed if still over after partial_timeout.
    max_partial_bytes: int = 64 * 1024 * 1024
    partial_timeout_s: float = 10.0
    max_pending_publishes: int = 64  # inbound publishes in the store pipeline per client
    max_offline_messages: int = 10_000  # per queue of a persistent session; older dropped
    connect_timeout: float = 10.0
    pull_batch: int = 256
    offsets_flush_interval: float = 0.5
    sys_interval: float = 10.0
    expiry_check_interval: float = 30.0
    max_qos: int = 2
    max_keepalive: int = 0  # 0: accept any; else clients get Server Keep Alive (v5)
    write_timeout: float = 60.0  # a client that reads nothing this long is disconnected
    topic_alias_maximum: int = 64  # per connection, client to server (v5)
    # Limits; 0 means unlimited.
    max_connections: int = 0
    max_connect_rate: float = 0.0  # connects per second per source IP
    max_publish_rate: float = 0.0  # publishes per second per client
    max_publish_bytes_rate: float = 0.0  # publish payload bytes per second per client
    max_subscriptions: int = 1000  # per client (0: no limit)
    max_topic_levels: int = 128  # of a topic name or filter
    max_topic_length: int = 4096  # characters of a topic name or filter
    # Retained messages, in total and per publishing client (0: no limit).
    max_retained: int = 100_000
    max_retained_bytes: int = 256 * 1024 * 1024
    max_retained_per_client: int = 1000
    max_retained_bytes_per_client: int = 16 * 1024 * 1024
    # Persistent sessions: 3.1.1 has no session expiry, so without one an abandoned
    # client id is kept forever. New persistent sessions past max_sessions are refused.
    v3_session_expiry_s: float = 7200.0  # as EMQX; 0: never (3.1.1's own rule)
    max_sessions: int = 100_000
    max_offline_bytes: int = 64 * 1024 * 1024  # per queue of an offline session
    http_max_body: int = 1024 * 1024  # admin API and dashboard (413 past it)
    # How often the wildcard filters this gateway's sessions read are touched in the
    # store, which unregisters those nobody touched for its --wildcard-idle-s.
    wildcard_touch_s: float = 60.0


class SessionLimitReached(Exception):
    """No new persistent session: the node holds --max-sessions already."""


@dataclass
class RetainedMessage:
    topic: str
    body: bytes
    qos: int
    properties: dict[str, Any]
    client_id: str
    ts: int
    phys_offset: int = -1  # where it is in the CommitLog (while retention keeps it)

    def to_meta(self) -> dict[str, Any]:
        return {"body": self.body, "qos": self.qos, "props": self.properties,
                "client_id": self.client_id, "ts": self.ts, "phys": self.phys_offset}

    @classmethod
    def from_meta(cls, topic: str, d: dict[str, Any]) -> RetainedMessage:
        return cls(topic, d["body"], d["qos"], d.get("props") or {}, d.get("client_id", ""),
                   d.get("ts", 0), d.get("phys", -1))

    def to_message(self) -> Message:
        return Message(self.topic, self.body, self.qos, True, self.client_id, self.properties,
                       store_ts=self.ts, phys_offset=self.phys_offset)


APPEND_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Stats:
    def __init__(self) -> None:
        self.started = time.time()
        self.messages_in_qos = [0, 0, 0]
        self.messages_out_qos = [0, 0, 0]
        self.notify_events = 0
        # Store append latency as the gateway sees it (submit -> durable ack), cumulative
        # bucket counts for a Prometheus histogram.
        self.append_buckets = [0] * len(APPEND_BUCKETS)
        self.append_count = 0
        self.append_sum = 0.0
        self.connections = 0
        self.connects_total = 0
        self.messages_in = 0
        self.messages_out = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.dropped = 0
        self.expired = 0
        self.publish_errors = 0
        self.wills = 0
        self.stuck_disconnects = 0
        self.limit_refusals = 0  # connects, publishes, subscribes refused by a limit
        self.sessions_refused = 0  # new persistent sessions past --max-sessions
        self.sessions_expired = 0
        self.offline_dropped = 0  # skipped past --max-offline-messages / -bytes
        self.topic_refusals = 0  # topics past --max-topic-levels / --max-topic-length
        self.store_errors = 0  # store calls of background work that failed (retried later)

    def observe_append(self, seconds: float) -> None:
        self.append_count += 1
        self.append_sum += seconds
        for i, bound in enumerate(APPEND_BUCKETS):
            if seconds <= bound:
                self.append_buckets[i] += 1


class Broker:
    def __init__(self, store: Store, config: GatewayConfig | None = None,
                 auth: AuthManager | None = None) -> None:
        self.store = store
        self.config = config or GatewayConfig()
        self.auth = auth or AuthManager(store)  # disabled unless configured
        self.auth.on_change(self._auth_changed)
        self.connect_limiter = SourceRateLimiter(self.config.max_connect_rate)
        self.read_budget = ReadBudget(self.config.max_partial_bytes, self.config.partial_timeout_s)
        cfg = self.config
        # 0 in the config means no limit.
        self.max_topic_levels = cfg.max_topic_levels or sys.maxsize
        self.max_topic_length = cfg.max_topic_length or sys.maxsize
        self.retained = RetainedBudget(RetainedLimits(
            cfg.max_retained, cfg.max_retained_bytes, cfg.max_retained_per_client,
            cfg.max_retained_bytes_per_client))
        # Persistent sessions in the store: counted by each expiry sweep, plus those
        # made and discarded here since.
        self.persistent_sessions = 0
        self.sessions: dict[str, Session] = {}
        # One CONNECT per client id at a time (takeover, load, attach): [lock, users].
        self._connect_locks: dict[str, list[Any]] = {}
        self.queue_subs: dict[str, set[Session]] = {}
        self.cache = QueueCache(store)
        self.stats = Stats()
        self._templates: OrderedDict[int, PublishTemplate] = OrderedDict()
        self.groups: dict[tuple[str, str], SharedGroup] = {}
        self._group_scopes: dict[tuple[str, str], trio.CancelScope] = {}
        self.queue_groups: dict[str, set[SharedGroup]] = {}
        self._nursery: trio.Nursery | None = None
        # Wills waiting out their Will Delay Interval, by client id: (will, due as epoch
        # seconds, the scope that cancels the wait). Kept in the session's record too.
        self._pending_wills: dict[str, tuple[Will, float, trio.CancelScope]] = {}
        self.limits = Limits(
            max_packet_size=cfg.max_packet_size, max_connect_packet=cfg.max_connect_packet,
            max_qos=cfg.max_qos, topic_alias_maximum=cfg.topic_alias_maximum,
            max_inflight=cfg.max_inflight, receive_maximum=cfg.max_pending_publishes,
            max_keepalive=cfg.max_keepalive, connect_timeout=cfg.connect_timeout,
            v3_session_expiry=int(cfg.v3_session_expiry_s) or NEVER_EXPIRES)
        self.inbound = Inbound(self)
        # Deliveries news reached within a pass of the reactor: run at the pass's end.
        self.deferred: set[Any] | None = None
        self._retaining: dict[str, Message] = {}  # stored, their retained record to come
        # Tasks connections start on demand (their lanes, deliveries, writers, ends).
        self.connection_nursery: trio.Nursery | None = None

    async def run_connections(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Where connections' tasks run, and the inbound pipeline's flusher."""
        async with trio.open_nursery() as nursery:
            self.connection_nursery = nursery
            await nursery.start(self.inbound.run)
            task_status.started()

    def topic_past_limits(self, topic: str) -> bool:
        """Whether a topic name or filter is past --max-topic-length (characters) or
        --max-topic-levels."""
        return len(topic) > self.max_topic_length or topic.count("/") >= self.max_topic_levels

    def assign_client_id(self) -> str:
        """An id for a client that sent none: unique across restarts and gateways."""
        return f"lg-{uuid.uuid4().hex[:20]}"

    # -- auth -------------------------------------------------------------------------
    def _auth_changed(self) -> None:
        """Users or policies changed: end sessions of disabled or deleted users now."""
        for s in list(self.sessions.values()):
            conn = s.connection
            if conn is not None and conn.subject is not None:
                if not self.auth.still_valid(conn.subject):
                    conn.kick("user disabled or deleted", not_authorized=True)
                else:
                    conn.auth_changed()

    async def _reload_auth(self) -> None:
        try:
            await self.auth.load()
        except Exception as exc:  # the store may be away: the periodic refresh retries
            log.warning("reloading users and policies failed: %s", exc)

    async def run_auth_refresh(self) -> None:
        """A gateway on a remote store: reload users and policies on AUTH_EVENT (see
        on_queues_changed) and every few seconds in case an event was lost."""
        await self.auth.run_refresh()

    # -- notify -----------------------------------------------------------------------
    def on_queues_changed(self, names: set[str]) -> None:
        """Wake every live session subscribed to a queue that grew."""
        self.stats.notify_events += len(names)
        if AUTH_EVENT in names and self._nursery is not None:
            self._spawn(self._reload_auth)
        for name in names:
            if name == "*":  # notify lost events (e.g. Redis reconnect): look everywhere
                for s in self.sessions.values():
                    if s.connection is not None:
                        for q in s.subscriptions:
                            s.notify(q)
                continue
            for session in self.queue_subs.get(name, ()):
                conn = session.connection
                if conn is not None and conn.delivery is not None:
                    _notify(conn, session, name)
                else:
                    session.notify(name)
            for group in self.queue_groups.get(name, ()):
                group.wake()

    async def run_notify(self, bus: Any) -> None:
        if getattr(bus, "window", None) == 0 and hasattr(bus, "listen"):
            with bus.listen(self.on_queues_changed):  # in-process: no task in between
                await trio.sleep_forever()
        async with bus.subscribe() as events:
            async for names in events:
                self.on_queues_changed(names)

    async def run_poll_fallback(self, bus: Any | None, interval: float = 0.2) -> None:
        """While notify is down (or absent), poll the ends of subscribed queues so that
        delivery goes on, slower; push takes over again when the bus is healthy."""
        last: dict[str, int] = {}
        polling = False
        while True:
            await trio.sleep(interval)
            if bus is not None and bus.healthy:
                if polling:
                    log.warning("notify is back: polling stops")
                polling = False
                last.clear()
                continue
            if not polling and bus is not None:
                log.warning("notify is down: polling queue ends every %.1fs", interval)
            polling = True
            queues = [*self.queue_subs, *self.queue_groups]
            if not queues:
                continue
            try:
                ends = await self.store.queue_ends(queues)
            except Exception as exc:
                log.debug("poll of queue ends failed: %s", exc)
                continue
            grown = {q for q, end in ends.items() if end != last.get(q)}
            last.update(ends)
            if grown:
                self.on_queues_changed(grown)

    # -- sessions ---------------------------------------------------------------------
    async def open_session(
        self, client_id: str, clean_start: bool, expiry: int, version: int,
        connection: Any = None,
    ) -> tuple[Session, bool]:
        """The session for a new connection, attached to `connection`, and whether one was
        present. CONNECTs with the same client id are taken one at a time, in order, so
        the last one wins: two at once both stayed connected, holding one session."""
        async with self._connect_lock(client_id):
            session, present = await self._open_session(client_id, clean_start, expiry,
                                                        version, self._owner(connection))
            if connection is not None:
                session.connection = connection
            return session, present

    @asynccontextmanager
    async def _connect_lock(self, client_id: str) -> AsyncIterator[None]:
        entry = self._connect_locks.get(client_id)
        if entry is None:
            entry = self._connect_locks[client_id] = [trio.Lock(), 0]
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if entry[1] == 0:  # nobody holds or waits: no entry per client id ever seen
                del self._connect_locks[client_id]

    def _owner(self, connection: Any) -> str | None:
        """The identity a session made on `connection` belongs to (None: auth off)."""
        subject = getattr(connection, "subject", None)
        if not self.auth.enabled or subject is None:
            return None
        return f"{subject.backend}:{subject.name}"

    async def _open_session(
        self, client_id: str, clean_start: bool, expiry: int, version: int,
        owner: str | None = None,
    ) -> tuple[Session, bool]:
        session = self.sessions.get(client_id)
        if session is not None and session.connection is not None:
            await session.connection.take_over()  # closed, will sent, session detached
            session = self.sessions.get(client_id)
        pending = self._pending_wills.pop(client_id, None)
        if pending is not None:
            pending[2].cancel()
            if clean_start:  # the session ends: its will goes now [MQTT-3.1.2-8]
                self._spawn(self.publish_will, client_id, pending[0])
            else:  # back within the delay: no will [MQTT-3.1.3-9]
                await self._drop_stored_will(client_id, pending[1])
        if clean_start:
            if session is not None or await self.store.meta_get("sessions", client_id):
                await self.discard_session(client_id)
            session, present = None, False
        elif session is not None:
            present = True
        else:
            session = await self._load_session(client_id)
            present = session is not None
        if session is not None and owner is not None and session.owner not in (None, owner):
            # Another identity with the same client id: its subscriptions, what it had
            # in flight and what it missed were allowed for the other one. A fresh start.
            log.info("client id %r: session of %s not resumed by %s: starting clean",
                     client_id, session.owner, owner)
            await self.discard_session(client_id)
            session, present = None, False
        if session is None:
            if expiry > 0 and self.config.max_sessions \
                    and self.persistent_sessions >= self.config.max_sessions:
                self.stats.limit_refusals += 1
                self.stats.sessions_refused += 1
                raise SessionLimitReached(
                    f"{self.persistent_sessions} persistent sessions held (--max-sessions)")
            session = Session(client_id, persistent=expiry > 0, version=version, expiry=expiry)
            self.sessions[client_id] = session
            if expiry > 0:
                self.persistent_sessions += 1
        session.persistent = expiry > 0
        session.expiry = expiry
        session.version = version
        session.disconnected_at = None
        if owner is not None:
            session.owner = owner
        if session.persistent:
            await self.store.meta_put("sessions", client_id, {"version": version,
                                                               "expiry": expiry,
                                                               "owner": session.owner})
        return session, present

    async def _load_session(self, client_id: str) -> Session | None:
        info = await self.store.meta_get("sessions", client_id)
        if info is None:
            return None
        s = Session(client_id, persistent=True, version=info.get("version", 4),
                    expiry=info.get("expiry", NEVER_EXPIRES), owner=info.get("owner"))
        for key, value in await self.store.meta_items("subscriptions", client_id + NUL):
            sub = Subscription.from_meta(key.split(NUL, 1)[1], value)
            s.add_subscription(sub)
            if sub.shared:
                (await self._group(*sub.shared)).add(s)
                s.groups.add(self.groups[sub.shared])
            else:
                self._index_sub(s, sub.queue)
        for sub in s.subscriptions.values():
            if sub.shared:
                continue
            pos = await self.store.meta_get("offsets", offset_key(client_id, sub.queue))
            replay.restore(s, sub, pos)
            if pos is not None:
                # Resume at the first unacknowledged offset; what lies between it and the
                # next unsent one was acknowledged or is resent from the in-flight state.
                s.cursors[sub.queue] = pos["acked"]
                if pos["next"] > pos["acked"]:
                    s.restored_upto[sub.queue] = pos["next"] - 1
        for key, value in await self.store.meta_items("inflight", client_id + NUL):
            _, direction, pid = key.split(NUL)
            if direction == "in":
                if "done" not in value:
                    s.incoming_qos2.add(int(pid))
                    if "phys" in value:
                        s.incoming_phys[int(pid)] = value["phys"]
            else:
                await self._restore_outgoing(s, int(pid), value)
        self.sessions[client_id] = s
        log.info("session %r restored from the store (%d subscriptions, %d in flight)",
                 client_id, len(s.subscriptions), len(s.outgoing))
        return s

    async def _restore_outgoing(self, s: Session, pid: int, value: dict[str, Any]) -> None:
        queue, offset, state = value["queue"], value["offset"], value["state"]
        res = await self.store.pull(queue, offset, 1)
        if not res.messages or res.messages[0].offset_in(queue) != offset:
            return  # gone by retention: nothing to resend
        msg = res.messages[0]
        qos = value.get("qos", msg.qos)
        data = self.template(msg).for_subscriber(pid, False, version=s.version, qos=qos,
                                                 retain=False)
        s.outgoing[pid] = Outgoing(pid, queue, offset, data, qos, state, message=msg,
                                   version=s.version)
        s.restored_upto[queue] = max(offset, s.restored_upto.get(queue, -1))
        s.next_packet_id = pid % 65535 + 1

    async def discard_session(self, client_id: str) -> None:
        s = self.sessions.pop(client_id, None)
        if s is None or s.persistent:
            self.persistent_sessions = max(0, self.persistent_sessions - 1)
        if s is not None:
            for o in s.outgoing.values():
                if o.group is not None:  # a QoS 2 kept for it: nobody else gets it
                    o.group.acked(o.offset)
        if s is not None:
            for sub in list(s.subscriptions.values()):
                if sub.shared:
                    await self._leave_group(s, sub.shared)
                else:
                    self._unindex_sub(s, sub.queue)
        await self.store.meta_write([
            ("delete", "sessions", client_id, None),
            ("delete_prefix", "subscriptions", client_id + NUL, None),
            ("delete_prefix", "offsets", offset_key(client_id, ""), None),
            ("delete_prefix", "inflight", client_id + NUL, None),
        ])

    async def session_detached(self, session: Session) -> None:
        """The connection of `session` closed; keep or drop the session per its expiry."""
        session.connection = None
        session.disconnected_at = time.time()
        if not session.persistent:
            if self.sessions.get(session.client_id) is session:
                await self.discard_session(session.client_id)
            return
        await self.flush_offsets(session)
        info: dict[str, Any] = {"version": session.version, "expiry": session.expiry,
                                "disconnected_at": session.disconnected_at,
                                "owner": session.owner}
        pending = self._pending_wills.get(session.client_id)
        if pending is not None:  # kept with the session: published after a restart too
            will, due, _ = pending
            info["will"] = {"topic": will.topic, "payload": will.payload, "qos": will.qos,
                            "retain": will.retain, "props": will.properties, "due": due}
        await self.store.meta_put("sessions", session.client_id, info)
        if session.expiry != NEVER_EXPIRES:
            self._spawn(self._expire_later, session)

    # -- subscriptions ----------------------------------------------------------------
    def _index_sub(self, s: Session, queue: str) -> None:
        self.queue_subs.setdefault(queue, set()).add(s)

    def _unindex_sub(self, s: Session, queue: str) -> None:
        subs = self.queue_subs.get(queue)
        if subs is not None:
            subs.discard(s)
            if not subs:
                del self.queue_subs[queue]

    async def subscribe(self, s: Session, sub: Subscription) -> bool:
        """Add or replace a subscription; a new one starts at its queue's end."""
        if is_wildcard(sub.queue):
            await self.store.add_wildcard(sub.queue)  # no admin step (rocketmq-mqtt #196)
        new = s.add_subscription(sub)
        if sub.shared:
            group = await self._group(*sub.shared)
            group.add(s)
            s.groups.add(group)
        else:
            if new:
                s.cursors[sub.queue] = await self.store.queue_end(sub.queue)
                s.offsets_dirty.add(sub.queue)
            self._index_sub(s, sub.queue)
        if s.persistent:
            await self.store.meta_put("subscriptions", sub_key(s.client_id, sub.topic_filter),
                                      sub.to_meta())
            await self.flush_offsets(s)
        return new

    async def unsubscribe(self, s: Session, topic_filter: str) -> bool:
        sub = s.subscription(topic_filter)
        if sub is None:
            return False
        s.remove_subscription(topic_filter)
        if sub.shared:
            await self._leave_group(s, sub.shared)
        else:
            self._unindex_sub(s, sub.queue)
        if s.persistent:
            await self.store.meta_write([
                ("delete", "subscriptions", sub_key(s.client_id, topic_filter), None),
                ("delete", "offsets", offset_key(s.client_id, sub.queue), None),
            ])
        return True

    # -- shared subscriptions -----------------------------------------------------------
    async def _group(self, group: str, topic_filter: str) -> SharedGroup:
        key = (group, topic_filter)
        g = self.groups.get(key)
        if g is not None:
            return g
        pos = await self.store.meta_get("offsets", group_key(group, topic_filter))
        cursor = pos["acked"] if pos else await self.store.queue_end(topic_filter)
        g = self.groups[key] = SharedGroup(self.cache, group, topic_filter, cursor)
        self.queue_groups.setdefault(topic_filter, set()).add(g)
        assert self._nursery is not None, "housekeeping must run before clients connect"
        scope = self._group_scopes[key] = trio.CancelScope()
        self._nursery.start_soon(self._run_group, g, scope)
        return g

    async def _run_group(self, g: SharedGroup, scope: trio.CancelScope) -> None:
        with scope:
            await g.run()

    async def _leave_group(self, s: Session, shared: tuple[str, str]) -> None:
        g = self.groups.get(shared)
        if g is None:
            return
        g.remove(s)
        s.groups.discard(g)
        if not g.members:  # nobody left: the group and its position go
            del self.groups[shared]
            self.queue_groups[g.queue].discard(g)
            if not self.queue_groups[g.queue]:
                del self.queue_groups[g.queue]
            self._group_scopes.pop(shared).cancel()
            await self.store.meta_delete("offsets", group_key(*shared))

    async def flush_group_offsets(self) -> None:
        ops = []
        for g in self.groups.values():
            if g.dirty:
                g.dirty = False
                ops.append(("put", "offsets", group_key(g.group, g.filter),
                            {"acked": g.acked_offset(), "next": g.cursor}))
        if ops:
            await self.store.meta_write(ops)

    # -- wills and expiry ---------------------------------------------------------------
    def schedule_will(self, s: Session, will: Will) -> None:
        """Publish the will now, or after its Will Delay Interval unless the client is
        back by then (MQTT 5 §3.1.3.2.2); never later than the session's end."""
        delay = int(will.properties.get("will_delay_interval", 0))
        if s.persistent and s.expiry != NEVER_EXPIRES:
            delay = min(delay, s.expiry)
        elif not s.persistent:
            delay = 0
        if delay <= 0 or self._nursery is None:
            self._spawn(self.publish_will, s.client_id, will)
        else:
            self._hold_will(s.client_id, will, time.time() + delay, restored=False)

    def _hold_will(self, client_id: str, will: Will, due: float, restored: bool) -> None:
        """Publish `will` at `due` unless a connection to its session comes first
        (open_session cancels it) [MQTT-3.1.3-9]."""
        scope = trio.CancelScope()
        self._pending_wills[client_id] = (will, due, scope)
        self._spawn(self._delayed_will, client_id, will, due, scope, restored)

    async def _delayed_will(self, client_id: str, will: Will, due: float,
                            scope: trio.CancelScope, restored: bool) -> None:
        with scope:
            await trio.sleep(max(0.0, due - time.time()))
        pending = self._pending_wills.get(client_id)
        if scope.cancelled_caught or pending is None or pending[2] is not scope:
            return  # the client is back (or a newer will took its place)
        del self._pending_wills[client_id]
        if restored:
            # Read from the store at start: the client may have come back through
            # another gateway, which rewrote the record without the will.
            info = await self.store.meta_get("sessions", client_id)
            if info is not None and "will" not in info:
                return
        await self.publish_will(client_id, will)
        async with self._connect_lock(client_id):
            await self._drop_stored_will(client_id, due)

    async def _drop_stored_will(self, client_id: str, due: float) -> None:
        """Remove the will due at `due` from the session's record (it went, or the
        client is back); a record written since is left alone."""
        info = await self.store.meta_get("sessions", client_id)
        if info is not None and (info.get("will") or {}).get("due") == due:
            del info["will"]
            await self.store.meta_put("sessions", client_id, info)

    async def _restore_sessions(self) -> None:
        """One scan of the stored sessions at start: how many there are (for
        --max-sessions; each expiry sweep counts again), and the wills whose delay was
        running when the gateway stopped: published when due, or at once if overdue
        (the record holds when)."""
        try:
            items = await self.store.meta_items("sessions")
        except StoreError as exc:  # separated mode, store away: the expiry sweep counts
            log.warning("stored sessions not counted, pending wills not restored: %s", exc)
            return
        self.persistent_sessions = len(items)
        for client_id, info in items:
            w = info.get("will")
            if w and client_id not in self._pending_wills:
                will = Will(w["topic"], w["payload"], w["qos"], w["retain"], w["props"] or {})
                self._hold_will(client_id, will, w["due"], restored=True)

    def _spawn(self, fn: Any, *args: Any) -> None:
        """Background work (expiry, delayed wills) in the housekeeping nursery. At
        shutdown that nursery closes while connections are still closing: what they
        would start is left to the next start, which restores sessions and wills from
        the store."""
        if self._nursery is None:
            return
        try:
            self._nursery.start_soon(self._guarded, fn, *args)
        except RuntimeError:  # "Nursery is closed to new arrivals"
            log.debug("shutting down: %s not started", getattr(fn, "__name__", fn))

    async def _guarded(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run background work that must not end the gateway: a store away, hung or
        refusing (or a bug) is logged and counted; whatever retries does so later (the
        loops' next round, the expiry sweep, the stored will record)."""
        try:
            await fn(*args)
        except StoreError as exc:
            self.stats.store_errors += 1
            log.warning("%s failed, tried again later: %s", _what(fn), exc)
        except Exception:
            self.stats.store_errors += 1
            log.exception("%s failed", _what(fn))

    async def _every(self, interval: float, fn: Callable[[], Awaitable[Any]], *,
                     at_once: bool = False) -> None:
        """`fn` every `interval` seconds for as long as the gateway runs (guarded)."""
        if not at_once:
            await trio.sleep(interval)
        while True:
            await self._guarded(fn)
            await trio.sleep(interval)

    async def _expire_later(self, s: Session) -> None:
        await trio.sleep(s.expiry)
        if self.sessions.get(s.client_id) is s and s.expired():
            log.info("session %r expired after %ds offline", s.client_id, s.expiry)
            try:
                await self.discard_session(s.client_id)
                self.stats.sessions_expired += 1
            except StoreError as exc:  # the periodic expiry check will try again
                log.warning("expired session %r not removed yet: %s", s.client_id, exc)

    async def flush_offsets(self, s: Session) -> None:
        """Persist where each queue of `s` resumes: the first unacknowledged offset."""
        if not s.persistent or not s.has_dirty_offsets():
            return
        ops = []
        for queue in s.offsets_dirty:
            acked = s.acked_offset(queue)
            if acked is not None and queue in s.subscriptions:
                pos = {"acked": acked, "next": s.cursors.get(queue, acked)}
                if s._replays and (progress := replay.meta(s, queue)) is not None:
                    pos["replay"] = progress
                ops.append(("put", "offsets", offset_key(s.client_id, queue), pos))
        if ops:
            await self.store.meta_write(ops)
        s.offsets_dirty.clear()

    async def persist_outgoing(self, s: Session, o: Outgoing) -> None:
        if s.persistent and o.queue is not None:
            await self.store.meta_put("inflight", out_key(s.client_id, o.packet_id),
                                      {"queue": o.queue, "offset": o.offset, "state": o.state,
                                       "qos": o.qos})

    async def forget_outgoing(self, s: Session, o: Outgoing) -> None:
        if s.persistent and o.queue is not None:
            try:
                await self.store.meta_delete("inflight", out_key(s.client_id, o.packet_id))
            except StoreError as exc:  # the store is away (a failover): the client's ack
                # stands; the stale record only means a resend with DUP after a restart
                log.warning("in-flight record of %r not removed: %s", s.client_id, exc)
            s.offsets_dirty.add(o.queue)

    async def remember_incoming_qos2(self, s: Session, pid: int, done: bool,
                                     phys: int = -1) -> None:
        """`phys`: where the publish's record is (its key is qos2_key). Released, the
        marker keeps that position: a crash may leave a later publish with this id stored
        but unmarked, and `stored_qos2` tells the two apart by it."""
        if s.persistent:
            if done:
                phys = s.incoming_phys.pop(pid, -1)
                if phys >= 0:
                    await self.store.meta_put("inflight", in_key(s.client_id, pid),
                                              {"done": phys})
                else:
                    await self.store.meta_delete("inflight", in_key(s.client_id, pid))
            else:
                if phys >= 0:
                    s.incoming_phys[pid] = phys
                await self.store.meta_put("inflight", in_key(s.client_id, pid),
                                          {"phys": phys} if phys >= 0 else {})

    async def stored_qos2(self, s: Session, pid: int) -> int | None:
        """For a DUP QoS 2 PUBLISH of a packet id the session has no exchange for: the
        position of the record an earlier attempt stored before a crash cut the exchange
        (then it is a duplicate), or None (a new message, to store)."""
        last = await self.store.last_key_offset(qos2_key(s.client_id, pid))
        if last is None:
            return None
        mark = await self.store.meta_get("inflight", in_key(s.client_id, pid))
        if mark is not None and mark.get("done", -1) >= last:
            return None  # that record's exchange was completed
        return last

    # -- messages ---------------------------------------------------------------------
    def template(self, msg: Message) -> PublishTemplate:
        """Encode once per message, stamp per subscriber (cached across subscribers)."""
        if msg.phys_offset < 0:  # not from the log (no identity to cache it by)
            return PublishTemplate(msg.topic, msg.body, msg.qos, msg.retain,
                                   publish_properties(msg.properties))
        t = self._templates.get(msg.phys_offset)
        if t is None:
            # App properties become user properties: worked out once per message.
            t = PublishTemplate(msg.topic, msg.body, msg.qos, msg.retain,
                                publish_properties(msg.properties))
            self._templates[msg.phys_offset] = t
            if len(self._templates) > 4096:
                self._templates.popitem(last=False)
        return t

    async def publish_message(self, msg: Message) -> Message:
        """Store one message (a will, a $SYS value) and keep it retained if flagged."""
        [stored] = await self.store.publish([msg])
        if msg.retain:
            await self.set_retained(stored)
        return stored

    async def publish_will(self, client_id: str, will: Will) -> None:
        props = {k: v for k, v in will.properties.items() if k != "will_delay_interval"}
        retain = will.retain
        if retain and will.payload:
            why = self.retained.admit(will.topic, client_id,
                                      stored_size(will.topic, will.payload, props))
            if why is not None:  # still published, not retained
                self.stats.limit_refusals += 1
                log.warning("will of %r on %r not retained: %s", client_id, will.topic, why)
                retain = False
        msg = Message(will.topic, will.payload, will.qos, retain, client_id,
                      props, born_ts=int(time.time() * 1000))
        try:
            await self.publish_message(msg)
            self.stats.wills += 1
            log.info("will of %r published on %r", client_id, will.topic)
        except Exception:
            log.exception("will of %r could not be published", client_id)

    def retaining(self, msg: Message) -> None:
        """A retained publish is stored; its retained record follows (`set_retained`).
        Meanwhile a new subscription finds it here: it came too late for the live
        delivery and too early for the record."""
        self._retaining[msg.topic] = msg

    async def set_retained(self, msg: Message) -> None:
        try:
            await self._set_retained(msg)
        finally:
            if self._retaining.get(msg.topic) is msg:
                del self._retaining[msg.topic]

    async def _set_retained(self, msg: Message) -> None:
        if msg.body:
            r = RetainedMessage(msg.topic, msg.body, msg.qos, msg.properties, msg.client_id,
                                msg.store_ts, msg.phys_offset)
            await self.store.meta_put("retained", msg.topic, r.to_meta())
            self.retained.set(msg.topic, msg.client_id,
                              stored_size(msg.topic, msg.body, msg.properties))
        else:  # an empty retained payload clears the topic's retained message
            await self.store.meta_delete("retained", msg.topic)
            self.retained.remove(msg.topic)

    async def delete_retained(self, topic: str) -> None:
        await self.store.meta_delete("retained", topic)
        self.retained.remove(topic)

    async def load_retained_budget(self) -> None:
        """The retained messages the store already holds count from the start."""
        try:
            for topic, d in await self.store.meta_items("retained"):
                size = stored_size(topic, d["body"], d.get("props") or {})
                self.retained.set(topic, d.get("client_id", ""), size)
        except StoreError as exc:  # separated mode, store away
            log.warning("retained messages not counted: %s", exc)

    async def retained_for(self, topic_filter: str) -> list[RetainedMessage]:
        found = await self._stored_retained(topic_filter)
        if not self._retaining:
            return found
        by_topic = {r.topic: r for r in found}
        for topic, msg in list(self._retaining.items()):
            if matches(topic_filter, topic):  # newer than what the store holds
                if msg.body:
                    by_topic[topic] = RetainedMessage(topic, msg.body, msg.qos,
                                                      msg.properties, msg.client_id,
                                                      msg.store_ts, msg.phys_offset)
                else:
                    by_topic.pop(topic, None)
        return list(by_topic.values())

    async def _stored_retained(self, topic_filter: str) -> list[RetainedMessage]:
        if not is_wildcard(topic_filter):
            d = await self.store.meta_get("retained", topic_filter)
            return [RetainedMessage.from_meta(topic_filter, d)] if d else []
        # Scan only the literal prefix before the first wildcard level.
        literal = []
        for level in topic_filter.split("/"):
            if level in ("+", "#"):
                break
            literal.append(level)
        prefix = "/".join(literal)  # 'a/#' matches 'a' itself: no trailing slash
        out = []
        for topic, d in await self.store.meta_items("retained", prefix):
            if matches(topic_filter, topic):
                out.append(RetainedMessage.from_meta(topic, d))
        return out

    # -- housekeeping -----------------------------------------------------------------
    async def run_housekeeping(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Background work: offsets, expiry, $SYS, shared groups, delayed wills. None of
        it may end the gateway: each store call is guarded (see _guarded)."""
        await self._guarded(self.load_retained_budget)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await self._guarded(self._restore_sessions)  # before the expiry check
            task_status.started()
            cfg = self.config
            nursery.start_soon(self._every, cfg.offsets_flush_interval, self._flush_offsets)
            nursery.start_soon(partial(self._every, cfg.expiry_check_interval,
                                       self.expire_sessions, at_once=True))
            nursery.start_soon(partial(self._every, cfg.sys_interval, self.publish_sys,
                                       at_once=True))
            nursery.start_soon(self._every, cfg.wildcard_touch_s, self.touch_wildcards)

    async def touch_wildcards(self) -> None:
        """Tell the store which wildcard queues this gateway's sessions and shared groups
        read, so that it keeps indexing into them (and only them)."""
        filters = [q for q in {*self.queue_subs, *self.queue_groups} if is_wildcard(q)]
        if not filters:
            return
        await self.store.add_wildcards(filters)

    async def _flush_offsets(self) -> None:
        """Where every session and shared group resumes; a failure keeps them dirty, so
        the next round flushes them."""
        for s in list(self.sessions.values()):
            if s.has_dirty_offsets():
                await self.flush_offsets(s)
        await self.flush_group_offsets()

    async def expire_sessions(self) -> int:
        now = time.time()
        gone = 0
        items = await self.store.meta_items("sessions")
        for client_id, info in items:
            s = self.sessions.get(client_id)
            if s is not None:
                if s.expired(now):
                    await self.discard_session(client_id)
                    gone += 1
                continue
            at, expiry = info.get("disconnected_at"), info.get("expiry", NEVER_EXPIRES)
            if at is not None and expiry != NEVER_EXPIRES and now - at >= expiry:
                await self.discard_session(client_id)
                gone += 1
        self.persistent_sessions = len(items) - gone
        self.stats.sessions_expired += gone
        return gone

    async def publish_sys(self) -> None:
        st = self.stats
        store_stats = (await self.store.get_stats())["commitlog"]
        values = {
            "$SYS/broker/uptime": f"{int(time.time() - st.started)} seconds",
            "$SYS/broker/clients/connected": st.connections,
            "$SYS/broker/clients/total": len(self.sessions),
            "$SYS/broker/messages/received": st.messages_in,
            "$SYS/broker/messages/sent": st.messages_out,
            "$SYS/broker/bytes/received": st.bytes_in,
            "$SYS/broker/bytes/sent": st.bytes_out,
            "$SYS/broker/store/bytes": store_stats["bytes"],
            "$SYS/broker/store/segments": store_stats["segments"],
        }
        msgs = [Message(t, str(v).encode(), 0, True, SERVER_ID, born_ts=int(time.time() * 1000))
                for t, v in values.items()]
        for stored in await self.store.publish(msgs):
            await self.set_retained(stored)


def _what(fn: Any) -> str:
    """A background task's name for the log (`publish_sys`, not a bound method's repr)."""
    return str(getattr(fn, "__name__", fn))


def _notify(conn: Any, session: Session, queue: str) -> None:
    """Deliver to `conn` (right here when it can): this runs after a store append, and
    a bug must not cost other sessions their wake-up."""
    try:
        conn.delivery.notify(queue)
    except Exception:
        log.exception("delivery to %r failed", session.client_id)
