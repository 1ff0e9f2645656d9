"""The MQTT rules of one client connection, sans-IO, as h11 is for HTTP: no socket, no
task, no clock of its own. Bytes go in with `receive(data, now)`; what the client is to
be sent collects in an outbox (`data_to_send`); what the rules cannot decide alone comes
out as events for the driver (gateway.connection), whose answers come back in as method
calls: `accept`/`refuse` a CONNECT, `publish_done` once the store has a publish,
`subscribed` with the granted codes, `deliver` a stored message.

What lives here: CONNECT negotiation (versions, session expiry, keepalive and the
server's override, Receive Maximum both ways, Maximum Packet Size, topic aliases both
ways, problem information), the enhanced authentication exchange's packets, inbound QoS
1/2 flows (acks in arrival order, our Receive Maximum, QoS 2 packet ids), outbound
flows (packet ids, the client's window, PUBREC/PUBREL/PUBCOMP, resends with DUP), the
encoding of a delivery for this client (expiry, aliases, subscription identifiers,
Maximum Packet Size), the keepalive and connect deadlines, and how a connection ends
(DISCONNECT and its reason code, CONNACK refusals, reason strings within the client's
limits). What does not: who may do what (ACL), sessions and subscriptions in the store,
retained messages, wills: those are the broker's (gateway.broker).

The rules of the state machine are in this class; two parts of it have files of their
own, mixed in: how a connection begins (handshake.py: CONNECT, CONNACK, AUTH) and what
it sends of its own accord (outbound.py: deliveries, packet ids, the client's window,
acks of our sends, resends). The values they take and give (the limits, `Outgoing`,
the events) are in events.py, and are found here too."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from . import reason as rc
from .codec import Decoder, encode
from .events import (
    ALIAS,
    AWAIT_CONNECT,
    CLOSED,
    CONNECTED,
    CONNECTING,
    MAX_PACKET,
    NEVER_EXPIRES,
    REASON_OVERHEAD,
    AuthReceived,
    Closed,
    Closing,
    ConnectReceived,
    DecodeError,
    Event,
    Flows,
    Handout,
    Limits,
    Outgoing,
    OutgoingDone,
    OutgoingReleased,
    PublishReceived,
    PubrelReceived,
    Refused,
    Stored,
    SubscribeReceived,
    UnsubscribeReceived,
)
from .handback import NEVER, Handback
from .handshake import Handshake
from .outbound import Outbound
from .packets import (
    Auth,
    Connack,
    Connect,
    Disconnect,
    Packet,
    Pingreq,
    Pingresp,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    Unsuback,
    Unsubscribe,
)
from .reason import ProtocolError, UnsupportedProtocolError


@dataclass(slots=True)
class _Answer:
    """One place in the ordered stream of answers to the client's packets."""

    data: bytes | None = None  # None until decided
    after: list[bytes] | None = None  # deliveries that must follow it (retained)


