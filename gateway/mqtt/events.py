"""What the MQTT rules of a connection (protocol.py) take and give: the server's limits,
a QoS 1/2 send in flight (`Outgoing`), what the rules need of the session and of a stored
message, and the events the driver is asked to act on. Values only: the rules are in
protocol.py (with handshake.py and outbound.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from .packets import Auth, Connect, Publish, Subscribe, Unsubscribe
from .reason import ProtocolError

NEVER_EXPIRES = 0xFFFFFFFF
MAX_PACKET = 268_435_455  # the largest Remaining Length the encoding allows
REASON_OVERHEAD = 16  # fixed header, packet id, reason code, property lengths
ALIAS = "topic_alias"
# A connection's phases: before its CONNECT, negotiating it, connected, ended.
AWAIT_CONNECT, CONNECTING, CONNECTED, CLOSED = range(4)


class Closing(Exception):
    """End this connection; `will` says whether the will message goes out,
    `reason_code` what a v5 client is told (DISCONNECT), with `properties` (a Server
    Reference, say) where they fit; `internal` that it is a server bug, not anything the
    client did."""

    def __init__(self, why: str, will: bool = True, reason_code: int | None = None,
                 properties: dict[str, Any] | None = None) -> None:
        super().__init__(why)
        self.will = will
        self.reason_code = reason_code
        self.properties = properties or {}
        self.internal = False


class Refused(Closing):
    """A CONNECT turned down, before any session (so no will): the client has been told
    (a CONNACK return code) when it could be."""

    def __init__(self, why: str) -> None:
        super().__init__(why, will=False)


@dataclass(frozen=True, slots=True)
class Limits:
    """The server's settings the rules need (gateway.broker.GatewayConfig has them)."""

    max_packet_size: int = MAX_PACKET
    max_connect_packet: int = 64 * 1024  # until the client is authenticated
    max_qos: int = 2
    topic_alias_maximum: int = 0  # aliases a client may set (ours for it)
    max_inflight: int = 32  # our sends unacknowledged per client, at most
    receive_maximum: int = 64  # the client's QoS 1/2 publishes unacknowledged, at most
    max_keepalive: int = 0  # 0: the client's own; else at most this (v5: Server Keep Alive)
    connect_timeout: float = 10.0  # from the connection to its CONNECT
    v3_session_expiry: int = NEVER_EXPIRES  # a persistent 3.1.1 session's expiry


@dataclass(slots=True)
class Outgoing:
    """A QoS 1/2 PUBLISH sent and not yet completed."""

    packet_id: int
    queue: str | None  # None for retained messages sent on subscribe
    offset: int
    data: bytes  # the encoded PUBLISH without DUP (resent with DUP on reconnect)
    qos: int
    state: str = "publish"  # "publish": awaiting PUBACK/PUBREC; "pubrel": awaiting PUBCOMP
    group: Handout | None = None  # the shared group it was handed out by, if any
    message: Stored | None = None  # to re-encode for a new connection, or hand back
    version: int = 4  # protocol version `data` was encoded for


class Flows(Protocol):
    """What the rules keep in the session, so that it survives this connection."""

    client_id: str
    persistent: bool
    expiry: int
    next_packet_id: int

    @property
    def outgoing(self) -> dict[int, Outgoing]: ...

    def in_flight(self) -> int:
        """How many `outgoing` holds (without making it, where it is made on first use)."""

    @property
    def incoming_qos2(self) -> set[int]: ...


class Stored(Protocol):
    """A stored message as delivery needs it (store.record.Message)."""

    topic: str
    body: bytes
    qos: int
    properties: dict[str, Any]
    store_ts: int


class Handout(Protocol):
    """Who handed a message out to this one member (gateway.shared.SharedGroup): told
    when it is done, or given it back."""

    def acked(self, offset: int) -> None: ...

    def take_back(self, msg: Stored) -> None: ...


# -- events: what the driver is asked to do ---------------------------------------------
@dataclass(slots=True)
class ConnectReceived:
    """Admit (limits, authentication, the will's rights) and open the session, then
    `accept` or `refuse`. `client_id` is "" when the server must assign one."""

    packet: Connect
    client_id: str
    expiry: int
    auth_method: str | None
    assigned: bool = False  # the driver assigned `client_id` (CONNACK tells the client)


@dataclass(slots=True)
class AuthReceived:
    """An AUTH of the enhanced exchange (at CONNECT, or a re-authentication): hand its
    data to the method, then `auth_continue` or `auth_done`."""

    packet: Auth
    reauth: bool


@dataclass(slots=True)
class PublishReceived:
    """A PUBLISH that passed the protocol's checks: decide it (rights, limits), store it
    and call `publish_done`, or refuse it with `publish_done` and a code."""

    packet: Publish
    topic: str  # with its alias resolved
    ticket: int  # the place of its ack among this client's answers (-1: QoS 0)


@dataclass(slots=True)
class PubrelReceived:
    """A PUBREL for a QoS 2 publish the session holds: forget the packet id (persistent
    sessions: in the store), then `release_done`."""

    packet_id: int
    ticket: int


@dataclass(slots=True)
class OutgoingDone:
    """The client completed one of our QoS 1/2 sends (PUBACK, PUBCOMP, or a v5 PUBREC
    refusing it): its window slot is free."""

    outgoing: Outgoing


@dataclass(slots=True)
class OutgoingReleased:
    """PUBREC for one of our QoS 2 sends, now awaiting PUBCOMP. `held`: a persistent
    session's, whose PUBREL waits for the owner to keep that state in the store and
    call `release` (else the PUBREL went out)."""

    outgoing: Outgoing
    held: bool = False


@dataclass(slots=True)
class SubscribeReceived:
    packet: Subscribe
    subscription_id: int | None
    ticket: int


@dataclass(slots=True)
class UnsubscribeReceived:
    packet: Unsubscribe
    ticket: int


@dataclass(slots=True)
class Closed:
    """The connection ends, after the events before this one (a DISCONNECT, a
    protocol error): `closing` says why and whether the will goes."""

    closing: Closing


@dataclass(slots=True)
class DecodeError:
    """The bytes after the packets before this one are malformed: once those are
    answered, `protocol_error` says how the connection ends."""

    error: ProtocolError


Event = (ConnectReceived | AuthReceived | PublishReceived | PubrelReceived | OutgoingDone
         | OutgoingReleased | SubscribeReceived | UnsubscribeReceived | Closed | DecodeError)
