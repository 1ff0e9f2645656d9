"""The gateway's shared state, composed: sessions and their takeover (gateway.sessions),
shared groups (gateway.shared), retained messages (gateway.retained), wills
(gateway.wills), periodic work (gateway.housekeeping) and counters (gateway.stats).
What stays here: the notify loop that wakes sessions when their queues grow, and the
face the connections, the admin API and the metrics use."""

from __future__ import annotations

import logging
import sys
import uuid
from collections.abc import Set as AbstractSet
from typing import Any

import trio

from gateway import takeover
from gateway.auth.chain import BackendConfig
from gateway.auth.mqtt import MqttAuth
from gateway.background import Background
from gateway.backpressure import WriteRules
from gateway.cache import QueueCache, Templates
from gateway.config import GatewayConfig
from gateway.delivery import Delivery
from gateway.handover import Handover
from gateway.housekeeping import Housekeeping
from gateway.inbound import Inbound
from gateway.limits import SourceRateLimiter
from gateway.locks import ClientLocks
from gateway.mqtt import Will
from gateway.mqtt.protocol import Limits
from gateway.replay_budget import ReplayBudget
from gateway.retained import Retained, RetainedLimits, RetainedMessage
from gateway.session import NEVER_EXPIRES, Client, Outgoing, Session, Subscription
from gateway.sessions import ClientIdTaken, SessionLimitReached, SessionRegistry
from gateway.shared import SharedGroup, SharedGroups
from gateway.stats import APPEND_BUCKETS, Stats
from gateway.store_link import Elsewhere
from gateway.wills import Wills
from notify import Bus, LocalBus, RedisBus
from serving.read_budget import ReadBudget
from store.api import AUTH_EVENT, AuthManager, LocalStore, Message, Store

log = logging.getLogger("lightgate.gateway")
# Names of the gateway's own events, never a queue's: always news (`wants_news`).
_EVENTS = frozenset((AUTH_EVENT, "*"))

# Importers of the broker find these here as before.
__all__ = ["APPEND_BUCKETS", "Broker", "GatewayConfig", "RetainedMessage",
           "ClientIdTaken", "SessionLimitReached", "Stats"]


