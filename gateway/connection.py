"""One MQTT client connection: its own nursery with a reader (this task), a writer, an
acker for stored publishes and, once connected, a delivery task. Errors stay inside."""

from __future__ import annotations

import logging
import math
import os
import time
from concurrent.futures import Future
from typing import Any

import trio

from gateway import mqtt
from gateway.broker import Broker, SessionLimitReached
from gateway.limits import PublishLimits
from gateway.mqtt import (
    Auth,
    Connack,
    Connect,
    Disconnect,
    Pingreq,
    Pingresp,
    ProtocolError,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    Unsuback,
    Unsubscribe,
    UnsupportedProtocolError,
)
from gateway.mqtt import reason as rc
from gateway.mqtt.properties import publish_properties
from gateway.reserved import refusal as reserved_refusal
from gateway.retained import stored_size
from gateway.session import (
    NEVER_EXPIRES,
    Outgoing,
    Session,
    Subscription,
    parse_shared,
    qos2_key,
)
from gateway.shared import SharedGroup
from serving.read_budget import READ_SIZE, read_fd
from store.api import (
    CONTINUE,
    FAILURE,
    Authenticator,
    AuthError,
    AuthStep,
    DecisionCache,
    Message,
    StoreError,
    StoreFullError,
    Subject,
    await_future,
)

log = logging.getLogger("lightgate.gateway.conn")

_NO_STORE_WAIT = object()  # an acker item that needs no store acknowledgement
PUBLISH_BATCH = 256  # publishes per store append, at most
OUT_CHUNK = 64 * 1024
OUT_LIMIT = 32 * OUT_CHUNK  # bytes queued for a client before senders wait
STORE_DRAIN_S = 10.0  # at close, how long publishes already submitted may take to finish


REASON_OVERHEAD = 16  # fixed header, packet id, reason code, property lengths


class Closing(Exception):
    """End this connection; `will` says whether the will message goes out."""

    def __init__(self, why: str, will: bool = True, reason_code: int | None = None) -> None:
        super().__init__(why)
        self.will = will
        self.reason_code = reason_code
        self.internal = False  # a server bug, not anything the client did


class Refused(Closing):
    """A CONNECT turned down, before any session (so no will): the client sees a return
    code at most, the log says why (see Connection._connect)."""

    def __init__(self, why: str) -> None:
        super().__init__(why, will=False)


