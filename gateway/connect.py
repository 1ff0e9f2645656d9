"""A client's CONNECT, as the connection (gateway.connection) carries it out: the
server's limits, authentication (a password, a certificate, a token or an enhanced
exchange of AUTH packets over several reads), the will's rights, then the session and
the CONNACK; and a re-authentication later on the same connection (MQTT 5 §4.12)."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

from gateway import mqtt
from gateway.auth.enhanced import CONTINUE, FAILURE, Authenticator, AuthStep
from gateway.broker import Broker, ClientIdTaken, SessionLimitReached
from gateway.config import GatewayConfig
from gateway.delivery import Delivery
from gateway.mqtt import protocol as mp
from gateway.mqtt import reason as rc
from gateway.mqtt.protocol import Closing, MqttProtocol
from gateway.output import Poller
from gateway.reserved import refusal as reserved_refusal
from gateway.session import Session
from serving.rate_limited_log import RateLimitedLog
from store.api import AuthError, StoreError, StoreFullError, Subject

log = logging.getLogger("lightgate.gateway.conn")
_refused_full = RateLimitedLog(log)  # a full disk refuses every persistent CONNECT

# The lane's work, in arrival order: events the rules returned, or a step to await.
LaneItem = mp.Event | Callable[[], Awaitable[object]]


class ConnectRules:
    """The CONNECT part of gateway.connection.Connection (a mixin: what it uses of the
    connection is declared here)."""

    __slots__ = ()  # the connection's own slots hold the state

    broker: Broker
    core: MqttProtocol
    config: GatewayConfig
    peer: str
    cert_identity: str | None
    subject: Subject | None
    session: Session | None
    connected_at: float | None
    delivery: Delivery | None
    reactor: Poller | None
    _authenticator: Authenticator | None
    _pending_connect: mp.ConnectReceived | None
    _ask_hook: bool
    _lane: deque[LaneItem] | None

    if TYPE_CHECKING:  # the connection's own, used here
        def flush(self) -> None: ...
        def auth_changed(self) -> None: ...
        async def may_ask(self, action: str, name: str, is_filter: bool = False) -> bool: ...

    async def _on_connect(self, ev: mp.ConnectReceived) -> None:
        self._pending_connect = ev  # whom a refusal is logged for (see close)
        await self._connect(ev)

    async def _connect(self, ev: mp.ConnectReceived) -> None:
        """Limits, then authentication: a password at once, or the first round of an
        enhanced exchange (§4.12), whose next rounds come back as AUTH (`_on_auth`)."""
        p, core, broker, cfg = ev.packet, self.core, self.broker, self.config
        ip = self.peer.rsplit(":", 1)[0]
        if broker.elsewhere is not None:  # cut off from the store's master
            raise core.refuse(rc.USE_ANOTHER_SERVER, rc.CONNACK_SERVER_UNAVAILABLE,
                              broker.elsewhere.why, broker.elsewhere.properties)
        authenticator = None
        if ev.auth_method is not None:
            # Enhanced authentication: the methods the AuthManager offers.
            authenticator = broker.mqtt_auth.enhanced(ev.auth_method)
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
            await broker.mqtt_auth.enhanced_wait(ip)
            step = authenticator.start(p.properties.get("authentication_data"))
            await self._exchange(step)
            return
        password = p.password.decode("utf-8", "surrogateescape") if p.password else None
        try:
            subject = await broker.mqtt_auth.authenticate(
                p.username, password, ip, self.cert_identity, ev.client_id)
        except AuthError as exc:
            if exc.disabled or (not p.username and not self.cert_identity):
                raise core.refuse(rc.NOT_AUTHORIZED, 5, "not authorized") from None
            raise core.refuse(rc.BAD_USER_NAME_OR_PASSWORD, 4,
                              "bad user name or password") from None
        await self._open(ev, subject, None)

    async def _exchange(self, step: AuthStep) -> None:
        """One round of the CONNECT's enhanced exchange decided: ask for another, or
        admit (or refuse) the client."""
        core, auth = self.core, self.broker.mqtt_auth
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
                                           self.peer.rsplit(":", 1)[0], ev.client_id)
        except AuthError:
            raise core.refuse(rc.BAD_USER_NAME_OR_PASSWORD, 4,
                              "bad user name or password") from None
        await self._open(ev, subject, step.data)

    async def _open(self, ev: mp.ConnectReceived, subject: Subject,
                    auth_data: bytes | None) -> None:
        """An authenticated client: the will's rights, then its session and CONNACK."""
        p, core, broker = ev.packet, self.core, self.broker
        self.subject = subject
        self._ask_hook = broker.mqtt_auth.asks_hook(subject)
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
        except ClientIdTaken as exc:  # logged where it was decided
            raise core.refuse(rc.NOT_AUTHORIZED, 5, str(exc)) from None
        except StoreFullError as exc:
            # The server is up (it takes clean sessions, and serves what is stored); the
            # session cannot be kept: the limit a full disk sets, told as a refused
            # publish is (0x97).
            _refused_full.note(f"persistent sessions refused: {exc}")
            raise core.refuse(rc.QUOTA_EXCEEDED, rc.CONNACK_SERVER_UNAVAILABLE,
                              f"session not kept: {exc}") from None
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
        handover = broker.handover
        if session.has_state() and (handover is None or not handover.defers(self)):
            # (A persistent session the native plane may carry waits for it: its
            # backlog is served from there.)
            self.delivery.start(resume=True)
            for group in session.groups:
                group.wake()  # a member is back
        if held:
            if self._lane is None:
                self._lane = deque()
            self._lane.extendleft(reversed(held))
        self._pending_connect = None  # answered: an idle connection keeps no CONNECT
        if broker.handover is not None:
            broker.handover.consider(self)  # type: ignore[arg-type]

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
        auth, core, ip = self.broker.mqtt_auth, self.core, self.peer.rsplit(":", 1)[0]
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
            subject = auth.enhanced_result(method, step, ip, self.session.client_id)
        except AuthError as exc:
            raise Closing(f"re-authentication failed: {exc.reason}", True,
                          rc.NOT_AUTHORIZED) from None
        if subject.name != self.subject.name:  # the session and its rights are the first's
            raise Closing("re-authenticated as another user", True, rc.NOT_AUTHORIZED)
        self.subject = subject
        self._set_expiry()
        self.auth_changed()
        core.reauth_done(step.data)