class Broker:
    def __init__(self, store: Store, config: GatewayConfig | None = None,
                 auth: AuthManager | None = None, backends: BackendConfig | None = None
                 ) -> None:
        self.store = store
        self.config = cfg = config or GatewayConfig()
        self.auth = auth or AuthManager(store)  # disabled unless configured
        self.auth.on_change(self._auth_changed)
        self.mqtt_auth = MqttAuth(self.auth, backends)  # how MQTT clients prove who they are
        self.connect_limiter = SourceRateLimiter(cfg.max_connect_rate)
        self.read_budget = ReadBudget(cfg.max_partial_bytes, cfg.partial_timeout_s)
        self.write_rules = WriteRules.of(cfg)  # what may wait for a client's socket
        self.replay_budget = ReplayBudget(cfg.max_replay_bytes,
                                          cfg.max_replay_bytes_per_client)
        # 0 in the config means no limit.
        self.max_topic_levels = cfg.max_topic_levels or sys.maxsize
        self.max_topic_length = cfg.max_topic_length or sys.maxsize
        self.stats = Stats()
        self.cache = QueueCache(store)
        self.template: Templates = Templates()
        self.background = Background(self.stats)
        self.retained = Retained(store, RetainedLimits(
            cfg.max_retained, cfg.max_retained_bytes, cfg.max_retained_per_client,
            cfg.max_retained_bytes_per_client))
        locks = ClientLocks()
        self.wills = Wills(store, self.retained, self.stats, self.background, locks)
        self.shared = SharedGroups(store, self.cache, self.background)
        self.registry = SessionRegistry(
            store, self.auth, self.stats, cfg.max_sessions, wills=self.wills,
            groups=self.shared, templates=self.template, background=self.background,
            locks=locks)
        self.housekeeping = Housekeeping(
            cfg, store, self.stats, self.background, sessions=self.registry,
            groups=self.shared, wills=self.wills, retained=self.retained)
        self.limits = Limits(
            max_packet_size=cfg.max_packet_size, max_connect_packet=cfg.max_connect_packet,
            max_qos=cfg.max_qos, topic_alias_maximum=cfg.topic_alias_maximum,
            max_inflight=cfg.max_inflight, receive_maximum=cfg.max_pending_publishes,
            max_keepalive=cfg.max_keepalive, connect_timeout=cfg.connect_timeout,
            v3_session_expiry=int(cfg.v3_session_expiry_s) or NEVER_EXPIRES)
        self.inbound = Inbound(self)
        # The store appends in this process and tells this broker of it at once.
        self._notified_in_process = isinstance(store, LocalStore)
        # Deliveries news reached within a pass of the reactor: run at the pass's end.
        self.deferred: set[Delivery] | None = None
        # Tasks connections start on demand (their lanes, deliveries, writers, ends).
        self.connection_nursery: trio.Nursery | None = None
        # Set while clients are sent to other gateways (cut off from the store's master).
        self.elsewhere: Elsewhere | None = None
        # The native plane's engine takes quiet plain-TCP connections (gateway.handover).
        self.handover: Handover | None = None

    def use_engine(self, engine: object) -> None:
        """Promote connections to `engine` (serving.lightgate_native.Engine) from now on."""
        self.handover = Handover(self, engine)
        # One budget for partial packets: the engine's connections count in it too.
        self.read_budget.share(engine)
        self.stats.native = engine.counters
        self.stats.native_latency = engine.append_latency

    # -- what the others read ---------------------------------------------------------
    @property
    def engine(self) -> Any:
        """The native engine that writes the log this gateway's store keeps (`lightgate
        serve` with LIGHTGATE_NATIVE=1), or None: connections it may carry go to it."""
        return getattr(self.store, "engine", None)

    @property
    def sessions(self) -> dict[str, Session]:
        return self.registry.by_id

    @property
    def queue_subs(self) -> dict[str, set[Session]]:
        return self.registry.by_queue

    @property
    def persistent_sessions(self) -> int:
        return self.registry.persistent

    @property
    def groups(self) -> dict[tuple[str, str], SharedGroup]:
        return self.shared.groups

    @property
    def queue_groups(self) -> dict[str, set[SharedGroup]]:
        return self.shared.by_queue

    # -- running ----------------------------------------------------------------------
    async def run_connections(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Where connections' tasks run, and the inbound pipeline's flusher."""
        async with trio.open_nursery() as nursery:
            self.connection_nursery = nursery
            await nursery.start(self.inbound.run)
            task_status.started()

    async def run_housekeeping(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Background work: offsets, expiry, $SYS, shared groups, delayed wills."""
        await self.housekeeping.run(task_status=task_status)

    def topic_past_limits(self, topic: str) -> bool:
        """Whether a topic name or filter is past --max-topic-length (characters) or
        --max-topic-levels."""
        return len(topic) > self.max_topic_length or topic.count("/") >= self.max_topic_levels

    def assign_client_id(self) -> str:
        """An id for a client that sent none: unique across restarts and gateways."""
        return f"lg-{uuid.uuid4().hex[:20]}"

    # -- sessions (gateway.sessions) --------------------------------------------------
    async def open_session(self, client_id: str, clean_start: bool, expiry: int,
                           version: int, connection: Client | None = None
                           ) -> tuple[Session, bool]:
        return await self.registry.open(client_id, clean_start, expiry, version, connection)

    async def session_detached(self, session: Session) -> None:
        await self.registry.detached(session)

    async def subscribe(self, s: Session, sub: Subscription) -> bool:
        return await self.registry.subscribe(s, sub)

    async def unsubscribe(self, s: Session, topic_filter: str) -> bool:
        return await self.registry.unsubscribe(s, topic_filter)

    async def flush_offsets(self, s: Session) -> None:
        await self.registry.flush_offsets(s)

    async def persist_outgoing(self, s: Session, *sends: Outgoing) -> None:
        await self.registry.persist_outgoing(s, *sends)

    async def forget_outgoing(self, s: Session, *sends: Outgoing) -> None:
        await self.registry.forget_outgoing(s, *sends)

    async def remember_incoming_qos2(self, s: Session, pid: int, done: bool,
                                     phys: int = -1) -> None:
        await self.registry.remember_incoming_qos2(s, pid, done, phys)

    async def stored_qos2(self, s: Session, pid: int) -> int | None:
        return await self.registry.stored_qos2(s, pid)

    def schedule_will(self, s: Session, will: Will) -> None:
        self.wills.schedule(s, will)

    # -- retained messages (gateway.retained) -----------------------------------------
    def retaining(self, msg: Message) -> None:
        self.retained.retaining(msg)

    async def set_retained(self, msg: Message) -> None:
        await self.retained.set(msg)

    async def delete_retained(self, topic: str) -> None:
        await self.retained.delete(topic)

    async def retained_for(self, topic_filter: str) -> list[RetainedMessage]:
        return await self.retained.matching(topic_filter)

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
        """Wake every live session subscribed to a queue that grew (once this gateway's
        appends under way are answered: their acks first)."""
        if not self.inbound.after_appends(self._queues_changed, names):
            self._queues_changed(names)

    def _queues_changed(self, names: set[str]) -> None:
        self.stats.notify_events += len(names)
        news = None if self.handover is None else self.handover.news
        if news is not None:  # a gateway node's engine pulls what its subscribers read
            news.grew(names)
        if AUTH_EVENT in names and self.background.running:
            self.background.spawn(self._reload_auth)
        for name in names:
            if name.startswith(takeover.RELEASE):
                self._release_asked(name)
                continue
            if name == "*":  # notify lost events (e.g. Redis reconnect): look everywhere
                for s in self.sessions.values():
                    if s.connection is not None:
                        for q in s.subscriptions:
                            s.notify(q)
                continue
            for session in self.queue_subs.get(name, ()):
                conn = session.connection
                if conn is None or not _drain(conn, session, name):
                    session.notify(name)
            for group in self.queue_groups.get(name, ()):
                group.wake()

    def _release_asked(self, name: str) -> None:
        """Another gateway's client asks for a session this one holds connected
        (gateway.takeover): that connection is closed as if taken over here."""
        ask = takeover.parse_release(name)
        if ask is not None and ask[0] == self.registry.gateway_id:
            self.background.spawn(takeover.release, self.registry, ask[2], ask[1])

    def stored_here(self, stored: list[Message]) -> None:
        """This gateway's appends, acknowledged by a separated store and in its cache:
        its subscribers of those queues are served from the cache at once, not once the
        store's notify has come back through the bus (Redis: a batching window and two
        hops later). The notify still comes, and has the store asked for anything more
        (another gateway's appends). An embedded store notifies in-process already."""
        if self._notified_in_process:
            return
        for name in {q for m in stored for q, _ in m.queues}:
            for session in self.queue_subs.get(name, ()):
                conn = session.connection
                if conn is not None and conn.native is None and conn.delivery is not None:
                    try:
                        conn.delivery.notify(name, cached_only=True)
                    except Exception:  # one client's delivery must not cost the others
                        log.exception("delivery to %r failed", session.client_id)

    def wants_news(self, name: str) -> bool:
        """Whether `on_queues_changed` would do anything for this name: a Python-side
        reader of the queue (a session the native plane does not carry, an offline one,
        a shared group) or an event of the gateway's own. Asked from the store's writer
        thread, so that a batch only native subscribers read wakes no event loop. A
        session promoted back to Python reads its queues from its position then."""
        if name in _EVENTS or name in self.queue_groups or name.startswith(takeover.RELEASE):
            return True
        try:
            for session in self.queue_subs.get(name, ()):
                conn = session.connection
                if conn is None or conn.native is None:
                    return True
        except RuntimeError:  # the set changed under us (the event loop's thread)
            return True
        return False

    def news_among(self, names: AbstractSet[str]) -> list[str]:
        """The names of a batch `wants_news` says yes to, asked only of those that some
        session or shared group reads (or the gateway's own events): a set intersection
        picks them out, so a batch naming a queue per message (devices on topics of their
        own, which nobody subscribes to one by one) costs no call per name. From the
        store's writer thread, as `wants_news`."""
        try:
            candidates = names & self.queue_subs.keys() | names & self.queue_groups.keys()
        except RuntimeError:  # changed under us (the event loop's thread): ask of each
            candidates = set(names)
        candidates |= names & _EVENTS
        candidates.update(takeover.asks_among(names))
        return [name for name in candidates if self.wants_news(name)]

    async def run_notify(self, bus: Bus) -> None:
        if isinstance(bus, LocalBus) and bus.window == 0:
            # In-process: no task in between.
            with bus.listen(self.on_queues_changed, among=self.news_among):
                await trio.sleep_forever()
        async with bus.subscribe() as events:
            if isinstance(bus, RedisBus):
                bus.early = self.early_news
            try:
                async for names in events:
                    self.on_queues_changed(names)
            finally:
                if isinstance(bus, RedisBus):
                    bus.early = None

    def early_news(self, names: AbstractSet[str]) -> bool:
        """From the notify's thread, before the event loop hears of a batch: whether it
        is to hear of it. Not when no Python-side reader wants any of its names (see
        `news_among`): the engine pulls what its carried subscribers are short of right
        here, and a fleet's stream of batches, each naming its devices' queues and the
        queue the application reads natively, costs no wake-up of the event loop."""
        news = None if self.handover is None else self.handover.news
        if news is None or self.news_among(names):  # (the gateway's events among them)
            return True
        self.stats.notify_events += len(names)
        news.grew(names)
        return False

    async def run_poll_fallback(self, bus: Bus | None, interval: float = 0.2) -> None:
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


def _drain(conn: Client, session: Session, queue: str) -> bool:
    """Deliver to `conn` (right here when it can): this runs after a store append, and
    a bug must not cost other sessions their wake-up."""
    try:
        return conn.drain_now(queue)
    except Exception:
        log.exception("delivery to %r failed", session.client_id)
        return True