class Connection:
    # Slots: 100k idle devices means 100k of these; a __dict__ each would double them.
    __slots__ = (
        "broker", "stream", "peer", "cert_identity", "subject", "_auth_cache", "_ask_hook",
        "_check_delivery", "_kicked", "_limits", "config", "decoder", "version", "session",
        "keepalive", "receive_maximum", "client_max_packet", "problem_info", "alive",
        "connected_at", "_pending", "_pending_bytes", "_writing", "_drained", "_acks",
        "_delivering", "_nursery", "_acks_recv", "_storing", "_ack_backlog",
        "_inbound_unacked", "_inbound_qos2", "_batch_msgs", "_batch_pkts", "_outbuf",
        "_outbuf_bytes",
        "_window", "_cancel", "_detached", "_taken_over", "_write_failed", "_store_error",
        "_aliases_in", "_aliases_out", "_alias_out_max", "_fd",
        "_held", "_auth_method", "_reauth", "_idle", "bridge", "_expires",
    )

    def __init__(
        self, broker: Broker, stream: trio.abc.Stream, peer: str, *,
        cert_identity: str | None = None,
    ) -> None:
        self.broker = broker
        self.stream = stream
        # Plain TCP: read and write the socket's fd directly, waiting for readiness only
        # when it has nothing (or no room). trio's stream calls cost two scheduler passes
        # each even when data is there; TLS and WebSocket streams keep their own.
        self._fd = stream.socket.fileno() if type(stream) is trio.SocketStream else -1
        self.peer = peer
        self.cert_identity = cert_identity  # from a verified client certificate
        self.subject: Subject | None = None  # who authenticated on this connection
        self._auth_cache: DecisionCache | None = None  # made once auth is known to be on
        self._ask_hook = False  # PUB/SUB decided by the HTTP hook (--auth-http-acl)
        self._auth_method: str | None = None  # the CONNECT's enhanced authentication method
        self._reauth: Authenticator | None = None  # a re-authentication under way
        self._expires = math.inf  # trio time the credentials lapse (a token's exp)
        self._check_delivery = False  # whether each delivery needs a SUB decision
        self._kicked: Closing | None = None
        cfg = broker.config
        self._limits = PublishLimits(cfg.max_publish_rate, cfg.max_publish_bytes_rate) \
            if cfg.max_publish_rate > 0 or cfg.max_publish_bytes_rate > 0 else None
        self.config = broker.config
        self.decoder = mqtt.Decoder(max_packet_size=self.config.max_packet_size,
                                    first_packet_max=self.config.max_connect_packet)
        self._held = 0  # partial-packet bytes counted in the node's read budget
        self.version = 4
        self.bridge = False  # a broker's bridge said so (try_private): see _on_subscribe
        self.session: Session | None = None
        self.keepalive = 0
        self.receive_maximum = self.config.max_inflight  # the client's, for our sends
        self.client_max_packet = 268_435_455
        self.problem_info = True
        self.alive = True
        self.connected_at: float | None = None
        # Bytes waiting for the socket while another task writes: bounded by OUT_LIMIT (a
        # client that stops reading holds at most that here; the rest waits in the store).
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._writing = False
        self._drained: trio.Event | None = None  # set when the queued bytes went out
        # Started on first use: an idle device costs no acker or delivery task.
        self._acks: trio.MemorySendChannel[tuple[Any, Any]] | None = None
        self._acks_recv: trio.MemoryReceiveChannel[tuple[Any, Any]] | None = None
        self._storing: tuple[Any, list[Publish]] | None = None  # the batch the acker awaits
        self._ack_backlog = 0  # items sent to the acker and not yet handled by it
        self._delivering = False
        self._idle = False  # the delivery task waits for news: drain_now may deliver
        self._nursery: trio.Nursery | None = None
        # Inbound QoS 1/2 publishes counted against our Receive Maximum (MQTT 5 §4.9): a
        # QoS 1 until its PUBACK, a QoS 2 until its PUBCOMP (ids in _inbound_qos2).
        self._inbound_unacked = 0
        self._inbound_qos2: set[int] | None = None  # made on first use
        self._batch_msgs: list[Message] = []  # publishes of the current read, not yet sent
        self._batch_pkts: list[Publish] = []
        self._outbuf: list[bytes] = []  # deliveries of the current batch, one write
        self._outbuf_bytes = 0
        # Events made on first use (an idle device waits for neither).
        self._window: trio.Event | None = None  # set when an in-flight slot frees up
        # The connection's scope (kick, takeover, a failed write cancel it); while a read
        # waits, its deadline is the keepalive's. `run` swaps in its nursery's own scope:
        # one scope for all of it (each entered scope is ~600 bytes per connection).
        self._cancel = trio.CancelScope()
        self._detached: trio.Event | bool = False  # True once closed; an Event if awaited
        self._taken_over = False
        self._write_failed = False
        self._store_error = ""
        self._aliases_in: dict[int, str] | None = None  # made on first use
        self._aliases_out: dict[str, int] | None = None
        self._alias_out_max = 0

    # -- lifecycle --------------------------------------------------------------------
    async def run(self) -> None:
        closing: Closing | None = None
        try:
            try:
                async with trio.open_nursery() as nursery:
                    early, self._cancel = self._cancel, nursery.cancel_scope
                    if early.cancel_called:  # kicked before it got here
                        nursery.cancel_scope.cancel()
                    try:
                        await self._read_loop(nursery)
                    except Exception as exc:  # noqa: BLE001 - each becomes a Closing
                        closing = self._closing_for(exc)
                    nursery.cancel_scope.cancel()
            except Exception as exc:  # noqa: BLE001 - from the acker or delivery task
                closing = self._closing_for(exc)
        finally:
            with trio.CancelScope(shield=True):
                await self._close(closing)

    def _closing_for(self, exc: BaseException) -> Closing:
        """Why this connection ends, from what ended it. An error that is no client's
        doing is logged with its traceback and told as 0x80, not as a shutdown."""
        if isinstance(exc, BaseExceptionGroup):
            found = [self._closing_for(e) for e in exc.exceptions]
            return next((c for c in found if not c.internal), found[0])
        if isinstance(exc, Closing):
            return exc
        if isinstance(exc, ProtocolError):
            return Closing(f"protocol error: {exc}", True, exc.reason_code)
        if isinstance(exc, trio.BrokenResourceError | trio.ClosedResourceError | OSError):
            return Closing(f"connection lost: {exc!r}")
        log.error("connection from %s failed", self.peer, exc_info=exc)
        closing = Closing("internal error", True, rc.UNSPECIFIED_ERROR)
        closing.internal = True
        return closing

    async def _close(self, closing: Closing | None) -> None:
        self.alive = False
        self.broker.read_budget.update(self._held, 0)
        if closing is None:  # cancelled: a takeover, a failed write, a kick or a shutdown
            if self._kicked is not None:
                closing = self._kicked
            elif self._taken_over:
                closing = Closing("taken over")
            elif self._write_failed:
                closing = Closing("connection lost while writing")
            elif self._cancel.cancelled_caught and self._expires <= trio.current_time():
                # MQTT 5 0xA0: the time this connection was authorised for is over; a
                # client reconnects with fresh credentials (not 0x87: it did nothing wrong).
                closing = Closing("credentials expired", True, rc.MAXIMUM_CONNECT_TIME)
            elif self._cancel.cancelled_caught and self._cancel.deadline <= trio.current_time():
                closing = Closing("keepalive timeout", True, rc.KEEP_ALIVE_TIMEOUT) \
                    if self.session is not None else Closing("no CONNECT in time", will=False)
            else:
                closing = Closing("server shutting down", True, rc.SERVER_SHUTTING_DOWN)
        s = self.session
        if s is not None:
            await self._finish_stored(s)
        if s is not None and closing.reason_code and self.version == 5 and not self._taken_over:
            with trio.move_on_after(0.5):
                await self._send_now(mqtt.encode(
                    Disconnect(closing.reason_code, self._reason(str(closing))), 5))
        if s is not None:
            log.info("client %r (%s) disconnected: %s", s.client_id, self.peer, closing)
            self.broker.stats.connections -= 1
            self._give_back_shared(s)
            if self._aliases_out and s.persistent:  # else nothing is resent
                _unalias_outgoing(s)
            will, s.will = s.will, None
            if will is not None and closing.will:
                self.broker.schedule_will(s, will)
            if s.connection is self:
                await self.broker.session_detached(s)
        with trio.move_on_after(1):
            await self.stream.aclose()
        if isinstance(self._detached, trio.Event):
            self._detached.set()
        self._detached = True

    async def _finish_stored(self, s: Session) -> None:
        """Publishes handed to the store before the connection ended still get their
        effects (the retained store, QoS 2 packet ids), and PUBRELs theirs, although
        their acks have no one to go to: `mosquitto_pub -r` sends CONNECT, PUBLISH and
        DISCONNECT in one write, and the acker was cancelled with the connection."""
        pending = [self._storing] if self._storing is not None else []
        self._storing = None
        while self._acks_recv is not None:
            try:
                pending.append(self._acks_recv.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
        with trio.move_on_after(STORE_DRAIN_S):
            for item, p in pending:
                if isinstance(p, Pubrel) and p.packet_id in s.incoming_qos2:
                    s.incoming_qos2.discard(p.packet_id)
                    await self.broker.remember_incoming_qos2(s, p.packet_id, done=True)
                elif isinstance(p, list):
                    try:
                        stored = await await_future(item)
                    except StoreError:
                        continue  # not stored: nothing to finish
                    await self._store_effects(s, p, stored)

    def _give_back_shared(self, s: Session) -> None:
        """Shared-subscription messages this client did not acknowledge: a QoS 1 one goes
        to another member. A QoS 2 one stays with this session, to be completed when it
        reconnects [MQTT-4.8.2-4], and if the session ends here, no other member gets it
        [MQTT-4.8.2-5] (it may have been delivered already: exactly once comes first)."""
        for pid, o in list(s.outgoing.items()):
            if o.group is None:
                continue
            if o.qos == 2:
                if not s.persistent:
                    del s.outgoing[pid]
                    o.group.acked(o.offset)
                continue
            del s.outgoing[pid]
            o.group.take_back(o.message)

    async def take_over(self) -> None:
        """A new connection claims this client id: close this one and wait until the
        session is free (spec: the server MUST close the existing connection)."""
        self._taken_over = True
        if self.version == 5:
            # Through send(): only one task may write to the socket at a time.
            with trio.move_on_after(0.5):
                await self.send(mqtt.encode(Disconnect(rc.SESSION_TAKEN_OVER), 5))
                await self._flush_writes()
        self._cancel.cancel()
        if self._detached is not True:
            if self._detached is False:
                self._detached = trio.Event()
            await self._detached.wait()

    def kick(self, why: str = "kicked by an operator", not_authorized: bool = False) -> None:
        code = rc.NOT_AUTHORIZED if not_authorized else rc.ADMINISTRATIVE_ACTION
        self._kicked = Closing(why, True, code)
        self._cancel.cancel()

    def auth_changed(self) -> None:
        """Policies changed: decisions cached on this connection no longer hold."""
        auth = self.broker.auth
        # A hook-decided client's deliveries are asked of the hook instead (awaited, so
        # in the delivery task only: _hook_refuses).
        self._check_delivery = bool(
            auth.enabled and self.subject is not None and not auth.is_super(self.subject)
            and not self._ask_hook)

    def _auth_deadline(self) -> float:
        """The trio time this connection's credentials lapse (a token's exp, a hook's
        expire_at); inf when they never do."""
        expires = self.subject.expires if self.subject is not None else None
        return math.inf if expires is None else trio.current_time() + expires - time.time()

    def _may(self, action: str, name: str, is_filter: bool = False) -> bool:
        if self.subject is None:
            return not self.broker.auth.enabled
        if self._auth_cache is None:
            self._auth_cache = DecisionCache()
        return self.broker.auth.authorize(self.subject, "Topic", name, action,
                                          is_filter=is_filter, cache=self._auth_cache)

    async def _hook_refuses(self, topic: str) -> bool:
        """Whether the HTTP hook refuses this delivery to a client it decides for: a
        filter it allowed may catch topics it denies (answers are cached per topic).
        Callers test `_ask_hook` first: no coroutine per delivery for everyone else."""
        return not await self._may_ask("SUB", topic)

    async def _may_ask(self, action: str, name: str, is_filter: bool = False) -> bool:
        """`_may`, or the HTTP hook's answer for a client it decides for."""
        if self._ask_hook and self.subject is not None:
            return await self.broker.auth.authorize_by_hook(self.subject, name, action,
                                                            is_filter=is_filter)
        return self._may(action, name, is_filter)

    # -- writing ----------------------------------------------------------------------
    async def send(self, data: bytes) -> None:
        """Write now, from the calling task; if another task is writing, queue for it (and
        wait while more than OUT_LIMIT is queued). No writer task: an idle client costs
        none, and a busy one saves a task switch per write."""
        self._pending.append(data)
        self._pending_bytes += len(data)
        if not self._writing:
            await self._write_pending()
            return
        while self._writing and self._pending_bytes > OUT_LIMIT:
            await self._drained_event().wait()

    async def _flush_writes(self) -> None:
        """Return once everything queued so far has been written."""
        while self._writing:
            await self._drained_event().wait()

    def _drained_event(self) -> trio.Event:
        if self._drained is None:
            self._drained = trio.Event()
        return self._drained

    def _wake_senders(self) -> None:
        if self._drained is not None:
            self._drained.set()
            self._drained = None

    async def _write_pending(self) -> None:
        """Write everything queued, in as few writes as possible: fewer syscalls under
        load. A client that reads nothing for write_timeout is disconnected."""
        self._writing = True
        stats = self.broker.stats
        try:
            while self._pending:
                pending = self._pending
                buf = b"".join(pending) if len(pending) > 1 else pending[0]
                self._pending = []
                self._pending_bytes = 0
                self._wake_senders()
                stats.bytes_out += len(buf)
                try:
                    if self._fd >= 0:  # most writes fit the socket's buffer: no wait
                        try:
                            sent = os.write(self._fd, buf)
                        except BlockingIOError:
                            sent = 0
                        if sent == len(buf):
                            continue
                        buf = memoryview(buf)[sent:]
                    with trio.move_on_after(self.config.write_timeout) as scope:
                        await self.stream.send_all(buf)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    self._write_failed = True
                    self._cancel.cancel()
                    return
                if scope.cancelled_caught:
                    # A client that stops reading: its messages wait in the store (a
                    # persistent session resumes there); the connection must not hold memory.
                    log.warning("client at %s read nothing for %.0fs: disconnecting",
                                self.peer, self.config.write_timeout)
                    stats.stuck_disconnects += 1
                    self._write_failed = True
                    self._cancel.cancel()
                    return
        finally:
            self._writing = False
            self._wake_senders()

    async def _send_now(self, data: bytes) -> None:
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError,
                OSError):
            pass

    def _reason(self, text: str) -> dict[str, Any]:
        """A reason string, unless the client asked for no problem information, cut to
        what keeps the packet within the client's Maximum Packet Size, and left out if
        nothing useful fits [MQTT-3.2.2-19, 3.4.2-2, 3.5.2-2, 3.14.2-3]."""
        if not self.problem_info:
            return {}
        # An ack, CONNACK or DISCONNECT with a reason code and this one property is at
        # most REASON_OVERHEAD bytes besides the string itself.
        room = max(0, min(200, self.client_max_packet - REASON_OVERHEAD))
        data = text.encode()[:room].decode("utf-8", "ignore")
        return {"reason_string": data} if len(data) >= 8 else {}

    # -- reading ----------------------------------------------------------------------
    async def _read_loop(self, nursery: trio.Nursery) -> None:
        # The connection's scope again (see _cancel): a scope of its own per connection
        # was a tenth of the cost of accepting one. _close tells this timeout apart.
        self._cancel.deadline = trio.current_time() + self.config.connect_timeout
        packets = await self._connect(nursery)
        while True:
            # The credentials' end is a deadline of the connection's scope, as the
            # keepalive is: nothing polls. _close tells the two apart.
            self._cancel.deadline = self._expires
            for packet in packets:
                await self._dispatch(packet)
            await self._flush_publishes()
            if self.keepalive:  # see _cancel
                self._cancel.deadline = min(self._expires,
                                            trio.current_time() + self.keepalive * 1.5)
            packets = await self._receive()

    async def _connect(self, nursery: trio.Nursery) -> list[Any]:
        """Read the CONNECT and answer it; returns the packets that came after it. Every
        refusal is logged with its reason: an operator cannot tell one from the client's
        side (a bridge's will refused by a policy looked like a network fault)."""
        first = None
        try:
            packets = await self._receive()
            self._cancel.deadline = math.inf
            first = packets.pop(0)
            await self._on_connect(first, nursery, packets)
        except (Refused, ProtocolError) as exc:
            who = repr(first.client_id) if isinstance(first, Connect) else "?"
            why = f"protocol error: {exc.message}" if isinstance(exc, ProtocolError) else exc
            log.info("connect of %s from %s refused: %s", who, self.peer, why)
            raise
        return packets

    async def _receive(self) -> list[Any]:
        if self.decoder.error is not None:  # after the packets that came before it
            raise self.decoder.error
        budget = self.broker.read_budget
        while True:
            held = self._held
            if held and budget.must_wait(held) and not await budget.wait(held):
                self.broker.stats.limit_refusals += 1
                log.warning("%s closed: held %d bytes of a partial packet while the "
                            "node's read budget was exhausted (--max-partial-bytes)",
                            self.peer, held)
                raise Closing("read budget exhausted", True, rc.QUOTA_EXCEEDED)
            # Plain TCP reads the fd directly (see read_fd); TLS and WebSocket streams
            # keep their own reads.
            data = await (read_fd(self._fd, budget, held) if self._fd >= 0 else
                          self.stream.receive_some(budget.read_size(held, READ_SIZE)))
            if not data:
                raise Closing("connection closed by the client")
            self.broker.stats.bytes_in += len(data)
            try:
                packets = self.decoder.feed(data)
                if held or self.decoder.buffered:
                    self._held = self.decoder.buffered
                    budget.update(held, self._held)
            except UnsupportedProtocolError as exc:
                code = rc.UNSUPPORTED_PROTOCOL_VERSION if exc.protocol_level == 5 \
                    else exc.v3_return_code
                await self._send_now(mqtt.encode(Connack(False, code), 5 if code > 5 else 4))
                raise Refused(exc.message) from exc
            except ProtocolError as exc:
                if exc.packets:  # handled first (a CONNECT too); the next call raises
                    return exc.packets
                if self.session is None and (self.decoder.version
                                             or self.decoder.connect_level) == 5:
                    # MQTT 5 §3.2.2.2, §4.13.1: a bad CONNECT gets a CONNACK with the
                    # reason code before the close (3.1.1 has no code for these).
                    code = exc.reason_code if exc.reason_code in rc.CONNACK_REASONS \
                        else rc.MALFORMED_PACKET  # e.g. 0x8F has no place in a CONNACK
                    await self._send_now(mqtt.encode(
                        Connack(False, code, self._reason(exc.message)), 5))
                raise
            if packets:
                return packets

    # -- CONNECT ----------------------------------------------------------------------
    async def _on_connect(self, p: Any, nursery: trio.Nursery, packets: list[Any]) -> None:
        """`packets`: those that came after the CONNECT; an AUTH exchange reads on."""
        if not isinstance(p, Connect):
            raise Refused("first packet is not CONNECT")
        self.version = v = p.protocol_level
        self.bridge = p.bridge
        props = p.properties
        authenticator = None
        if v == 5:  # before any answer: each must fit [MQTT-3.2.2-19]
            self.client_max_packet = int(props.get("maximum_packet_size", 268_435_455))
        if v == 5 and "authentication_method" in props:
            # Enhanced authentication (§4.12): the methods the AuthManager offers.
            authenticator = self.broker.auth.enhanced(props["authentication_method"])
            if authenticator is None:
                await self._send_now(mqtt.encode(Connack(
                    False, rc.BAD_AUTHENTICATION_METHOD, self._reason(
                        f"authentication method {props['authentication_method']!r} "
                        "is not supported")), 5))
                raise Refused("unsupported authentication method")
            self._auth_method = authenticator.method
        client_id = p.client_id
        assigned = None
        if not client_id:
            if v < 5 and not p.clean_start:
                # 3.1.1: a zero-byte id needs CleanSession=1 (return code 2)
                await self._send_now(mqtt.encode(Connack(False, 2), v))
                raise Refused("empty client id with a persistent session")
            client_id = assigned = self.broker.assign_client_id()
        if v == 5:
            expiry = int(props.get("session_expiry_interval", 0))
            self.receive_maximum = int(props.get("receive_maximum", 65535))
            self.client_max_packet = int(props.get("maximum_packet_size", 268_435_455))
            self._alias_out_max = int(props.get("topic_alias_maximum", 0))
            self.problem_info = bool(props.get("request_problem_information", 1))
        else:
            # 3.1.1 sessions never end by themselves; ours do, after --v3-session-expiry-s.
            v3_expiry = int(self.config.v3_session_expiry_s) or NEVER_EXPIRES
            expiry = 0 if p.clean_start else v3_expiry
        auth_data = await self._admit(p, v, client_id, authenticator, packets)
        self.keepalive = p.keepalive
        server_keepalive = None
        max_ka = self.config.max_keepalive
        if max_ka and (self.keepalive == 0 or self.keepalive > max_ka) and v == 5:
            self.keepalive = server_keepalive = max_ka
        try:
            session, present = await self.broker.open_session(
                client_id, p.clean_start, expiry, v, connection=self)
        except SessionLimitReached as exc:
            log.warning("connect of %r from %s refused: %s", client_id, self.peer, exc)
            await self._refuse(v, rc.QUOTA_EXCEEDED, 3, "no room for a new persistent session")
        except StoreError as exc:  # away (a failover): the client retries with its backoff
            log.warning("connect of %r from %s refused: %s", client_id, self.peer, exc)
            await self._refuse(v, rc.SERVER_UNAVAILABLE, rc.CONNACK_SERVER_UNAVAILABLE,
                               "the store is unavailable")
        self.session = session
        self.connected_at = time.time()
        session.will = p.will
        self.broker.stats.connections += 1
        self.broker.stats.connects_total += 1
        ack_props: dict[str, Any] = {}
        if v == 5:
            ack_props = {
                "receive_maximum": self.config.max_pending_publishes,
                "maximum_packet_size": self.config.max_packet_size,
                "retain_available": 1,
                "wildcard_subscription_available": 1,
                "shared_subscription_available": 1,
                "subscription_identifier_available": 1,
                "topic_alias_maximum": self.config.topic_alias_maximum,
            }
            if self.config.max_qos < 2:
                ack_props["maximum_qos"] = self.config.max_qos
            if assigned:
                ack_props["assigned_client_identifier"] = assigned
            if server_keepalive is not None:
                ack_props["server_keep_alive"] = server_keepalive
            if self._auth_method is not None:
                ack_props["authentication_method"] = self._auth_method
                if auth_data is not None:
                    ack_props["authentication_data"] = auth_data
        await self.send(mqtt.encode(Connack(present, 0, ack_props), v))
        log.info("client %r connected from %s (v%d%s, %s session%s)", client_id, self.peer,
                 v, " bridge" if self.bridge else "",
                 "persistent" if session.persistent else "clean", ", resumed" if present else "")
        self._nursery = nursery
        if session.has_state():
            self._start_delivery(resume=True)
            for group in session.groups:
                group.wake()  # a member is back

    async def _refuse(self, v: int, code5: int, code3: int | None, why: str) -> None:
        """CONNACK with a failure code, then close (no will: it never connected).
        `code3` None: 3.1.1 has no return code for it, the connection just closes."""
        code = code5 if v == 5 else code3
        if code is not None:
            props = self._reason(why) if v == 5 else {}
            await self._send_now(mqtt.encode(Connack(False, code, props), v))
        raise Refused(why)

    async def _check_will(self, will: mqtt.Will, v: int) -> None:
        """What the codec cannot know about a will: this server's limits (MQTT 5
        §3.2.2.2: CONNACK 0x90, 0x9B, 0x99 before the close)."""
        b = self.broker
        if b.topic_past_limits(will.topic):
            b.stats.topic_refusals += 1
            await self._refuse(v, rc.TOPIC_NAME_INVALID, None, "will topic past "
                               "--max-topic-levels or --max-topic-length")
        if v == 5 and will.qos > self.config.max_qos:  # [MQTT-3.2.2-12]
            await self._refuse(v, rc.QOS_NOT_SUPPORTED, None, f"will QoS {will.qos} is "
                               f"above the maximum QoS {self.config.max_qos}")
        if will.properties.get("payload_format_indicator") == 1 \
                and not _is_utf8(will.payload):  # §3.1.3.2.3
            await self._refuse(v, rc.PAYLOAD_FORMAT_INVALID, None,
                               "will payload is not UTF-8 as its format indicator says")

    async def _check_will_topic(self, topic: str, v: int) -> None:
        """The will's topic takes the PUB right a publish there would need."""
        why = reserved_refusal(topic, self.broker.auth.enabled)
        if why is None and not await self._may_ask("PUB", topic):
            why = "not authorized"
        if why is not None:
            await self._refuse(v, rc.NOT_AUTHORIZED, 5, f"will topic {topic!r} {why}")

    async def _admit(self, p: Connect, v: int, client_id: str,
                     authenticator: Authenticator | None, packets: list[Any]) -> bytes | None:
        """Connection limits, then authentication and the will's PUB right. Returns the
        enhanced authentication's last data, for the CONNACK."""
        broker, cfg = self.broker, self.config
        ip = self.peer.rsplit(":", 1)[0]
        if cfg.max_connections and broker.stats.connections >= cfg.max_connections:
            broker.stats.limit_refusals += 1
            log.warning("connect from %s refused: %d connections (--max-connections)",
                        self.peer, broker.stats.connections)
            await self._refuse(v, rc.QUOTA_EXCEEDED, 3, "server connection limit reached")
        if not broker.connect_limiter.allow(ip):
            broker.stats.limit_refusals += 1
            log.warning("connect from %s refused: above --max-connect-rate", self.peer)
            await self._refuse(v, rc.CONNECTION_RATE_EXCEEDED, 3, "connect rate exceeded")
        password = p.password.decode("utf-8", "surrogateescape") if p.password else None
        auth_data = None
        try:
            if authenticator is not None:
                self.subject, auth_data = await self._enhanced_connect(
                    p, authenticator, ip, client_id, packets)
            else:
                self.subject = await broker.auth.authenticate(
                    p.username, password, ip, "mqtt", self.cert_identity, client_id)
        except AuthError as exc:
            if exc.disabled or (authenticator is None and not p.username
                                and not self.cert_identity):
                await self._refuse(v, rc.NOT_AUTHORIZED, 5, "not authorized")
            await self._refuse(v, rc.BAD_USER_NAME_OR_PASSWORD, 4, "bad user name or password")
        self._ask_hook = broker.auth.asks_hook(self.subject)
        self._expires = self._auth_deadline()
        if p.will is not None:
            await self._check_will(p.will, v)
            await self._check_will_topic(p.will.topic, v)
        self.auth_changed()
        self.decoder.max_packet_size = self.config.max_packet_size
        return auth_data

    async def _enhanced_connect(self, p: Connect, authenticator: Authenticator, ip: str,
                                client_id: str, packets: list[Any]) -> tuple[Subject, bytes | None]:
        """The CONNECT's AUTH exchange (§4.12): AUTH 0x18 both ways until the method
        decides. AuthError when it fails."""
        auth, method = self.broker.auth, authenticator.method
        # The exchange's AUTH packets come from nobody yet: bounded as the CONNECT was
        # (--max-connect-packet) until _admit lifts it. Data a client pipelined behind
        # its CONNECT was read already, within the node's read budget, as for any client.
        self.decoder.max_packet_size = self.decoder.first_packet_max
        await auth.enhanced_wait(ip)
        step = authenticator.start(p.properties.get("authentication_data"))
        deadline = trio.current_time() + self.config.connect_timeout
        while step.outcome == CONTINUE:
            await self._send_now(mqtt.encode(self._auth_packet(rc.CONTINUE_AUTHENTICATION,
                                                               step.data), 5))
            with trio.move_on_at(deadline):
                while not packets:
                    packets.extend(await self._receive())
            if not packets:
                raise Refused("authentication not finished in time")
            reply = packets.pop(0)
            if isinstance(reply, Disconnect):
                raise Refused("DISCONNECT during authentication")
            if (not isinstance(reply, Auth) or reply.reason_code != rc.CONTINUE_AUTHENTICATION
                    or reply.properties.get("authentication_method") != method):
                await self._refuse(5, rc.PROTOCOL_ERROR, 0, f"expected AUTH 0x18 for {method}")
            step = authenticator.step(reply.properties.get("authentication_data"))
        if p.username and step.outcome != FAILURE and p.username != step.user:
            step = AuthStep.failure(f"{method}: CONNECT user name {p.username!r} is not "
                                    f"the authenticated {step.user!r}", step.user)
        return auth.enhanced_result(method, step, ip, "mqtt", client_id), step.data

    def _auth_packet(self, code: int, data: bytes | None) -> Auth:
        props: dict[str, Any] = {"authentication_method": self._auth_method}
        if data is not None:
            props["authentication_data"] = data
        return Auth(code, props)

    async def _on_auth(self, p: Auth) -> None:
        """Re-authentication (§4.12.1): AUTH 0x19 with the CONNECT's method, the same
        exchange, AUTH 0x00 on success; on failure the connection ends (0x87)."""
        method = self._auth_method
        if method is None:
            raise ProtocolError(rc.PROTOCOL_ERROR, "AUTH without an authentication method")
        if p.properties.get("authentication_method") != method:
            raise ProtocolError(rc.PROTOCOL_ERROR, f"AUTH with a method other than {method}")
        data = p.properties.get("authentication_data")
        auth, ip = self.broker.auth, self.peer.rsplit(":", 1)[0]
        if p.reason_code == rc.RE_AUTHENTICATE:
            authenticator = auth.enhanced(method)
            if authenticator is None:  # auth switched off or method withdrawn meanwhile
                raise Closing("re-authentication method gone", True,
                              rc.BAD_AUTHENTICATION_METHOD)
            self._reauth = authenticator
            await auth.enhanced_wait(ip)
            step: AuthStep = authenticator.start(data)
        elif p.reason_code == rc.CONTINUE_AUTHENTICATION and self._reauth is not None:
            step = self._reauth.step(data)
        else:
            raise ProtocolError(rc.PROTOCOL_ERROR, f"unexpected AUTH 0x{p.reason_code:02X}")
        if step.outcome == CONTINUE:
            await self.send(mqtt.encode(self._auth_packet(rc.CONTINUE_AUTHENTICATION,
                                                          step.data), 5))
            return
        self._reauth = None
        assert self.session is not None and self.subject is not None
        try:
            subject = auth.enhanced_result(method, step, ip, "mqtt", self.session.client_id)
        except AuthError as exc:
            raise Closing(f"re-authentication failed: {exc.reason}", True,
                          rc.NOT_AUTHORIZED) from None
        if subject.name != self.subject.name:  # the session and its rights are the first's
            raise Closing("re-authenticated as another user", True, rc.NOT_AUTHORIZED)
        self.subject = subject
        self._expires = self._auth_deadline()
        self._auth_cache = None
        self.auth_changed()
        await self.send(mqtt.encode(self._auth_packet(rc.SUCCESS, step.data), 5))

    # -- packets after CONNECT --------------------------------------------------------
    async def _dispatch(self, p: Any) -> None:
        if isinstance(p, Publish):
            await self._on_publish(p)
            return
        await self._flush_publishes()  # keep acks in arrival order
        if isinstance(p, Puback):
            await self._on_ack(p.packet_id, 1)
        elif isinstance(p, Pubrec):
            await self._on_pubrec(p)
        elif isinstance(p, Pubcomp):
            await self._on_ack(p.packet_id, 2)
        elif isinstance(p, Pubrel):
            await self._to_acker(_NO_STORE_WAIT, p)  # after pending PUBRECs
        elif isinstance(p, Subscribe):
            await self._on_subscribe(p)
        elif isinstance(p, Unsubscribe):
            await self._on_unsubscribe(p)
        elif isinstance(p, Pingreq):
            await self.send(mqtt.encode(Pingresp(), self.version))
        elif isinstance(p, Disconnect):
            self._on_disconnect(p)
        elif isinstance(p, Auth):
            await self._on_auth(p)
        elif isinstance(p, Connect):
            raise ProtocolError(rc.PROTOCOL_ERROR, "second CONNECT")
        else:
            raise ProtocolError(rc.PROTOCOL_ERROR, f"unexpected {type(p).__name__}")

    def _on_disconnect(self, p: Disconnect) -> None:
        s = self.session
        assert s is not None
        if self.version == 5 and "session_expiry_interval" in p.properties:
            new = int(p.properties["session_expiry_interval"])
            if s.expiry == 0 and new:
                raise ProtocolError(rc.PROTOCOL_ERROR,
                                    "session expiry set on DISCONNECT after 0 on CONNECT")
            s.expiry = new
            s.persistent = new > 0
        raise Closing("DISCONNECT", will=p.reason_code == rc.DISCONNECT_WITH_WILL_MESSAGE)

    async def _on_publish(self, p: Publish) -> None:
        s = self.session
        assert s is not None
        topic = p.topic
        if self.version == 5 and "topic_alias" in p.properties:
            topic = self._resolve_alias(p)
        if p.qos > self.config.max_qos:
            raise ProtocolError(rc.QOS_NOT_SUPPORTED, f"QoS {p.qos} not supported")
        over = self._limits.exceeded(len(p.payload)) if self._limits is not None else None
        if over is not None:
            self.broker.stats.limit_refusals += 1
            log.warning("client %r at %s disconnected: %s", s.client_id, self.peer, over)
            raise Closing(f"publish rate limit: {over}", True, rc.MESSAGE_RATE_TOO_HIGH)
        self.broker.stats.messages_in += 1
        self.broker.stats.messages_in_qos[p.qos] += 1
        if topic.startswith("$"):
            # MQTT §4.7.2: the server's ($SYS statistics), but for bridges' state topics
            # and what the policies grant (gateway/reserved.py).
            why = reserved_refusal(topic, self.broker.auth.enabled)
            if why is not None:
                await self._refuse_publish(p, topic, why)
                return
        if self.subject is not None and not (
                await self._may_ask("PUB", topic) if self._ask_hook else self._may("PUB", topic)):
            await self._refuse_publish(p, topic, "not authorized")
            return
        if self.broker.topic_past_limits(topic):
            self.broker.stats.topic_refusals += 1
            await self._refuse_publish(p, topic[:100], "past --max-topic-levels or "
                                       "--max-topic-length", rc.TOPIC_NAME_INVALID)
            return
        props = {k: v for k, v in p.properties.items() if k != "topic_alias"} \
            if p.properties else {}
        if p.retain and p.payload:
            why = self.broker.retained.admit(topic, s.client_id,
                                             stored_size(topic, p.payload, props))
            if why is not None:
                self.broker.stats.limit_refusals += 1
                await self._refuse_publish(p, topic, why, rc.QUOTA_EXCEEDED)
                return
        if p.qos == 2 and p.packet_id in s.incoming_qos2:
            await self._flush_publishes()
            await self._to_acker(_NO_STORE_WAIT, p)  # duplicate: PUBREC again
            return
        if p.qos == 2 and p.dup and s.persistent:
            # A resend the session has no exchange for: stored already if a crash fell
            # between the append and the packet id's marker (the record carries the id).
            await self._flush_publishes()
            phys = await self.broker.stored_qos2(s, p.packet_id)
            if phys is not None:
                log.info("client %r resent QoS 2 packet id %d stored before a restart: "
                         "not stored again", s.client_id, p.packet_id)
                s.incoming_qos2.add(p.packet_id)
                await self.broker.remember_incoming_qos2(s, p.packet_id, False, phys)
                await self._to_acker(_NO_STORE_WAIT, p)
                return
        if p.qos:
            self._count_inbound(p)
        if p.properties.get("payload_format_indicator") == 1 and not _is_utf8(p.payload):
            if not p.qos:
                raise ProtocolError(rc.PAYLOAD_FORMAT_INVALID, "payload is not UTF-8")
            await self._flush_publishes()
            await self._to_acker(rc.PAYLOAD_FORMAT_INVALID, p)
            return
        self._batch_msgs.append(Message(
            topic, p.payload, p.qos, p.retain, s.client_id, props,
            born_ts=time.time_ns() // 1_000_000,
            key=qos2_key(s.client_id, p.packet_id) if p.qos == 2 and s.persistent else ""))
        self._batch_pkts.append(p)
        if p.qos == 2:
            s.incoming_qos2.add(p.packet_id)
        if len(self._batch_msgs) >= PUBLISH_BATCH:
            await self._flush_publishes()

    async def _refuse_publish(self, p: Publish, topic: str, why: str,
                              code: int = rc.NOT_AUTHORIZED) -> None:
        """Not stored. v5: PUBACK/PUBREC with `code`; 3.1.1 has no negative ack, so the
        client gets a plain ack (else it would resend forever) and the log says why."""
        log.info("publish of %r on %r by %s %s: dropped",
                 self.session.client_id if self.session else "?", topic, self.peer, why)
        if not p.qos:
            return
        await self._flush_publishes()  # acks stay in arrival order
        self._count_inbound(p)
        await self._to_acker(code if self.version == 5 else 0, p)

    async def _flush_publishes(self) -> None:
        """Everything one read brought in goes to the store as one append (one write, one
        wake-up), in arrival order; acks follow per packet."""
        if not self._batch_msgs:
            return
        msgs, pkts = self._batch_msgs, self._batch_pkts
        self._batch_msgs, self._batch_pkts = [], []
        try:
            fut = self.broker.store.publish_start(msgs, validated=True)  # by the codec
        except ValueError as exc:
            raise ProtocolError(rc.TOPIC_NAME_INVALID, str(exc)) from exc
        await self._to_acker(fut, pkts)

    def _count_inbound(self, p: Publish) -> None:
        """One more QoS 1/2 publish unacknowledged; past our Receive Maximum, 0x93."""
        self._inbound_unacked += 1
        if p.qos == 2:
            if self._inbound_qos2 is None:
                self._inbound_qos2 = set()
            self._inbound_qos2.add(p.packet_id)
        if self.version == 5 and self._inbound_unacked > self.config.max_pending_publishes:
            raise ProtocolError(rc.RECEIVE_MAXIMUM_EXCEEDED, "Receive Maximum exceeded")

    def _release_qos2(self, pid: int) -> None:
        """A QoS 2 exchange counted by _count_inbound has ended (PUBCOMP, or a failed
        PUBREC); a duplicate or a resumed exchange was never counted."""
        if self._inbound_qos2 is not None and pid in self._inbound_qos2:
            self._inbound_qos2.discard(pid)
            self._inbound_unacked -= 1

    def _resolve_alias(self, p: Publish) -> str:
        alias = p.properties["topic_alias"]
        if alias > self.config.topic_alias_maximum:
            raise ProtocolError(rc.TOPIC_ALIAS_INVALID, f"topic alias {alias} above maximum")
        if self._aliases_in is None:
            self._aliases_in = {}
        if p.topic:
            self._aliases_in[alias] = p.topic
            return p.topic
        topic = self._aliases_in.get(alias)
        if topic is None:
            raise ProtocolError(rc.PROTOCOL_ERROR, f"unknown topic alias {alias}")
        return topic

    def _acks_channel(self) -> trio.MemorySendChannel[tuple[Any, Any]]:
        if self._acks is None:
            assert self._nursery is not None
            self._acks, recv = trio.open_memory_channel[tuple[Any, Any]](
                self.config.max_pending_publishes)
            self._acks_recv = recv
            self._nursery.start_soon(self._acker, recv)
        return self._acks

    def _start_delivery(self, resume: bool = False) -> None:
        """`resume`: at CONNECT, for a session with state; it resends what is in flight."""
        if not self._delivering and self._nursery is not None:
            self._delivering = True
            self._nursery.start_soon(self._deliver_loop, resume)

    async def _to_acker(self, item: Any, p: Any) -> None:
        """Acknowledge `p` in arrival order. When nothing is waiting for the acker and
        the store already has it (an inline append: flush async), right here: a task
        hop per publish was most of the cost of a lone message."""
        if not self._ack_backlog and not (isinstance(item, Future) and not item.done()):
            s = self.session
            assert s is not None
            await self._handle_ack(s, item, p)
            return
        self._ack_backlog += 1
        await self._acks_channel().send((item, p))

    async def _acker(self, acks: trio.MemoryReceiveChannel[tuple[Any, Any]]) -> None:
        """Acknowledge publishes in arrival order, each only once the store has it."""
        s = self.session
        assert s is not None
        async for item, p in acks:
            await self._handle_ack(s, item, p)
            self._ack_backlog -= 1

    async def _handle_ack(self, s: Session, item: Any, p: Any) -> None:
        if isinstance(p, Pubrel):
            await self._on_pubrel(s, p)
        elif isinstance(p, list):  # a batch stored by one append: its acks in one write
            self._storing = (item, p)
            codes = await self._await_store(s, item, p)
            self._storing = None
            acks = [self._ack(s, pkt, code) for pkt, code in zip(p, codes, strict=True)
                    if code is not None and pkt.qos]
            if acks:
                await self.send(b"".join(acks))
        else:  # refused before storing (a reason code), or a duplicate QoS 2
            await self.send(self._ack(s, p, item if isinstance(item, int) else 0))

    def _ack(self, s: Session, p: Publish, code: int) -> bytes:
        """The PUBACK/PUBREC for a QoS 1/2 publish (b"" for QoS 0)."""
        if not p.qos:
            return b""
        if p.qos == 1:
            self._inbound_unacked -= 1
        elif code or p.packet_id not in s.incoming_qos2:
            self._release_qos2(p.packet_id)  # no PUBREL will follow: the exchange ends
        text = self._store_error if code in (rc.UNSPECIFIED_ERROR, rc.QUOTA_EXCEEDED) \
            else rc.REASON_NAMES.get(code, "")
        props = self._reason(text) if code else {}
        if p.qos == 1:
            return mqtt.encode(Puback(p.packet_id, code, props), self.version)
        if code:
            s.incoming_qos2.discard(p.packet_id)
        return mqtt.encode(Pubrec(p.packet_id, code, props), self.version)

    async def _await_store(self, s: Session, fut: Any, pkts: list[Publish]) -> list[int | None]:
        """Per packet: 0 when stored, a v5 reason code when not, None when nothing is to
        be sent back (QoS 0)."""
        t0 = time.perf_counter()
        try:
            stored = await await_future(fut)
            self.broker.stats.observe_append(time.perf_counter() - t0)
            self.broker.cache.offer(stored)
        except StoreError as exc:
            self.broker.stats.publish_errors += len(pkts)
            self._store_error = f"not stored: {exc}"
            log.warning("%d publishes from %r not stored: %s", len(pkts), s.client_id, exc)
            if self.version < 5 and any(p.qos for p in pkts):
                # 3.1.1 has no negative ack: close so the client resends
                raise Closing(f"store error: {exc}", will=True) from exc
            code = rc.QUOTA_EXCEEDED if isinstance(exc, StoreFullError) else rc.UNSPECIFIED_ERROR
            return [code if p.qos else None for p in pkts]
        await self._store_effects(s, pkts, stored)
        return [0 if p.qos else None for p in pkts]

    async def _store_effects(self, s: Session, pkts: list[Publish],
                             stored: list[Message]) -> None:
        """What follows a stored publish before its ack: retained, QoS 2 packet ids.
        Idempotent, so a batch interrupted by the connection's end may be run again."""
        for p, msg in zip(pkts, stored, strict=True):
            if p.retain:
                await self.broker.set_retained(msg)
            if p.qos == 2:
                await self.broker.remember_incoming_qos2(s, p.packet_id, False,
                                                         msg.phys_offset)

    async def _on_pubrel(self, s: Session, p: Pubrel) -> None:
        if p.packet_id in s.incoming_qos2:
            s.incoming_qos2.discard(p.packet_id)
            self._release_qos2(p.packet_id)
            await self.broker.remember_incoming_qos2(s, p.packet_id, done=True)
            await self.send(mqtt.encode(Pubcomp(p.packet_id), self.version))
        else:
            code = rc.PACKET_IDENTIFIER_NOT_FOUND if self.version == 5 else 0
            await self.send(mqtt.encode(Pubcomp(p.packet_id, code), self.version))

    async def _on_ack(self, pid: int, qos: int) -> None:
        s = self.session
        assert s is not None
        o = s.outgoing.get(pid)
        if o is None or o.qos != qos or (qos == 2 and o.state != "pubrel"):
            log.debug("client %r acked unknown packet id %d", s.client_id, pid)
            return
        await self._complete(s, o)

    async def _complete(self, s: Session, o: Outgoing) -> None:
        del s.outgoing[o.packet_id]
        if o.group is not None:
            o.group.acked(o.offset)
        else:
            await self.broker.forget_outgoing(s, o)
        if self._window is not None:
            self._window.set()
        for group in s.groups:
            group.wake()  # this member has room again

    async def _on_pubrec(self, p: Pubrec) -> None:
        s = self.session
        assert s is not None
        o = s.outgoing.get(p.packet_id)
        if o is None or o.qos != 2:
            code = rc.PACKET_IDENTIFIER_NOT_FOUND if self.version == 5 else 0
            await self.send(mqtt.encode(Pubrel(p.packet_id, code), self.version))
            return
        if p.reason_code >= 0x80:  # v5: the receiver refused it; the exchange ends here
            await self._complete(s, o)
            return
        o.state = "pubrel"
        if o.group is None:
            await self.broker.persist_outgoing(s, o)
        await self.send(mqtt.encode(Pubrel(p.packet_id), self.version))

    async def _on_subscribe(self, p: Subscribe) -> None:
        s = self.session
        assert s is not None
        v = self.version
        codes = []
        retained_to_send = []
        sid = None
        if v == 5:
            ids = p.properties.get("subscription_identifier")
            sid = ids[0] if isinstance(ids, list) and ids else ids
        for topic_filter, opts in p.subscriptions:
            try:
                shared = parse_shared(topic_filter)
            except ValueError:
                codes.append(rc.TOPIC_FILTER_INVALID if v == 5 else 0x80)
                continue
            if shared and opts.no_local:
                raise ProtocolError(rc.PROTOCOL_ERROR, "No Local on a shared subscription")
            refusal = await self._subscribe_refusal(s, topic_filter, shared)
            if refusal is not None:
                codes.append(refusal if v == 5 else 0x80)
                continue
            granted = min(opts.qos, self.config.max_qos)
            # A bridge's subscriptions, as Mosquitto and EMQX make them: what it sent is
            # not sent back (it would go round), retained messages stay retained.
            bridged = self.bridge and not shared
            opts = mqtt.SubscriptionOptions(granted, opts.no_local or bridged,
                                            opts.retain_as_published or bridged,
                                            opts.retain_handling)
            sub = Subscription(topic_filter, opts, sid, shared)
            try:
                new = await self.broker.subscribe(s, sub)
            except StoreError as exc:
                log.warning("subscribe of %r to %r failed: %s", s.client_id, topic_filter, exc)
                codes.append(rc.UNSPECIFIED_ERROR)
                continue
            codes.append(granted)
            self._start_delivery()
            # Retained messages are not sent for shared subscriptions (MQTT 5 §4.8.2).
            if not shared and (opts.retain_handling == 0
                               or (opts.retain_handling == 1 and new)):
                retained_to_send.append(sub)
        await self.send(mqtt.encode(Suback(p.packet_id, codes), v))
        if retained_to_send:
            await self._send_retained(retained_to_send)

    async def _send_retained(self, subs: list[Subscription]) -> None:
        """Retained messages for new subscriptions, sent by this (the reading) task while
        the in-flight window has room, so they go before anything published after the
        SUBSCRIBE. The rest goes from a task of its own: waiting here for a slot would
        wait for a PUBACK that only this task could read."""
        s = self.session
        assert s is not None
        todo = []
        for sub in subs:
            for r in await self.broker.retained_for(sub.topic_filter):
                if self._check_delivery and not self._may("SUB", r.topic) \
                        or self._ask_hook and await self._hook_refuses(r.topic):
                    continue
                qos = min(r.qos, sub.options.qos)
                sids = [sub.subscription_id] if sub.subscription_id else None
                todo.append((r.to_message(), qos, sids))
        sent = 0  # an index, not pop(0): a '#' subscription may match thousands
        while sent < len(todo) and (not todo[sent][1]
                                    or len(s.outgoing) < self._window_limit()):
            msg, qos, sids = todo[sent]
            await self._push(msg, qos, True, sids, None, -1)
            sent += 1
        if sent < len(todo) and self._nursery is not None:
            self._nursery.start_soon(self._push_retained, todo[sent:])

    async def _push_retained(self, todo: list[tuple[Message, int, list[int] | None]]) -> None:
        for msg, qos, sids in todo:
            await self._push(msg, qos, True, sids, None, -1)

    async def _subscribe_refusal(self, s: Session, topic_filter: str,
                                 shared: tuple[str, str] | None) -> int | None:
        """A SUBACK failure code if this filter is not allowed (ACL or limit), else None."""
        real = shared[1] if shared else topic_filter
        if not await self._may_ask("SUB", real, is_filter=True):
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
            self.broker.stats.limit_refusals += 1
            log.warning("subscribe of %r to %r refused: %d subscriptions (limit)",
                        s.client_id, topic_filter, len(s.subscriptions))
            return rc.QUOTA_EXCEEDED
        return None

    async def _on_unsubscribe(self, p: Unsubscribe) -> None:
        s = self.session
        assert s is not None
        codes = []
        for topic_filter in p.filters:
            existed = await self.broker.unsubscribe(s, topic_filter)
            codes.append(rc.SUCCESS if existed else rc.NO_SUBSCRIPTION_EXISTED)
        await self.send(mqtt.encode(Unsuback(p.packet_id, codes), self.version))

    # -- delivery ---------------------------------------------------------------------
    async def _deliver_loop(self, resume: bool) -> None:
        s = self.session
        assert s is not None
        if resume:
            await self._resend_outgoing(s)
        await self._apply_offline_bound(s)
        for queue in s.reading():
            s.notify(queue)  # catch up with whatever arrived while offline
        while True:
            self._idle = True
            try:
                await s.wait_news()
            finally:
                self._idle = False
            for queue in s.take_dirty():
                try:
                    await self._drain(s, queue)
                except StoreError as exc:  # the store is away: keep the client, retry
                    log.warning("delivery to %r paused: %s", s.client_id, exc)
                    await trio.sleep(0.5)
                    s.notify(queue)

    async def _resend_outgoing(self, s: Session) -> None:
        """Resend what the session had in flight, in order, within this connection's
        Receive Maximum (MQTT 5 §4.9: it may be smaller than the last connection's)."""
        inflight = list(s.outgoing.values())  # acks change it while this task sends
        held = [o for o in inflight if o.state != "pubrel"]
        for o in inflight:
            if o.state == "pubrel":  # counts against the window, but is always sent
                await self.send(mqtt.encode(Pubrel(o.packet_id), self.version))
        for i, o in enumerate(held):
            # In flight on this connection: everything outgoing but what is still held
            # (a client may acknowledge a held one it received before the reconnect).
            while s.outgoing.get(o.packet_id) is o and len(s.outgoing) - sum(
                    s.outgoing.get(x.packet_id) is x for x in held[i:]) >= self._window_limit():
                await self._window_wait()
            if s.outgoing.get(o.packet_id) is not o:
                continue
            if o.version != self.version and o.message is not None:
                # The session resumed on a connection of another protocol version.
                o.data = self.broker.template(o.message).for_subscriber(
                    o.packet_id, False, version=self.version, qos=o.qos, retain=False)
                o.version = self.version
            await self.send(_with_dup(o.data))

    async def _apply_offline_bound(self, s: Session) -> None:
        """A session back from offline resumes at most --max-offline-messages and
        --max-offline-bytes behind each queue's end; what is older is skipped."""
        limit, max_bytes = self.config.max_offline_messages, self.config.max_offline_bytes
        store = self.broker.store
        for queue in s.reading():
            cursor = s.cursors.get(queue)
            if cursor is None:
                continue
            end = await store.queue_end(queue)
            start = max(cursor, end - limit) if limit else cursor
            if max_bytes and start < end:
                start = await store.queue_tail_start(queue, start, max_bytes)
            if start > cursor:
                dropped = start - cursor
                s.cursors[queue] = start
                s.offsets_dirty.add(queue)
                self.broker.stats.dropped += dropped
                self.broker.stats.offline_dropped += dropped
                log.warning("client %r: %d offline messages on %r dropped (limit %d "
                            "messages, %d bytes)", s.client_id, dropped, queue, limit,
                            max_bytes)

    async def _drain(self, s: Session, queue: str) -> None:
        cache = self.broker.cache
        while queue in s.subscriptions:
            cursor = s.cursors.get(queue)
            if cursor is None:
                cursor = s.cursors[queue] = await self.broker.store.queue_end(queue)
            msgs, start = await cache.pull(queue, cursor, self.config.pull_batch)
            if start != cursor:
                s.cursors[queue] = cursor = start
                s.offsets_dirty.add(queue)
            if not msgs:
                return
            try:
                for msg in msgs:
                    if queue not in s.subscriptions:
                        return
                    await self._deliver(s, queue, msg)
                    s.cursors[queue] = msg.offset_in(queue) + 1
                    s.offsets_dirty.add(queue)
            finally:
                await self._flush_out()  # the batch goes out as one write

    async def _deliver(self, s: Session, queue: str, msg: Message) -> None:
        plan = self._plan(s, queue, msg)
        if plan is not None and not (self._ask_hook and await self._hook_refuses(msg.topic)):
            qos, retain, sids, offset = plan
            await self._push(msg, qos, retain, sids, queue, offset, buffered=True)

    def _plan(self, s: Session, queue: str, msg: Message
              ) -> tuple[int, bool, list[int] | None, int] | None:
        """How `msg` of `queue` goes to this session: (QoS, retain flag, subscription
        ids, offset in the queue), or None when it is not for this session."""
        offset = msg.offset_in(queue)
        if s.restored_upto:
            upto = s.restored_upto.get(queue)
            if upto is not None:
                if offset <= upto:
                    return None  # sent before a restart: acked, or resent with DUP
                del s.restored_upto[queue]
        subs = _only_reader(s, queue) or s.matching(msg.topic)
        if not subs:
            return None
        if self._check_delivery and not self._may("SUB", msg.topic):
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
            if self.version == 5 else None
        if sids and len(sids) > 1:  # one copy: each distinct identifier once (§3.3.4)
            sids = list(dict.fromkeys(sids))
        return qos, retain, sids, offset

    def drain_now(self, s: Session, queue: str) -> bool:
        """Deliver what `queue` holds for this session here, in the caller's step (the
        publisher's append, or the notify callback), when nothing needs waiting for.
        At low rates each message woke the delivery task: a scheduler pass and a task
        step per message, half the broker's CPU. False: the delivery task must do it."""
        if (not self._idle or self._fd < 0 or self._writing or s.dirty
                or s.restored_upto or queue not in s.subscriptions or self._ask_hook):
            return False  # (a hook's answer is awaited: the delivery task's work)
        if self._cancel.cancel_called:
            # Closing (a DISCONNECT was read, a kick): the delivery task is cancelled but
            # not yet unwound. A message sent now would be in flight on a connection that
            # is going: resent on resume, ahead of the offline bound's newest messages.
            return False
        cursor = s.cursors.get(queue)
        if cursor is None:
            return False
        batch = self.config.pull_batch
        got = self.broker.cache.pull_now(queue, cursor, batch)
        if got is None:
            return False
        msgs, start = got
        if start != cursor:
            s.cursors[queue] = start
            s.offsets_dirty.add(queue)
        done = len(msgs) < batch
        for msg in msgs:
            # A QoS 1/2 delivery may have to wait for a window slot or, for a persistent
            # session, for its in-flight record: the delivery task's work.
            if msg.qos and (s.persistent or len(s.outgoing) >= self._window_limit()):
                done = False
                break
            plan = self._plan(s, queue, msg)
            if plan is not None:
                qos, retain, sids, offset = plan
                self._stage(msg, qos, retain, sids, queue, offset)
            s.cursors[queue] = msg.offset_in(queue) + 1
            s.offsets_dirty.add(queue)
        self._write_outbuf_now()
        return done

    def _write_outbuf_now(self) -> None:
        """Write the buffered deliveries without waiting; what the socket cannot take
        now goes to a writer task (senders queue behind it, in order)."""
        if not self._outbuf:
            return
        data = b"".join(self._outbuf)
        self._outbuf.clear()
        self._outbuf_bytes = 0
        self.broker.stats.bytes_out += len(data)
        try:
            sent = os.write(self._fd, data)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._write_failed = True
            self._cancel.cancel()
            return
        if sent < len(data) and self._nursery is not None:
            self._pending.append(data[sent:])
            self._pending_bytes += len(data) - sent
            self._writing = True  # from now on: others queue behind these bytes
            self._nursery.start_soon(self._write_pending)

    async def flush_out(self) -> None:
        """Write what buffered pushes collected (a shared group's batch)."""
        if self.alive:
            await self._flush_out()

    async def _flush_out(self) -> None:
        if self._outbuf:
            data = b"".join(self._outbuf)
            self._outbuf.clear()
            self._outbuf_bytes = 0
            await self.send(data)

    def has_window(self) -> bool:
        s = self.session
        return self.alive and s is not None and len(s.outgoing) < self._window_limit()

    def _window_limit(self) -> int:
        return min(self.receive_maximum, self.config.max_inflight)

    async def push_shared(self, group: SharedGroup, msg: Message, buffered: bool = False
                          ) -> bool:
        """Deliver a message of a shared subscription this client is a member of.
        `buffered`: collected for one write; the group calls `flush_out` after its batch."""
        s = self.session
        if s is None or not self.alive:
            return False
        sub = s.subscriptions.get(group.name)
        if sub is None:
            return False
        qos = min(msg.qos, sub.options.qos)
        sids = [sub.subscription_id] if sub.subscription_id and self.version == 5 else None
        offset = msg.offset_in(group.queue)
        if self._check_delivery and not self._may("SUB", msg.topic) \
                or self._ask_hook and await self._hook_refuses(msg.topic):
            group.acked(offset)  # not for this member's user: dropped, logged in audit
            return True
        sent = await self._push(msg, qos, False, sids, None, offset, group, buffered)
        if qos == 0 or not sent:
            group.acked(offset)  # at most once: done when written (or dropped)
        return True

    async def _push(
        self,
        msg: Message,
        qos: int,
        retain: bool,
        sids: list[int] | None,
        queue: str | None,
        offset: int,
        group: SharedGroup | None = None,
        buffered: bool = False,
    ) -> bool:
        """Send one message at `qos`, within the in-flight window; False if dropped.
        `buffered`: collect it for the caller's `_flush_out` (one write per batch)."""
        s = self.session
        assert s is not None
        if qos:
            if len(s.outgoing) >= self._window_limit():
                await self._flush_out()  # what is buffered may be what frees the window
            await self._wait_window()
        staged = self._stage(msg, qos, retain, sids, queue, offset, group, buffered)
        if staged is None:
            return False
        data, o = staged
        if o is not None and group is None:
            await self.broker.persist_outgoing(s, o)  # persistent sessions only
        if not buffered:
            await self.send(data)
        elif self._outbuf_bytes >= OUT_CHUNK:
            await self._flush_out()
        return True

    def _stage(self, msg: Message, qos: int, retain: bool, sids: list[int] | None,
               queue: str | None, offset: int, group: SharedGroup | None = None,
               buffered: bool = True) -> tuple[bytes, Outgoing | None] | None:
        """Encode one delivery and take its packet id and in-flight slot (the window
        has room: the caller made sure); `buffered`: into the write buffer. None when
        the message is dropped."""
        s = self.session
        assert s is not None
        pid = s.allocate_packet_id() if qos else None
        data = self._encode(msg, pid, qos, retain, sids, queue)
        if data is None:
            return None
        o = None
        if qos:
            assert pid is not None
            o = Outgoing(pid, queue, offset, data, qos, group=group, message=msg,
                         version=self.version)
            s.outgoing[pid] = o
        if buffered:
            self._outbuf.append(data)
            self._outbuf_bytes += len(data)
        stats = self.broker.stats
        stats.messages_out += 1
        stats.messages_out_qos[qos] += 1
        return data, o

    def _encode(self, msg: Message, pid: int | None, qos: int, retain: bool,
                sids: list[int] | None, queue: str | None = None) -> bytes | None:
        """The PUBLISH bytes for this client, or None when the message must be dropped.
        A message that cannot be encoded (stored by an older version or a bug) is
        dropped and logged: one bad message must not end every delivery loop."""
        try:
            return self._encode_for_client(msg, pid, qos, retain, sids, queue)
        except Exception as exc:  # noqa: BLE001 - whatever the message, not the loop
            self.broker.stats.dropped += 1
            log.error("message %s on %r cannot be sent to %s and is dropped: %s",
                      msg.msg_id, msg.topic, self.peer, exc)
            return None

    def _encode_for_client(self, msg: Message, pid: int | None, qos: int, retain: bool,
                           sids: list[int] | None, queue: str | None) -> bytes | None:
        v = self.version
        props = None
        if v == 5:
            expiry = msg.properties.get("message_expiry_interval")
            if expiry is not None:
                left = expiry - int(time.time() - msg.store_ts / 1000)
                if left <= 0:
                    self.broker.stats.expired += 1
                    return None  # expired messages are not delivered
                props = dict(publish_properties(msg.properties), message_expiry_interval=left)
            elif self._alias_out_max:
                props = dict(publish_properties(msg.properties))
        if props is None:
            if queue is not None and len(self.broker.queue_subs.get(queue, ())) == 1:
                # This session is the queue's only reader here: a template (encoded once,
                # stamped per subscriber) would be made for one use and cost 5x as much.
                if msg.qos not in (0, 1, 2):  # as the template checks: a bad record
                    raise ValueError(f"stored message has QoS {msg.qos}")
                return self._fits(msg, mqtt.encode_publish(
                    msg.topic, msg.body, qos, retain, False, pid, v,
                    _publish_props(msg, sids) if v == 5 else None))
            return self._fits(msg, self.broker.template(msg).for_subscriber(
                pid, False, version=v, qos=qos, retain=retain, subscription_ids=sids))
        topic, new_alias = msg.topic, False
        if self._alias_out_max:
            # On QoS 1/2 too: what is in flight when this connection ends loses its alias
            # (_close), as a resend on another connection must carry the topic name.
            if self._aliases_out is None:
                self._aliases_out = {}
            alias = self._aliases_out.get(topic)
            if alias is None and len(self._aliases_out) < self._alias_out_max:
                alias = self._aliases_out[topic] = len(self._aliases_out) + 1
                props["topic_alias"] = alias  # first use: topic and alias together
                new_alias = True
            elif alias is not None:
                props["topic_alias"] = alias
                topic = ""  # later uses: the alias alone
        if sids:
            props["subscription_identifier"] = sids
        data = self._fits(msg, mqtt.encode_publish(topic, msg.body, qos, retain, False, pid,
                                                   v, props))
        if data is None and new_alias:
            # The client never sees the packet that would have told it this alias.
            assert self._aliases_out is not None
            del self._aliases_out[msg.topic]
        return data

    def _fits(self, msg: Message, data: bytes) -> bytes | None:
        if len(data) > self.client_max_packet:
            # MQTT 5 §3.1.2.11.4: discard as if sent; the client asked for nothing larger.
            self.broker.stats.dropped += 1
            log.info("message on %r (%d bytes) dropped for %r: above its maximum packet "
                     "size %d", msg.topic, len(data), self.peer, self.client_max_packet)
            return None
        return data

    async def _wait_window(self) -> None:
        s = self.session
        assert s is not None
        while len(s.outgoing) >= self._window_limit():
            await self._window_wait()

    async def _window_wait(self) -> None:
        """Until an in-flight slot frees up."""
        if self._window is None or self._window.is_set():  # one for every waiter
            self._window = trio.Event()
        await self._window.wait()


