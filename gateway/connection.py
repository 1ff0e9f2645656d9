"""One MQTT client connection: the sans-IO rules (gateway.mqtt.protocol) driven over a
socket, and what they ask of the broker.

A connection has no task of its own while it only reads and writes. Plain TCP sockets
are read by the node's reactor (gateway.reactor), one task for them all; TLS and
WebSocket streams by a task each (`run_stream`). Either hands the bytes to
`data_received`, which runs the rules and answers what it can at once: a publish is
checked and staged for the next append (gateway.inbound), an ack frees a window slot,
a ping is answered. Work that must wait (the CONNECT, subscriptions, a persistent
session's store writes, an HTTP hook's answer) runs in a task started for it, the
connection's *lane*, in arrival order; packets read meanwhile wait behind it, and the
socket is not read until it is done. Writes go out at once when the socket takes them;
what it cannot take waits for it (the reactor, or a writer task)."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from gateway import mqtt
from gateway.auth.enhanced import Authenticator
from gateway.broker import Broker
from gateway.connect import ConnectRules, LaneItem
from gateway.delivery import Delivery
from gateway.ending import Ending
from gateway.limits import PublishLimits
from gateway.mqtt import protocol as mp
from gateway.mqtt import reason as rc
from gateway.mqtt.protocol import Closing, MqttProtocol, Refused
from gateway.output import Output, Poller
from gateway.parking import Parking
from gateway.publishing import PublishRules
from gateway.reading import ReadSwitch
from gateway.sends import SendRules
from gateway.session import Session
from gateway.shared import SharedGroup
from gateway.stream_reader import StreamReading
from gateway.subscribing import SubscribeRules
from store.api import DecisionCache, Message, Subject

log = logging.getLogger("lightgate.gateway.conn")

LANE_TURN = 32  # lane items handled before the other tasks get a turn


class Connection(ConnectRules, PublishRules, SubscribeRules, SendRules, ReadSwitch,
                 StreamReading, Ending, Parking):
    # Slots: 100k idle devices means 100k of these; a __dict__ each would double them.
    __slots__ = (
        "broker", "core", "stream", "fd", "peer", "cert_identity", "subject",
        "_auth_cache", "_ask_hook", "_check_delivery", "_limits", "config", "session",
        "alive", "connected_at", "out", "_lane", "_lane_busy",
        "_closing", "_detached", "_taken_over", "_store_error", "_authenticator",
        "delivery", "_held", "_paused", "_quiescing", "reactor", "_scopes", "_closed",
        "_pending_connect", "_unpaused", "_full", "native", "native_topics",
    )

    def __init__(self, broker: Broker, stream: trio.abc.Stream | None, peer: str, *,
                 cert_identity: str | None = None, fd: int = -1) -> None:
        self.broker = broker
        self.config = broker.config
        self.core = MqttProtocol(broker.limits, trio.current_time())
        self.stream = stream  # a trio stream (TLS, WebSocket) or None (the reactor's fd)
        self.fd = fd  # a plain TCP socket's fd: written directly
        self.reactor: Poller | None = None  # the reactor that reads `fd`, if any
        self.peer = peer
        self.cert_identity = cert_identity  # from a verified client certificate
        self.subject: Subject | None = None  # who authenticated on this connection
        self._auth_cache: DecisionCache | None = None  # made once auth is known to be on
        self._ask_hook = False  # PUB/SUB decided by the HTTP hook (--auth-http-acl)
        self._check_delivery = False  # whether each delivery needs a SUB decision
        self._authenticator: Authenticator | None = None  # an enhanced exchange under way
        self._pending_connect: mp.ConnectReceived | None = None  # ... of this CONNECT
        cfg = self.config
        self._limits = PublishLimits(cfg.max_publish_rate, cfg.max_publish_bytes_rate) \
            if cfg.max_publish_rate > 0 or cfg.max_publish_bytes_rate > 0 else None
        self.session: Session | None = None
        self.alive = True
        self.connected_at: float | None = None
        self.out = Output(self, fd, stream, broker.write_rules, broker.stats)
        # The lane: work that must wait, in arrival order (events, or callables).
        self._lane: deque[LaneItem] | None = None
        self._lane_busy = False
        self._closing: Closing | None = None
        self._closed = False  # close() ran
        self._detached: trio.Event | None = None
        self._taken_over = False
        self._store_error = ""
        self._held = 0  # partial-packet bytes counted in the node's read budget
        self._paused = False  # not read while the lane works
        self._full = False  # not read while too much waits for the socket (gateway.output)
        self._quiescing = False  # not read while it settles for a handover
        self._unpaused: trio.Event | None = None  # a stream reader waits on it
        self._scopes: set[trio.CancelScope] | None = None  # the lane's, delivery's, writer's
        self.delivery: Delivery | None = None
        self.native: int | None = None  # promoted: its id in the engine (gateway.handover)
        # What it may publish to natively (gateway.handover), made on its first publish.
        self.native_topics: set[str] | None = None

    # -- what the broker and the listeners see ---------------------------------------
    @property
    def version(self) -> int:
        return self.core.version

    @property
    def keepalive(self) -> int:
        return self.core.keepalive

    @property
    def bridge(self) -> bool:
        return self.core.bridge

    @property
    def decoder(self) -> mqtt.Decoder:
        return self.core.decoder

    def kick(self, why: str = "kicked by an operator", not_authorized: bool = False) -> None:
        code = rc.NOT_AUTHORIZED if not_authorized else rc.ADMINISTRATIVE_ACTION
        self.close(Closing(why, True, code))

    async def take_over(self) -> None:
        """A new connection claims this client id: close this one and wait until the
        session is free (the spec: the server MUST close the existing connection)."""
        self._taken_over = True
        if self.native is not None and self.broker.handover is not None:
            await self.broker.handover.reclaim(self)  # the socket is Python's first
        self.out.write(self.core.taken_over())
        self.close(Closing("taken over"))
        await self.detached()

    async def detached(self) -> None:
        if self._detached is None:
            self._detached = trio.Event()
        await self._detached.wait()

    def drain_now(self, queue: str) -> bool:
        """`queue` grew: deliver from it, right here when it can (gateway.delivery).
        False before CONNACK, when nothing delivers yet: the session keeps the news."""
        if self.native is not None:
            return True  # the engine delivers it
        if self.delivery is None:
            return False
        self.delivery.notify(queue)
        return True

    def auth_changed(self) -> None:
        """Policies changed: decisions cached on this connection no longer hold."""
        auth, handover = self.broker.auth, self.broker.handover
        self._auth_cache = None
        if handover is not None:  # what the native side may publish to is decided anew
            self.native_topics = None
            handover.rights_changed(self)
        # A hook-decided client's deliveries are asked of the hook instead (awaited: in
        # the delivery task).
        self._check_delivery = bool(
            auth.enabled and self.subject is not None and not auth.is_super(self.subject)
            and not self._ask_hook)

    def may(self, action: str, name: str, is_filter: bool = False) -> bool:
        """The built-in ACL's answer (decisions cached per connection)."""
        if self.subject is None:
            return not self.broker.auth.enabled
        if self._auth_cache is None:
            self._auth_cache = DecisionCache()
        return self.broker.auth.authorize(self.subject, "Topic", name, action,
                                          is_filter=is_filter, cache=self._auth_cache)

    async def may_ask(self, action: str, name: str, is_filter: bool = False) -> bool:
        """`may`, or the HTTP hook's answer for a client it decides for."""
        if self._ask_hook and self.subject is not None:
            return await self.broker.mqtt_auth.authorize_by_hook(
                self.subject, name, action, is_filter=is_filter)
        return self.may(action, name, is_filter)

    # -- a member of shared groups (gateway.shared.Member) -----------------------------
    def has_window(self) -> bool:
        return self.delivery is not None and self.delivery.has_window()

    async def push_shared(self, group: SharedGroup, msg: Message, buffered: bool = False
                          ) -> bool:
        if self.delivery is None or not self.alive:
            return False
        return await self.delivery.push_shared(group, msg)

    async def flush_out(self) -> None:
        self.flush()

    @property
    def asks_hook(self) -> bool:
        return self._ask_hook

    @property
    def checks_delivery(self) -> bool:
        return self._check_delivery

    # -- tasks started on demand ------------------------------------------------------
    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """A task for this connection, cancelled when it closes."""
        self.broker.connection_nursery.start_soon(self._guarded, fn, args)

    async def _guarded(self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]
                       ) -> None:
        if self._closed:
            return
        scope = trio.CancelScope()
        if self._scopes is None:
            self._scopes = set()
        self._scopes.add(scope)
        try:
            with scope:
                await fn(*args)
        except Exception as exc:  # noqa: BLE001 - each becomes a Closing
            self.close(self._closing_for(exc))
        finally:
            if self._scopes is not None:
                self._scopes.discard(scope)
                self._scopes = self._scopes or None  # an idle one holds no empty set

    def _closing_for(self, exc: BaseException) -> Closing:
        """Why this connection ends, from what ended it. An error that is no client's
        doing is logged with its traceback and told as 0x80, not as a shutdown."""
        if isinstance(exc, BaseExceptionGroup):
            found = [self._closing_for(e) for e in exc.exceptions]
            return next((c for c in found if not c.internal), found[0])
        if isinstance(exc, Closing):
            return exc
        if isinstance(exc, mqtt.ProtocolError):
            return Closing(f"protocol error: {exc}", True, exc.reason_code)
        if isinstance(exc, trio.BrokenResourceError | trio.ClosedResourceError | OSError):
            return Closing(f"connection lost: {exc!r}")
        log.error("connection from %s failed", self.peer, exc_info=exc)
        closing = Closing("internal error", True, rc.UNSPECIFIED_ERROR)
        closing.internal = True
        return closing

    # -- reading ------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        """Bytes read from the client (the reactor or the stream task calls this)."""
        if self._closed:
            return
        self.broker.stats.bytes_in += len(data)
        core = self.core
        try:
            events = core.receive(data, trio.current_time())
        except Closing as closing:
            self.out.write(core.data_to_send())
            self.close(closing)
            return
        self._account_held()
        if events or self._lane:
            self._handle(events)
        self.flush()

    def _account_held(self) -> None:
        held = self.core.decoder.buffered
        if held or self._held:
            self.broker.read_budget.update(self._held, held)
            self._held = held

    def eof(self) -> None:
        self.close(Closing("connection closed by the client"))

    def _handle(self, events: list[mp.Event]) -> None:
        """Answer the events that need no waiting; from the first that does, the rest
        go to the lane in order."""
        lane = self._lane
        for i, ev in enumerate(events):
            if lane or self._lane_busy:
                self._to_lane(events[i:])
                return
            try:
                done = self._now(ev)
            except Closing as closing:
                self.close(closing)
                return
            except mqtt.ProtocolError as exc:
                self.close(self._closing_for(exc))
                return
            if not done:
                self._to_lane(events[i:])
                return

    def _to_lane(self, items: list[LaneItem]) -> None:
        if self._lane is None:
            self._lane = deque()
        self._lane.extend(items)
        if not self._lane_busy:
            self._lane_busy = True
            self._pause()
            self.spawn(self._run_lane)

    async def _run_lane(self) -> None:
        lane = self._lane
        assert lane is not None
        done = 0
        try:
            while lane and not self._closed:
                if self.out.full:  # answers wait for the client: the next one waits too
                    await self.out.room()
                    continue
                ev = lane.popleft()
                if not self._now(ev):
                    await self._later(ev)
                self.flush()
                done += 1
                if not done % LANE_TURN:  # a flood of SUBSCRIBEs shares the thread
                    await trio.lowlevel.checkpoint()
        finally:
            self._lane_busy = False
            if not lane:
                self._lane = None  # drained: an idle connection holds no empty deque
            if not self._closed:
                self._resume()

    def _more_done(self) -> list[mp.Outgoing]:
        """The completed sends next in the lane whose records go too (the acks of one
        read): one write for them all, not one each."""
        lane, more = self._lane, []
        while lane and type(lane[0]) is mp.OutgoingDone:
            o = lane.popleft().outgoing
            if not self._on_outgoing_done(o):
                more.append(o)
        return more

    # -- events answered at once ------------------------------------------------------
    def _now(self, ev: LaneItem) -> bool:
        """Handle `ev` if nothing needs waiting for; False: the lane must (`_later`)."""
        t = type(ev)
        if t is mp.PublishReceived:
            return self._on_publish(ev)
        if t is mp.Closed:
            self.close(ev.closing)
            return True
        if t is mp.DecodeError:
            closing = self.core.protocol_error(ev.error)
            self.flush()
            self.close(closing)
            return True
        if t is mp.OutgoingDone:
            return self._on_outgoing_done(ev.outgoing)
        if t is mp.OutgoingReleased:
            return not ev.held  # a held PUBREL goes once its state is in the store
        if t is mp.PubrelReceived:
            if self.session is not None and self.session.persistent:
                return False
            self.core.release_done(ev.packet_id, ev.ticket)
            return True
        return False  # CONNECT, AUTH, SUBSCRIBE, UNSUBSCRIBE: the lane's

    async def _later(self, ev: LaneItem) -> None:
        t = type(ev)
        if t is mp.ConnectReceived:
            await self._on_connect(ev)
        elif t is mp.AuthReceived:
            await self._on_auth(ev)
        elif t is mp.SubscribeReceived:
            await self._on_subscribe(ev)
        elif t is mp.UnsubscribeReceived:
            await self._on_unsubscribe(ev)
        elif t is mp.PublishReceived:
            await self._on_publish_slow(ev)
        elif t is mp.OutgoingDone:
            await self._complete(ev.outgoing, *self._more_done())
        elif t is mp.OutgoingReleased:
            await self.release_when_kept(ev.outgoing)
        elif t is mp.PubrelReceived:
            s = self.session
            assert s is not None
            await self.broker.remember_incoming_qos2(s, ev.packet_id, done=True)
            self.core.release_done(ev.packet_id, ev.ticket)
        elif callable(ev):
            await ev()

    # -- writing (gateway.output) -------------------------------------------------------
    def flush(self) -> None:
        """Write what the rules have for the client (once it is ending, the end writes
        it, after what the store still answers: gateway.ending)."""
        if self._closed:
            return
        core = self.core
        packets = core.pending_packets
        if packets:
            self.out.write(core.data_to_send(), packets)

    def writable(self) -> bool:
        return self.out.writable()

    def stuck_at(self, now: float) -> bool:
        return self.out.stuck(now)

    def lost(self) -> None:
        self.close(Closing("connection lost while writing"))

    def drained(self) -> None:
        if self.delivery is not None:
            self.delivery.window_freed()  # deliveries held for the backlog may go on

    def stuck(self) -> None:
        """A client that stops reading, or reads a trickle: its messages wait in the
        store (a persistent session resumes there); the connection must not hold memory."""
        rules = self.out.rules
        log.warning("client at %s took less than %d bytes of what waits for it in %.0fs "
                    "(--min-drain-bytes, --write-timeout): disconnecting", self.peer,
                    rules.min_drain, rules.timeout)
        self.broker.stats.stuck_disconnects += 1
        self.close(Closing("connection lost while writing"))


__all__ = ["Closing", "Connection", "Refused"]
