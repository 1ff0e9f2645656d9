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
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from gateway import mqtt
from gateway.broker import Broker, SessionLimitReached
from gateway.delivery import Delivery
from gateway.limits import PublishLimits
from gateway.mqtt import Publish
from gateway.mqtt import protocol as mp
from gateway.mqtt import reason as rc
from gateway.mqtt.protocol import Closing, MqttProtocol, Refused
from gateway.reserved import refusal as reserved_refusal
from gateway.retained import stored_size
from gateway.session import Session, Subscription, parse_shared, qos2_key
from store.api import (
    CONTINUE,
    FAILURE,
    Authenticator,
    AuthError,
    AuthStep,
    DecisionCache,
    Message,
    StoreError,
    Subject,
)

log = logging.getLogger("lightgate.gateway.conn")

STORE_DRAIN_S = 10.0  # at close, how long publishes already submitted may take to finish


class Connection:
    # Slots: 100k idle devices means 100k of these; a __dict__ each would double them.
    __slots__ = (
        "broker", "core", "stream", "fd", "peer", "cert_identity", "subject",
        "_auth_cache", "_ask_hook", "_check_delivery", "_limits", "config", "session",
        "alive", "connected_at", "_out", "_out_bytes", "_writer", "_lane", "_lane_busy",
        "_closing", "_detached", "_taken_over", "_store_error", "_authenticator",
        "delivery", "_held", "_paused", "_stuck_since", "reactor", "_scopes", "_closed",
        "_pending_connect",
    )

    def __init__(self, broker: Broker, stream: Any, peer: str, *,
                 cert_identity: str | None = None, fd: int = -1) -> None:
        self.broker = broker
        self.config = broker.config
        self.core = MqttProtocol(broker.limits, trio.current_time())
        self.stream = stream  # a trio stream (TLS, WebSocket) or None (the reactor's fd)
        self.fd = fd  # a plain TCP socket's fd: written directly
        self.reactor: Any = None  # the reactor that reads `fd`, if any
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
        self._out: list[bytes] | None = None  # bytes the socket has not taken yet
        self._out_bytes = 0
        self._writer = False  # a writer task is draining _out (streams)
        self._stuck_since = 0.0  # when _out stopped draining (a client that reads nothing)
        # The lane: work that must wait, in arrival order (events, or callables).
        self._lane: deque[Any] | None = None
        self._lane_busy = False
        self._closing: Closing | None = None
        self._closed = False  # close() ran
        self._detached: trio.Event | None = None
        self._taken_over = False
        self._store_error = ""
        self._held = 0  # partial-packet bytes counted in the node's read budget
        self._paused = False  # not read while the lane works
        self._scopes: set[trio.CancelScope] | None = None  # the lane's, delivery's, writer's
        self.delivery: Delivery | None = None

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
        self._write(self.core.taken_over())
        self.close(Closing("taken over"))
        await self.detached()

    async def detached(self) -> None:
        if self._detached is None:
            self._detached = trio.Event()
        await self._detached.wait()

    def auth_changed(self) -> None:
        """Policies changed: decisions cached on this connection no longer hold."""
        auth = self.broker.auth
        self._auth_cache = None
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
            return await self.broker.auth.authorize_by_hook(self.subject, name, action,
                                                            is_filter=is_filter)
        return self.may(action, name, is_filter)

    # -- a member of shared groups (gateway.shared.Member) -----------------------------
    def has_window(self) -> bool:
        return self.delivery is not None and self.delivery.has_window()

    async def push_shared(self, group: Any, msg: Message, buffered: bool = False) -> bool:
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

    async def _ending(self) -> None:
        """`_finish`, shielded: a shutdown cancels everything else, not a goodbye."""
        with trio.CancelScope(shield=True):
            try:
                await self._finish()
            except Exception:  # noqa: BLE001 - the connection is gone either way
                log.exception("closing the connection from %s failed", self.peer)

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
            self._write(core.data_to_send())
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

    def _handle(self, events: list[Any]) -> None:
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

    def _to_lane(self, items: list[Any]) -> None:
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
        try:
            while lane and not self._closed:
                ev = lane.popleft()
                if not self._now(ev):
                    await self._later(ev)
                self.flush()
        finally:
            self._lane_busy = False
            if not self._closed:
                self._resume()

    def _pause(self) -> None:
        """Read no more while the lane works (the socket's buffer holds the rest)."""
        self._paused = True
        if self.reactor is not None:
            self.reactor.pause(self)

    def _resume(self) -> None:
        self._paused = False
        if self.reactor is not None:
            self.reactor.resume(self)

    @property
    def reading(self) -> bool:
        return not self._paused

    # -- events answered at once ------------------------------------------------------
    def _now(self, ev: Any) -> bool:
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
            return not (self.session is not None and self.session.persistent
                        and ev.outgoing.group is None)
        if t is mp.PubrelReceived:
            if self.session is not None and self.session.persistent:
                return False
            self.core.release_done(ev.packet_id, ev.ticket)
            return True
        return False  # CONNECT, AUTH, SUBSCRIBE, UNSUBSCRIBE: the lane's

    async def _later(self, ev: Any) -> None:
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
            await self._complete(ev.outgoing)
        elif t is mp.OutgoingReleased:
            assert self.session is not None
            await self.broker.persist_outgoing(self.session, ev.outgoing)
        elif t is mp.PubrelReceived:
            s = self.session
            assert s is not None
            await self.broker.remember_incoming_qos2(s, ev.packet_id, done=True)
            self.core.release_done(ev.packet_id, ev.ticket)
        elif callable(ev):
            await ev()

    # -- CONNECT ------------------------------------------------------------------------
    async def _on_connect(self, ev: mp.ConnectReceived) -> None:
        self._pending_connect = ev  # whom a refusal is logged for (see close)
        await self._connect(ev)

    async def _connect(self, ev: mp.ConnectReceived) -> None:
        """Limits, then authentication: a password at once, or the first round of an
        enhanced exchange (§4.12), whose next rounds come back as AUTH (`_on_auth`)."""
        p, core, broker, cfg = ev.packet, self.core, self.broker, self.config
        ip = self.peer.rsplit(":", 1)[0]
        authenticator = None
        if ev.auth_method is not None:
            # Enhanced authentication: the methods the AuthManager offers.
            authenticator = broker.auth.enhanced(ev.auth_method)
            if authenticator is None:
                raise core.refuse(rc.BAD_AUTHENTICATION_METHOD, None,
                                  f"authentication method {ev.auth_method!r} is not supported")
        if not ev.client_id:
            ev.client_id, ev.assigned = broker.assign_client_id(), True
        if cfg.max_connections and broker.stats.connections >= cfg.max_connections:
            broker.stats.limit_refusals += 1
            log.warning("connect from %s refused: %d connections (--max-connections)",
                        self.peer, broker.stats.connections)
            raise core.refuse(rc.QUOTA_EXCEEDED, 3, "server connection limit reached")
        if not broker.connect_limiter.allow(ip):
            broker.stats.limit_refusals += 1
            log.warning("connect from %s refused: above --max-connect-rate", self.peer)
            raise core.refuse(rc.CONNECTION_RATE_EXCEEDED, 3, "connect rate exceeded")
        if authenticator is not None:
            self._authenticator = authenticator
            self._pending_connect = ev
            # Its AUTH packets come from nobody yet: bounded as the CONNECT was.
            core.decoder.max_packet_size = core.decoder.first_packet_max
            await broker.auth.enhanced_wait(ip)
            step = authenticator.start(p.properties.get("authentication_data"))
            await self._exchange(step)
            return
        password = p.password.decode("utf-8", "surrogateescape") if p.password else None
        try:
            subject = await broker.auth.authenticate(
                p.username, password, ip, "mqtt", self.cert_identity, ev.client_id)
        except AuthError as exc:
            if exc.disabled or (not p.username and not self.cert_identity):
                raise core.refuse(rc.NOT_AUTHORIZED, 5, "not authorized") from None
            raise core.refuse(rc.BAD_USER_NAME_OR_PASSWORD, 4,
                              "bad user name or password") from None
        await self._open(ev, subject, None)

    async def _exchange(self, step: AuthStep) -> None:
        """One round of the CONNECT's enhanced exchange decided: ask for another, or
        admit (or refuse) the client."""
        core, auth = self.core, self.broker.auth
        ev, authenticator = self._pending_connect, self._authenticator
        assert ev is not None and authenticator is not None
        if step.outcome == CONTINUE:
            core.auth_continue(step.data, trio.current_time())
            return
        p = ev.packet
        core.decoder.max_packet_size = self.config.max_packet_size
        if p.username and step.outcome != FAILURE and p.username != step.user:
            step = AuthStep.failure(f"{authenticator.method}: CONNECT user name "
                                    f"{p.username!r} is not the authenticated {step.user!r}",
                                    step.user)
        self._authenticator = None
        try:
            subject = auth.enhanced_result(authenticator.method, step,
                                           self.peer.rsplit(":", 1)[0], "mqtt", ev.client_id)
        except AuthError:
            raise core.refuse(rc.BAD_USER_NAME_OR_PASSWORD, 4,
                              "bad user name or password") from None
        await self._open(ev, subject, step.data)

    async def _open(self, ev: mp.ConnectReceived, subject: Subject,
                    auth_data: bytes | None) -> None:
        """An authenticated client: the will's rights, then its session and CONNACK."""
        p, core, broker = ev.packet, self.core, self.broker
        self.subject = subject
        self._ask_hook = broker.auth.asks_hook(subject)
        if p.will is not None:
            self._check_will(p.will)
            await self._check_will_topic(p.will.topic)
        self.auth_changed()
        core.authenticated()
        client_id = ev.client_id
        try:
            session, present = await broker.open_session(
                client_id, p.clean_start, ev.expiry, p.protocol_level, connection=self)
        except SessionLimitReached as exc:
            log.warning("connect of %r from %s refused: %s", client_id, self.peer, exc)
            raise core.refuse(rc.QUOTA_EXCEEDED, 3, "no room for a new persistent session"
                              ) from None
        except StoreError as exc:  # away (a failover): the client retries with its backoff
            log.warning("connect of %r from %s refused: %s", client_id, self.peer, exc)
            raise core.refuse(rc.SERVER_UNAVAILABLE, rc.CONNACK_SERVER_UNAVAILABLE,
                              "the store is unavailable") from None
        self.session = session
        self.connected_at = time.time()
        session.will = p.will
        broker.stats.connections += 1
        broker.stats.connects_total += 1
        held = core.accept(session, client_id, present, trio.current_time(), ev.assigned,
                           auth_data)
        self._set_expiry()
        log.info("client %r connected from %s (v%d%s, %s session%s)", client_id, self.peer,
                 core.version, " bridge" if core.bridge else "",
                 "persistent" if session.persistent else "clean", ", resumed" if present else "")
        self.delivery = Delivery(self)
        if session.has_state():
            self.delivery.start(resume=True)
            for group in session.groups:
                group.wake()  # a member is back
        if held:
            if self._lane is None:
                self._lane = deque()
            self._lane.extendleft(reversed(held))

    def _set_expiry(self) -> None:
        """The credentials' end (a token's exp, a hook's expire_at) as a deadline, on
        the clock the core is given."""
        expires = self.subject.expires if self.subject is not None else None
        self.core.set_expiry(None if expires is None
                             else trio.current_time() + expires - time.time())
        if self.reactor is not None:
            self.reactor.rearm(self)

    def _check_will(self, will: mqtt.Will) -> None:
        """What the codec cannot know about a will: this server's limits (MQTT 5
        §3.2.2.2: CONNACK 0x90, 0x9B, 0x99 before the close)."""
        b, core = self.broker, self.core
        if b.topic_past_limits(will.topic):
            b.stats.topic_refusals += 1
            raise core.refuse(rc.TOPIC_NAME_INVALID, None,
                              "will topic past --max-topic-levels or --max-topic-length")
        if core.version == 5 and will.qos > self.config.max_qos:  # [MQTT-3.2.2-12]
            raise core.refuse(rc.QOS_NOT_SUPPORTED, None, f"will QoS {will.qos} is above "
                              f"the maximum QoS {self.config.max_qos}")
        if will.properties.get("payload_format_indicator") == 1 \
                and not mp._is_utf8(will.payload):  # §3.1.3.2.3
            raise core.refuse(rc.PAYLOAD_FORMAT_INVALID, None,
                              "will payload is not UTF-8 as its format indicator says")

    async def _check_will_topic(self, topic: str) -> None:
        """The will's topic takes the PUB right a publish there would need."""
        why = reserved_refusal(topic, self.broker.auth.enabled)
        if why is None and not await self.may_ask("PUB", topic):
            why = "not authorized"
        if why is not None:
            raise self.core.refuse(rc.NOT_AUTHORIZED, 5, f"will topic {topic!r} {why}")

    async def _on_auth(self, ev: mp.AuthReceived) -> None:
        """An AUTH round: of the CONNECT's exchange, or a re-authentication (§4.12.1):
        the same exchange, AUTH 0x00 on success; on failure the connection ends (0x87)."""
        data = ev.packet.properties.get("authentication_data")
        if not ev.reauth:
            assert self._authenticator is not None and self._pending_connect is not None
            await self._exchange(self._authenticator.step(data))
            return
        auth, core, ip = self.broker.auth, self.core, self.peer.rsplit(":", 1)[0]
        method = core.auth_method
        assert method is not None and self.session is not None and self.subject is not None
        if ev.packet.reason_code == rc.RE_AUTHENTICATE:
            authenticator = auth.enhanced(method)
            if authenticator is None:  # auth switched off or method withdrawn meanwhile
                raise Closing("re-authentication method gone", True,
                              rc.BAD_AUTHENTICATION_METHOD)
            self._authenticator = authenticator
            await auth.enhanced_wait(ip)
            step: AuthStep = authenticator.start(data)
        else:
            assert self._authenticator is not None
            step = self._authenticator.step(data)
        if step.outcome == CONTINUE:
            core.auth_continue(step.data)
            return
        self._authenticator = None
        try:
            subject = auth.enhanced_result(method, step, ip, "mqtt", self.session.client_id)
        except AuthError as exc:
            raise Closing(f"re-authentication failed: {exc.reason}", True,
                          rc.NOT_AUTHORIZED) from None
        if subject.name != self.subject.name:  # the session and its rights are the first's
            raise Closing("re-authenticated as another user", True, rc.NOT_AUTHORIZED)
        self.subject = subject
        self._set_expiry()
        self.auth_changed()
        core.reauth_done(step.data)

    # -- publishes ----------------------------------------------------------------------
    def _on_publish(self, ev: mp.PublishReceived) -> bool:
        """Check and stage a publish for the next append; False if the lane must (an
        HTTP hook's answer, a resent QoS 2 of a persistent session)."""
        p, topic, s = ev.packet, ev.topic, self.session
        assert s is not None
        if self._ask_hook or (p.qos == 2 and p.dup and s.persistent):
            return False
        self._count(p)
        why = self._publish_refusal(p, topic)
        if why is None and not self.may("PUB", topic):
            why = ("not authorized", rc.NOT_AUTHORIZED)
        if why is None:
            why = self._publish_limits(p, topic, s)
        if why is not None:
            self._refuse_publish(ev, topic, *why)
        else:
            self._stage(ev, topic, s)
        return True

    async def _on_publish_slow(self, ev: mp.PublishReceived) -> None:
        p, topic, s = ev.packet, ev.topic, self.session
        assert s is not None
        self._count(p)
        why = self._publish_refusal(p, topic)
        if why is None and not await self.may_ask("PUB", topic):
            why = ("not authorized", rc.NOT_AUTHORIZED)
        if why is None:
            why = self._publish_limits(p, topic, s)
        if why is not None:
            self._refuse_publish(ev, topic, *why)
            return
        if p.qos == 2 and p.dup and s.persistent:
            # A resend the session has no exchange for: stored already if a crash fell
            # between the append and the packet id's marker (the record carries the id).
            await self.broker.inbound.drained(self)
            phys = await self.broker.stored_qos2(s, p.packet_id)
            if phys is not None:
                log.info("client %r resent QoS 2 packet id %d stored before a restart: "
                         "not stored again", s.client_id, p.packet_id)
                await self.broker.remember_incoming_qos2(s, p.packet_id, False, phys)
                self.core.held_qos2(p, ev.ticket)
                return
        self._stage(ev, topic, s)

    def _count(self, p: Publish) -> None:
        stats = self.broker.stats
        stats.messages_in += 1
        stats.messages_in_qos[p.qos] += 1

    def _publish_refusal(self, p: Publish, topic: str) -> tuple[str, int] | None:
        """Rate limits (past them the connection ends) and reserved topics."""
        if self._limits is not None:
            over = self._limits.exceeded(len(p.payload))
            if over is not None:
                self.broker.stats.limit_refusals += 1
                log.warning("client %r at %s disconnected: %s", self.core.client_id,
                            self.peer, over)
                raise Closing(f"publish rate limit: {over}", True, rc.MESSAGE_RATE_TOO_HIGH)
        if topic.startswith("$"):
            # MQTT §4.7.2: the server's ($SYS statistics), but for bridges' state topics
            # and what the policies grant (gateway/reserved.py).
            why = reserved_refusal(topic, self.broker.auth.enabled)
            if why is not None:
                return why, rc.NOT_AUTHORIZED
        return None

    def _publish_limits(self, p: Publish, topic: str, s: Session) -> tuple[str, int] | None:
        b = self.broker
        if b.topic_past_limits(topic):
            b.stats.topic_refusals += 1
            return "past --max-topic-levels or --max-topic-length", rc.TOPIC_NAME_INVALID
        if p.retain and p.payload:
            why = b.retained.admit(topic, s.client_id,
                                   stored_size(topic, p.payload, _props(p)))
            if why is not None:
                b.stats.limit_refusals += 1
                return why, rc.QUOTA_EXCEEDED
        return None

    def _refuse_publish(self, ev: mp.PublishReceived, topic: str, why: str, code: int
                        ) -> None:
        """Not stored: v5 PUBACK/PUBREC with `code`; 3.1.1 a plain ack (core)."""
        log.info("publish of %r on %r by %s %s: dropped", self.core.client_id, topic[:100],
                 self.peer, why)
        self.core.publish_done(ev.packet, ev.ticket, code)

    def _stage(self, ev: mp.PublishReceived, topic: str, s: Session) -> None:
        p = ev.packet
        msg = Message(topic, p.payload, p.qos, p.retain, s.client_id, _props(p),
                      born_ts=time.time_ns() // 1_000_000,
                      key=qos2_key(s.client_id, p.packet_id) if p.qos == 2 and s.persistent
                      else "")
        self.broker.inbound.stage(self, msg, p, ev.ticket)

    def stored(self, p: Publish, ticket: int, code: int, text: str = "") -> None:
        """The inbound pipeline's answer for a staged publish (gateway.inbound)."""
        if self._closed:
            return
        if code and self.core.version < 5 and p.qos:
            # 3.1.1 has no negative ack: close so the client resends
            self.close(Closing(f"store error: {text}", will=True))
            return
        self.core.publish_done(p, ticket, code, text)

    # -- QoS 1/2 sends completed --------------------------------------------------------
    def _on_outgoing_done(self, o: mp.Outgoing) -> bool:
        s = self.session
        assert s is not None
        if o.group is None and s.persistent and o.queue is not None:
            return False  # its in-flight record goes: the lane's
        if o.group is not None:
            o.group.acked(o.offset)
        self._freed(s)
        return True

    async def _complete(self, o: mp.Outgoing) -> None:
        s = self.session
        assert s is not None
        await self.broker.forget_outgoing(s, o)
        self._freed(s)

    def _freed(self, s: Session) -> None:
        for group in s.groups:
            group.wake()  # this member has room again
        if self.delivery is not None:
            self.delivery.window_freed()

    # -- SUBSCRIBE / UNSUBSCRIBE ---------------------------------------------------------
    async def _on_subscribe(self, ev: mp.SubscribeReceived) -> None:
        s, core = self.session, self.core
        assert s is not None and self.delivery is not None
        codes: list[int] = []
        retained: list[Subscription] = []
        for topic_filter, opts in ev.packet.subscriptions:
            try:
                shared = parse_shared(topic_filter)
            except ValueError:
                codes.append(rc.TOPIC_FILTER_INVALID)
                continue
            refusal = await self._subscribe_refusal(s, topic_filter, shared)
            if refusal is not None:
                codes.append(refusal)
                continue
            granted = min(opts.qos, self.config.max_qos)
            # A bridge's subscriptions, as Mosquitto and EMQX make them: what it sent is
            # not sent back (it would go round), retained messages stay retained.
            bridged = core.bridge and not shared
            opts = mqtt.SubscriptionOptions(granted, opts.no_local or bridged,
                                            opts.retain_as_published or bridged,
                                            opts.retain_handling)
            sub = Subscription(topic_filter, opts, ev.subscription_id, shared)
            try:
                new = await self.broker.subscribe(s, sub)
            except StoreError as exc:
                log.warning("subscribe of %r to %r failed: %s", s.client_id, topic_filter, exc)
                codes.append(rc.UNSPECIFIED_ERROR)
                continue
            codes.append(granted)
            # Retained messages are not sent for shared subscriptions (MQTT 5 §4.8.2).
            if not shared and (opts.retain_handling == 0
                               or (opts.retain_handling == 1 and new)):
                retained.append(sub)
        then = await self.delivery.retained(retained) if retained else None
        core.subscribed(ev.packet.packet_id, ev.ticket, codes, then)
        self.delivery.start()

    async def _subscribe_refusal(self, s: Session, topic_filter: str,
                                 shared: tuple[str, str] | None) -> int | None:
        """A SUBACK failure code if this filter is not allowed (ACL or limit), else None."""
        real = shared[1] if shared else topic_filter
        if not await self.may_ask("SUB", real, is_filter=True):
            log.info("subscribe of %r to %r not authorized", s.client_id, topic_filter)
            return rc.NOT_AUTHORIZED
        b = self.broker
        if b.topic_past_limits(real):
            b.stats.topic_refusals += 1
            log.info("subscribe of %r to %r refused: past --max-topic-levels or "
                     "--max-topic-length", s.client_id, topic_filter[:100])
            return rc.TOPIC_FILTER_INVALID
        limit = self.config.max_subscriptions
        if limit and topic_filter not in s.subscriptions and len(s.subscriptions) >= limit:
            b.stats.limit_refusals += 1
            log.warning("subscribe of %r to %r refused: %d subscriptions (limit)",
                        s.client_id, topic_filter, len(s.subscriptions))
            return rc.QUOTA_EXCEEDED
        return None

    async def _on_unsubscribe(self, ev: mp.UnsubscribeReceived) -> None:
        s = self.session
        assert s is not None
        codes = []
        for topic_filter in ev.packet.filters:
            existed = await self.broker.unsubscribe(s, topic_filter)
            codes.append(rc.SUCCESS if existed else rc.NO_SUBSCRIPTION_EXISTED)
        self.core.unsubscribed(ev.packet.packet_id, ev.ticket, codes)

    # -- writing ------------------------------------------------------------------------
    def flush(self) -> None:
        """Write what the rules have for the client."""
        data = self.core.data_to_send()
        if data:
            self._write(data)

    def _write(self, data: bytes) -> None:
        if not data or self.fd < 0 and self.stream is None:
            return
        self.broker.stats.bytes_out += len(data)
        if self._out:  # behind what waits already
            self._out.append(data)
            self._out_bytes += len(data)
            return
        if self.fd >= 0:
            try:
                sent = os.write(self.fd, data)
            except BlockingIOError:
                sent = 0
            except OSError:
                self.close(Closing("connection lost while writing"))
                return
            if sent == len(data):
                return
            data = data[sent:]
        self._out = [data]
        self._out_bytes = len(data)
        self._stuck_since = trio.current_time()
        if self.reactor is not None:
            self.reactor.want_write(self)
        else:
            self._start_writer()

    @property
    def backlog(self) -> int:
        """Bytes written but not taken by the socket yet."""
        return self._out_bytes

    def writable(self) -> bool:
        """The socket takes more (the reactor asks): write what waits; True when all
        is out."""
        out = self._out
        while out:
            data = out[0] if len(out) == 1 else b"".join(out)
            try:
                sent = os.write(self.fd, data)
            except BlockingIOError:
                sent = 0
            except OSError:
                self.close(Closing("connection lost while writing"))
                return True
            if sent < len(data):
                self._out = [data[sent:]]
                self._out_bytes = len(data) - sent
                if sent:
                    self._stuck_since = trio.current_time()
                return False
            self._out = None
            self._out_bytes = 0
        if self.delivery is not None:
            self.delivery.window_freed()  # deliveries held for the backlog may go on
        return True

    def stuck_for(self, now: float) -> float:
        return now - self._stuck_since if self._out else 0.0

    def _start_writer(self) -> None:
        if not self._writer:
            self._writer = True
            self.spawn(self._write_stream)

    async def _write_stream(self) -> None:
        try:
            while self._out:
                data = b"".join(self._out)
                self._out, self._out_bytes = None, 0
                with trio.move_on_after(self.config.write_timeout) as scope:
                    await self.stream.send_all(data)
                if scope.cancelled_caught:
                    self.stuck()
                    return
            if self.delivery is not None:
                self.delivery.window_freed()
        finally:
            self._writer = False

    def stuck(self) -> None:
        """A client that stops reading: its messages wait in the store (a persistent
        session resumes there); the connection must not hold memory."""
        log.warning("client at %s read nothing for %.0fs: disconnecting", self.peer,
                    self.config.write_timeout)
        self.broker.stats.stuck_disconnects += 1
        self.close(Closing("connection lost while writing"))

    # -- timers -------------------------------------------------------------------------
    @property
    def deadline(self) -> float:
        return self.core.deadline

    def timeout(self, now: float) -> None:
        """A deadline passed (the reactor or the stream task checks)."""
        try:
            self.core.timeout(now)
        except Closing as closing:
            self.close(closing)

    # -- the end --------------------------------------------------------------------------
    def close(self, closing: Closing) -> None:
        """End the connection (once): stop reading and what runs for it; the rest (the
        DISCONNECT, the will, the session) in a task."""
        if self._closed:
            return
        self._closed = True
        self.alive = False
        self._closing = closing
        if isinstance(closing, Refused):
            # Every refusal is logged with its reason: an operator cannot tell one from
            # the client's side (a bridge's will refused by a policy looked like a
            # network fault).
            cid = self.core.connect_id
            who = "?" if cid is None else repr(cid)
            log.info("connect of %s from %s refused: %s", who, self.peer, closing)
        if self._scopes:
            for scope in self._scopes:
                scope.cancel()
        if self.reactor is not None:
            self.reactor.forget(self)
        if self.delivery is not None:
            self.delivery.stop()
        try:
            self.broker.connection_nursery.start_soon(self._ending)
        except RuntimeError:  # the gateway is gone already
            pass

    async def _finish(self) -> None:
        closing = self._closing
        assert closing is not None
        core, broker = self.core, self.broker
        broker.read_budget.update(self._held, 0)
        self._held = 0
        s = self.session
        if s is not None:
            with trio.move_on_after(STORE_DRAIN_S):
                await broker.inbound.drained(self)
        if s is None and not isinstance(closing, Refused):
            log.info("connection from %s ended before CONNACK: %s", self.peer, closing)
        data = core.close(closing) if not self._taken_over else b""
        self._write(core.data_to_send() + data)
        if self._out and self.stream is not None:
            with trio.move_on_after(0.5):
                await self._flush_stream()
        if s is not None:
            log.info("client %r (%s) disconnected: %s", s.client_id, self.peer, closing)
            broker.stats.connections -= 1
            if self.delivery is not None:
                self.delivery.give_back_shared()
            if s.persistent:
                core.unalias_outgoing()
            will, s.will = s.will, None
            if will is not None and closing.will:
                broker.schedule_will(s, will)
            if s.connection is self:
                await broker.session_detached(s)
        await self._close_transport()
        if self._detached is None:
            self._detached = trio.Event()
        self._detached.set()

    async def _flush_stream(self) -> None:
        if self._out:
            data = b"".join(self._out)
            self._out, self._out_bytes = None, 0
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError,
                    trio.BusyResourceError, OSError):
                pass

    async def _close_transport(self) -> None:
        if self.stream is not None:
            with trio.move_on_after(1):
                await self.stream.aclose()
        elif self.fd >= 0:
            fd, self.fd = self.fd, -1
            if self._out:  # a last DISCONNECT the socket did not take: best effort
                try:
                    os.write(fd, b"".join(self._out))
                except OSError:
                    pass
            os.close(fd)

    # -- a stream's own reader (TLS, WebSocket) -----------------------------------------
    async def run_stream(self) -> None:
        """Read the stream until the connection ends (the reactor reads plain TCP)."""
        budget = self.broker.read_budget
        try:
            while not self._closed:
                if self._paused:
                    await trio.sleep(0.01) if self._lane_busy else None
                    if self._lane_busy:
                        continue
                held = self._held
                if held and budget.must_wait(held) and not await budget.wait(held):
                    self._over_budget(held)
                    break
                with trio.move_on_at(self.core.deadline) as scope:
                    data = await self.stream.receive_some(budget.read_size(held, 65536))
                if scope.cancelled_caught:
                    self.timeout(trio.current_time())
                    continue
                if not data:
                    self.eof()
                    break
                self.data_received(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self.close(Closing(f"connection lost: {exc!r}"))
        except Exception as exc:  # noqa: BLE001 - each becomes a Closing
            self.close(self._closing_for(exc))
        await self.detached()

    def _over_budget(self, held: int) -> None:
        self.broker.stats.limit_refusals += 1
        log.warning("%s closed: held %d bytes of a partial packet while the node's read "
                    "budget was exhausted (--max-partial-bytes)", self.peer, held)
        self.close(Closing("read budget exhausted", True, rc.QUOTA_EXCEEDED))


def _props(p: Publish) -> dict[str, Any]:
    """A publish's properties as stored: a topic alias belongs to the connection."""
    if not p.properties:
        return {}
    if "topic_alias" not in p.properties:
        return p.properties
    return {k: v for k, v in p.properties.items() if k != "topic_alias"}


__all__ = ["Closing", "Connection", "Refused"]