class MqttProtocol(Handshake, Outbound, Handback):
    """One connection's MQTT state. Not thread-safe; one driver calls it."""

    __slots__ = (
        "limits", "decoder", "phase", "version", "bridge", "keepalive", "client_id",
        "flows", "receive_maximum", "client_max_packet", "problem_info", "alias_out_max",
        "_aliases_in", "_aliases_out", "_out", "_out_bytes", "_answers", "_next_ticket",
        "_inbound_unacked", "_inbound_qos2", "_held", "deadline", "_read_at",
        "auth_method", "_reauth", "expires_at", "closed_by", "exchanging", "connect_id",
    )

    def __init__(self, limits: Limits, now: float) -> None:
        self.limits = limits
        self.decoder = Decoder(max_packet_size=limits.max_packet_size,
                               first_packet_max=limits.max_connect_packet)
        self.phase = AWAIT_CONNECT
        self.version = 4
        self.bridge = False
        self.keepalive = 0
        self.client_id = ""
        self.flows: Flows | None = None  # the session's, once accepted
        self.receive_maximum = limits.max_inflight  # the client's, for our sends
        self.client_max_packet = MAX_PACKET
        self.problem_info = True
        self.alias_out_max = 0
        self._aliases_in: dict[int, str] | None = None
        self._aliases_out: dict[str, int] | None = None
        self._out: list[bytes] = []
        self._out_bytes = 0
        # Answers (acks, SUBACKs, ...) in the order of the packets they answer; a
        # publish's ack waits for the store, and those after it wait behind it.
        self._answers: deque[_Answer] | None = None
        self._next_ticket = 0  # ticket of _answers[0]
        # Inbound QoS 1/2 publishes counted against our Receive Maximum (MQTT 5 §4.9): a
        # QoS 1 until its PUBACK, a QoS 2 until its PUBCOMP (ids in _inbound_qos2).
        self._inbound_unacked = 0
        self._inbound_qos2: set[int] | None = None
        self._held: list[Packet] | None = None  # read behind a CONNECT not yet accepted
        self.deadline = now + limits.connect_timeout  # the next timer (see `timeout`)
        self._read_at = now
        self.auth_method: str | None = None
        self._reauth = False
        self.exchanging = False  # an enhanced authentication exchange before CONNACK
        self.connect_id: str | None = None  # the CONNECT's client id, once one is read
        self.expires_at: float | None = None  # the credentials' end (a token's exp)
        self.closed_by: Closing | None = None

    # -- output ------------------------------------------------------------------------
    def data_to_send(self) -> bytes:
        """Everything the client is to be sent, in order; empties the outbox."""
        out = self._out
        if not out:
            return b""
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        self._out_bytes = 0
        return data

    @property
    def pending_output(self) -> int:
        return self._out_bytes

    @property
    def pending_packets(self) -> int:
        """Packets in the outbox (each one is sent alone into it)."""
        return len(self._out)

    def _send(self, data: bytes) -> None:
        self._out.append(data)
        self._out_bytes += len(data)

    def reason(self, text: str) -> dict[str, Any]:
        """A reason string, unless the client asked for no problem information, cut to
        what keeps the packet within the client's Maximum Packet Size, and left out if
        nothing useful fits [MQTT-3.2.2-19, 3.4.2-2, 3.5.2-2, 3.14.2-3]."""
        if not self.problem_info or self.version != 5:
            return {}
        room = max(0, min(200, self.client_max_packet - REASON_OVERHEAD))
        data = text.encode()[:room].decode("utf-8", "ignore")
        return {"reason_string": data} if len(data) >= 8 else {}

    # -- input -------------------------------------------------------------------------
    def receive(self, data: bytes, now: float) -> list[Event]:
        """Feed bytes read from the client. Raises Closing (Refused before a session)
        when the connection must end; what the client must be told first is in the
        outbox already."""
        if self.closed_by is not None:
            return []  # nothing more is read from a connection that is ending
        self._read_at = now
        if self.phase == CONNECTED:
            self._arm()
        dec = self.decoder
        if dec.error is not None:  # after the packets that came before it
            raise self._protocol_closing(dec.error)
        try:
            packets = dec.feed(data)
        except UnsupportedProtocolError as exc:
            code = rc.UNSUPPORTED_PROTOCOL_VERSION if exc.protocol_level == 5 \
                else exc.v3_return_code
            self._send(encode(Connack(False, code), 5 if code > 5 else 4))
            raise Refused(exc.message) from exc
        except ProtocolError as exc:
            if not exc.packets:
                raise self._protocol_closing(exc) from None
            # The packets before the bad one are handled first (a CONNECT too), then the
            # error: `protocol_error` decides it when its turn comes.
            events = self.handle(exc.packets, now)
            if self.closed_by is None:
                events.append(DecodeError(exc))
            return events
        return self.handle(packets, now) if packets else []

    def protocol_error(self, exc: ProtocolError) -> Closing:
        """A malformed or forbidden packet after the ones handled before it: how the
        connection ends (a v5 CONNACK with the code if still before CONNACK)."""
        self.closed_by = closing = self._protocol_closing(exc)
        return closing

    def _protocol_closing(self, exc: ProtocolError) -> Closing:
        if self.phase < CONNECTED and (self.decoder.version or self.decoder.connect_level) == 5:
            # MQTT 5 §3.2.2.2, §4.13.1: a bad CONNECT gets a CONNACK with the reason code
            # before the close (3.1.1 has no code for these).
            code = exc.reason_code if exc.reason_code in rc.CONNACK_REASONS \
                else rc.MALFORMED_PACKET  # e.g. 0x8F has no place in a CONNACK
            self.version = 5
            self._send(encode(Connack(False, code, self.reason(exc.message)), 5))
            return Refused(f"protocol error: {exc.message}")
        if self.phase < CONNECTED:
            return Refused(f"protocol error: {exc.message}")
        return Closing(f"protocol error: {exc.message}", True, exc.reason_code)

    def handle(self, packets: list[Packet], now: float) -> list[Event]:
        """Decoded packets (the fuzzer and tests may feed these directly). A packet that
        ends the connection ends the list with Closed; those before it stand."""
        events: list[Event] = []
        for i, p in enumerate(packets):
            try:
                if self.phase == CONNECTED:
                    ev = self._dispatch(p)
                elif self.phase == AWAIT_CONNECT:
                    ev = self._on_connect(p, now)
                elif self.phase == CONNECTING and self.exchanging:
                    ev = self._in_exchange(p)
                elif self.phase == CONNECTING:
                    # held until the CONNECT is accepted
                    if self._held is None:
                        self._held = []
                    self._held.extend(packets[i:])
                    break
                else:
                    break
            except Closing as closing:
                self.closed_by = closing
                events.append(Closed(closing))
                break
            except ProtocolError as exc:
                self.closed_by = closing = self._protocol_closing(exc)
                events.append(Closed(closing))
                break
            if ev is not None:
                events.append(ev)
        return events

    # -- timers ------------------------------------------------------------------------
    def timeout(self, now: float) -> None:
        """Raise Closing if a deadline passed: the CONNECT's, the keepalive's (1.5 times
        the interval without a packet [MQTT-3.1.2-24]) or the credentials' expiry."""
        if now < self.deadline:
            return
        if self.phase != CONNECTED:
            raise Refused("no CONNECT in time")
        if self.expires_at is not None and now >= self.expires_at:
            # 0xA0: the time this connection was authorised for is over; a client
            # reconnects with fresh credentials (not 0x87: it did nothing wrong).
            raise Closing("credentials expired", True, rc.MAXIMUM_CONNECT_TIME)
        raise Closing("keepalive timeout", True, rc.KEEP_ALIVE_TIMEOUT)

    def set_expiry(self, expires_at: float | None) -> None:
        """The credentials stop being valid at `expires_at` (a token's exp)."""
        self.expires_at = expires_at
        self._arm()

    def _arm(self) -> None:
        ka = self._read_at + self.keepalive * 1.5 if self.keepalive else NEVER
        self.deadline = min(ka, self.expires_at if self.expires_at is not None else NEVER)

    # -- packets after CONNECT -----------------------------------------------------------
    def _dispatch(self, p: Packet) -> Event | None:
        t = type(p)
        if t is Publish:
            return self._on_publish(p)
        if t is Puback:
            return self._on_ack(p.packet_id, 1)
        if t is Pubcomp:
            return self._on_ack(p.packet_id, 2)
        if t is Pubrec:
            return self._on_pubrec(p)
        if t is Pubrel:
            return self._on_pubrel(p)
        if t is Pingreq:
            self._answer_now(encode(Pingresp(), self.version))
            return None
        if t is Subscribe:
            return self._on_subscribe(p)
        if t is Unsubscribe:
            return UnsubscribeReceived(p, self._ticket())
        if t is Disconnect:
            raise self._on_disconnect(p)
        if t is Auth:
            return self._on_auth(p)
        if t is Connect:
            raise ProtocolError(rc.PROTOCOL_ERROR, "second CONNECT")
        raise ProtocolError(rc.PROTOCOL_ERROR, f"unexpected {t.__name__}")

    def _on_disconnect(self, p: Disconnect) -> Closing:
        s = self.flows
        if self.version == 5 and "session_expiry_interval" in p.properties:
            new = int(p.properties["session_expiry_interval"])
            if s.expiry == 0 and new:
                raise ProtocolError(rc.PROTOCOL_ERROR,
                                    "session expiry set on DISCONNECT after 0 on CONNECT")
            s.expiry = new
            s.persistent = new > 0
        return Closing("DISCONNECT", will=p.reason_code == rc.DISCONNECT_WITH_WILL_MESSAGE)

    # -- inbound publishes ---------------------------------------------------------------
    def _on_publish(self, p: Publish) -> PublishReceived | None:
        topic = p.topic
        if self.version == 5 and p.properties and ALIAS in p.properties:
            topic = self._resolve_alias(p)
        if p.qos > self.limits.max_qos:
            raise ProtocolError(rc.QOS_NOT_SUPPORTED, f"QoS {p.qos} not supported")
        ticket = -1
        if p.qos:
            ticket = self._ticket()
            if p.qos == 2:
                if p.packet_id in self.flows.incoming_qos2:  # a duplicate: PUBREC again
                    self._decide(ticket, self._pubrec(p.packet_id, 0))
                    return None
                self.flows.incoming_qos2.add(p.packet_id)
            self._count_inbound(p)
        if p.properties and p.properties.get("payload_format_indicator") == 1 \
                and not _is_utf8(p.payload):  # §3.3.2.3.2
            if not p.qos:
                raise ProtocolError(rc.PAYLOAD_FORMAT_INVALID, "payload is not UTF-8")
            self.publish_done(p, ticket, rc.PAYLOAD_FORMAT_INVALID)
            return None
        return PublishReceived(p, topic, ticket)

    def _resolve_alias(self, p: Publish) -> str:
        alias = p.properties[ALIAS]
        if alias > self.limits.topic_alias_maximum:
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

    def _count_inbound(self, p: Publish) -> None:
        """One more QoS 1/2 publish unacknowledged; past our Receive Maximum, 0x93."""
        self._inbound_unacked += 1
        if p.qos == 2:
            if self._inbound_qos2 is None:
                self._inbound_qos2 = set()
            self._inbound_qos2.add(p.packet_id)
        if self.version == 5 and self._inbound_unacked > self.limits.receive_maximum:
            raise ProtocolError(rc.RECEIVE_MAXIMUM_EXCEEDED, "Receive Maximum exceeded")

    def held_qos2(self, p: Publish, ticket: int) -> None:
        """A QoS 2 resend the session stored before a restart (the driver found its
        record): held as received, PUBREC again, not stored twice."""
        self._decide(ticket, self._pubrec(p.packet_id, 0))

    def publish_done(self, p: Publish, ticket: int, code: int, text: str = "") -> None:
        """The publish at `ticket` was stored (code 0), or not (a reason code). 3.1.1 has
        no negative ack: the client gets a plain one (else it would resend forever).
        QoS 0 needs no answer. `text`: the reason string of a failure."""
        if ticket < 0:
            return
        told = code if self.version == 5 else 0
        props = self.reason(text or rc.REASON_NAMES.get(code, "")) if told else {}
        if p.qos == 1:
            self._inbound_unacked -= 1
            self._decide(ticket, encode(Puback(p.packet_id, told, props), self.version))
            return
        if code:  # not stored: no PUBREL will follow, the exchange ends here
            self._release_qos2(p.packet_id)
            self.flows.incoming_qos2.discard(p.packet_id)
        self._decide(ticket, encode(Pubrec(p.packet_id, told, props), self.version))

    def _pubrec(self, pid: int, code: int) -> bytes:
        return encode(Pubrec(pid, code), self.version)

    def _release_qos2(self, pid: int) -> None:
        """A QoS 2 exchange counted by _count_inbound has ended (PUBCOMP, or a failed
        PUBREC); a duplicate or a resumed exchange was never counted."""
        if self._inbound_qos2 is not None and pid in self._inbound_qos2:
            self._inbound_qos2.discard(pid)
            self._inbound_unacked -= 1

    def _on_pubrel(self, p: Pubrel) -> PubrelReceived | None:
        ticket = self._ticket()
        pid = p.packet_id
        if pid in self.flows.incoming_qos2:
            self.flows.incoming_qos2.discard(pid)
            self._release_qos2(pid)
            return PubrelReceived(pid, ticket)
        code = rc.PACKET_IDENTIFIER_NOT_FOUND if self.version == 5 else 0
        self._decide(ticket, encode(Pubcomp(pid, code), self.version))
        return None

    def release_done(self, packet_id: int, ticket: int) -> None:
        self._decide(ticket, encode(Pubcomp(packet_id), self.version))

    # -- answers in order ----------------------------------------------------------------
    def _ticket(self) -> int:
        if self._answers is None:
            self._answers = deque()
        self._answers.append(_Answer())
        return self._next_ticket + len(self._answers) - 1

    def _decide(self, ticket: int, data: bytes) -> None:
        answers = self._answers
        assert answers is not None
        answers[ticket - self._next_ticket].data = data
        while answers and answers[0].data is not None:
            a = answers.popleft()
            self._next_ticket += 1
            self._send(a.data)  # type: ignore[arg-type]
            if a.after:
                for d in a.after:
                    self._send(d)

    def _answer_now(self, data: bytes) -> None:
        """An answer that needs no decision, in its place among the others."""
        if not self._answers:
            self._send(data)
            return
        self._decide(self._ticket(), data)

    @property
    def answers_pending(self) -> int:
        return len(self._answers) if self._answers else 0

    # -- SUBSCRIBE / UNSUBSCRIBE -----------------------------------------------------------
    def _on_subscribe(self, p: Subscribe) -> SubscribeReceived:
        sid = None
        if self.version == 5:
            ids = p.properties.get("subscription_identifier")
            sid = ids[0] if isinstance(ids, list) and ids else ids
        for topic_filter, opts in p.subscriptions:
            if opts.no_local and topic_filter.startswith("$share/"):
                raise ProtocolError(rc.PROTOCOL_ERROR, "No Local on a shared subscription")
        return SubscribeReceived(p, sid, self._ticket())

    def subscribed(self, packet_id: int, ticket: int, codes: list[int],
                   then: list[bytes] | None = None, text: str = "",
                   user: list[tuple[str, str]] | None = None) -> None:
        """SUBACK with one code per filter (3.1.1: failures as 0x80); `then`: deliveries
        that must follow it (retained messages), already encoded by `deliver`. v5: `text`
        a reason string, `user` user properties, both left out when the client asked
        for no problem information or they would pass its Maximum Packet Size."""
        if self.version < 5:
            codes = [c if c < 0x80 else 0x80 for c in codes]
        props: dict[str, Any] = self.reason(text) if text else {}
        if user and self.version == 5 and self.problem_info:
            props["user_property"] = user
        data = encode(Suback(packet_id, codes, props), self.version)
        if props and len(data) > self.client_max_packet:
            data = encode(Suback(packet_id, codes), self.version)
        self._decide(ticket, data)
        if then:
            self._send(b"".join(then))

    def unsubscribed(self, packet_id: int, ticket: int, codes: list[int]) -> None:
        self._decide(ticket, encode(Unsuback(packet_id, codes), self.version))

    # -- the end ---------------------------------------------------------------------------
    def close(self, closing: Closing) -> bytes:
        """The last bytes for the client: DISCONNECT with the reason (v5, connected, not
        taken over, and a reason to tell)."""
        self.closed_by = closing
        was = self.phase
        self.phase = CLOSED
        if was == CONNECTED and closing.reason_code and self.version == 5:
            told = self.reason(str(closing))
            data = encode(Disconnect(closing.reason_code, {**told, **closing.properties}), 5)
            if closing.properties and len(data) > self.client_max_packet:
                data = encode(Disconnect(closing.reason_code, told), 5)
            return data
        return b""

    def taken_over(self) -> bytes:
        """Another connection claimed the client id: DISCONNECT 0x8E (v5)."""
        if self.phase == CONNECTED and self.version == 5:
            return encode(Disconnect(rc.SESSION_TAKEN_OVER), 5)
        return b""


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


__all__ = [
    "ALIAS", "AuthReceived", "Closed", "Closing", "ConnectReceived", "DecodeError", "Event",
    "Flows", "Handout", "Limits", "MAX_PACKET", "NEVER_EXPIRES", "Outgoing", "OutgoingDone",
    "OutgoingReleased", "PublishReceived", "PubrelReceived", "REASON_OVERHEAD", "Refused",
    "Stored", "SubscribeReceived", "UnsubscribeReceived", "MqttProtocol",
]