def _only_reader(s: Session, queue: str) -> list[Subscription] | None:
    """The common case, one subscription: a message of its queue matches it by
    construction, no trie walk needed."""
    if len(s.subscriptions) != 1:
        return None
    sub = next(iter(s.subscriptions.values()))
    return [sub] if sub.shared is None and sub.topic_filter == queue else None


def _publish_props(msg: Message, sids: list[int] | None) -> dict[str, Any] | None:
    """A stored message's properties for a v5 PUBLISH, with this subscriber's ids."""
    props = publish_properties(msg.properties)
    if sids:
        props = dict(props, subscription_identifier=sids)
    return props or None


def _unalias_outgoing(s: Session) -> None:
    """The Topic Alias mapping belongs to one network connection (MQTT 5 §3.3.2.3.4):
    what this one sent and may be resent on the next carries its topic name instead."""
    for o in s.outgoing.values():
        if o.version == 5 and o.message is not None and o.state == "publish":
            [p] = mqtt.Decoder(server=False, version=5).feed(o.data)
            if "topic_alias" in p.properties:
                props = {k: v for k, v in p.properties.items() if k != "topic_alias"}
                o.data = mqtt.encode(Publish(o.message.topic, p.payload, p.qos, p.retain,
                                             False, p.packet_id, props), 5)


def _with_dup(data: bytes) -> bytes:
    return bytes([data[0] | 0x08]) + data[1:]


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
