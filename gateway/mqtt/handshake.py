"""How a connection begins, as part of the MQTT rules (gateway.mqtt.protocol): the
CONNECT's negotiation (version, session expiry, keepalive and the server's override,
Receive Maximum, Maximum Packet Size, topic aliases, problem information), the CONNACK
that accepts or refuses it, and the enhanced authentication exchange, at CONNECT and
again later (re-authentication, MQTT 5 section 4.12)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import reason as rc
from .codec import Decoder, encode
from .events import (
    CONNECTED,
    CONNECTING,
    MAX_PACKET,
    AuthReceived,
    ConnectReceived,
    Event,
    Flows,
    Limits,
    Refused,
)
from .packets import Auth, Connack, Connect, Disconnect, Packet
from .reason import ProtocolError


class Handshake:
    """The CONNECT and AUTH part of MqttProtocol (a mixin: the state it uses is the
    protocol's, declared here; `_send`, `reason`, `handle`, `_arm` and `_answer_now`
    are the protocol's too)."""

    __slots__ = ()

    limits: Limits
    decoder: Decoder
    phase: int
    version: int
    bridge: bool
    keepalive: int
    client_id: str
    connect_id: str | None
    flows: Flows | None
    receive_maximum: int
    client_max_packet: int
    problem_info: bool
    alias_out_max: int
    auth_method: str | None
    exchanging: bool
    deadline: float
    _read_at: float
    _reauth: bool
    _held: list[Packet] | None

    def _on_connect(self, p: Packet, now: float) -> ConnectReceived:
        if not isinstance(p, Connect):
            raise Refused("first packet is not CONNECT")
        self.version = v = p.protocol_level
        self.bridge = p.bridge
        self.connect_id = p.client_id
        props = p.properties
        method = None
        if v == 5:
            # Before any answer: each must fit [MQTT-3.2.2-19].
            self.client_max_packet = int(props.get("maximum_packet_size", MAX_PACKET))
            self.receive_maximum = int(props.get("receive_maximum", 65535))
            self.alias_out_max = int(props.get("topic_alias_maximum", 0))
            self.problem_info = bool(props.get("request_problem_information", 1))
            method = props.get("authentication_method")
            expiry = int(props.get("session_expiry_interval", 0))
        else:
            # 3.1.1 sessions never end by themselves; ours do, after the configured time.
            expiry = 0 if p.clean_start else self.limits.v3_session_expiry
        if not p.client_id and v < 5 and not p.clean_start:
            # 3.1.1: a zero-byte id needs CleanSession=1 (return code 2)
            self._send(encode(Connack(False, 2), v))
            raise Refused("empty client id with a persistent session")
        self.auth_method = method
        self.keepalive = p.keepalive
        self.phase = CONNECTING
        return ConnectReceived(p, p.client_id, expiry, method)

    def refuse(self, code5: int, code3: int | None, why: str,
               properties: dict[str, Any] | None = None) -> Refused:
        """A CONNACK refusing the CONNECT (3.1.1: `code3`, None for a plain close), with
        `properties` for v5 (a Server Reference) where they fit. The driver raises what
        this returns."""
        code = code5 if self.version == 5 else code3
        if code is not None:
            told = self.reason(why) if self.version == 5 else {}
            extra = properties or {} if self.version == 5 else {}
            data = encode(Connack(False, code, {**told, **extra}), self.version)
            if extra and len(data) > self.client_max_packet:
                data = encode(Connack(False, code, told), self.version)
            self._send(data)
        return Refused(why)

    def auth_continue(self, data: bytes | None, now: float | None = None) -> None:
        """The method needs another round of the exchange: AUTH 0x18 to the client
        (`now`: at CONNECT, the exchange gets the connect timeout from here)."""
        if self.phase == CONNECTING:
            self.exchanging = True
            if now is not None:
                self.deadline = now + self.limits.connect_timeout
        self._send(encode(self._auth(rc.CONTINUE_AUTHENTICATION, data), 5))

    def _in_exchange(self, p: Packet) -> AuthReceived:
        """A packet while the CONNECT's exchange runs: AUTH 0x18 with its method."""
        if isinstance(p, Disconnect):
            raise Refused("DISCONNECT during authentication")
        if (not isinstance(p, Auth) or p.reason_code != rc.CONTINUE_AUTHENTICATION
                or p.properties.get("authentication_method") != self.auth_method):
            raise self.refuse(rc.PROTOCOL_ERROR, 0, f"expected AUTH 0x18 for {self.auth_method}")
        self.exchanging = False  # until the method asks for another round
        return AuthReceived(p, False)

    def _auth(self, code: int, data: bytes | None) -> Auth:
        props: dict[str, Any] = {"authentication_method": self.auth_method}
        if data is not None:
            props["authentication_data"] = data
        return Auth(code, props)

    def authenticated(self) -> None:
        """The client is who it says: its packets may now be as large as
        --max-packet-size (before, --max-connect-packet bounds each)."""
        self.decoder.first_packet_max = None

    def accept(self, flows: Flows, client_id: str, present: bool, now: float,
               assigned: bool = False, auth_data: bytes | None = None) -> list[Event]:
        """The session is open: CONNACK, then the packets that came behind the CONNECT."""
        v = self.version
        self.flows, self.client_id, self.phase = flows, client_id, CONNECTED
        self.exchanging = False
        self.authenticated()
        connect_keepalive = self.keepalive
        max_ka = self.limits.max_keepalive
        server_keepalive = None
        if max_ka and (connect_keepalive == 0 or connect_keepalive > max_ka) and v == 5:
            self.keepalive = server_keepalive = max_ka
        self._read_at = now
        self._arm()
        props: dict[str, Any] = {}
        if v == 5:
            lim = self.limits
            props = {
                "receive_maximum": lim.receive_maximum,
                "maximum_packet_size": lim.max_packet_size,
                "retain_available": 1,
                "wildcard_subscription_available": 1,
                "shared_subscription_available": 1,
                "subscription_identifier_available": 1,
                "topic_alias_maximum": lim.topic_alias_maximum,
            }
            if lim.max_qos < 2:
                props["maximum_qos"] = lim.max_qos
            if assigned:
                props["assigned_client_identifier"] = client_id
            if server_keepalive is not None:
                props["server_keep_alive"] = server_keepalive
            if self.auth_method is not None:
                props["authentication_method"] = self.auth_method
                if auth_data is not None:
                    props["authentication_data"] = auth_data
        self._send(encode(Connack(present, 0, props), v))
        held, self._held = self._held, None
        return self.handle(held, now) if held else []

    def _on_auth(self, p: Auth) -> AuthReceived:
        """Re-authentication (§4.12.1): AUTH 0x19 with the CONNECT's method, then the
        same exchange; `auth_done` answers it."""
        method = self.auth_method
        if method is None:
            raise ProtocolError(rc.PROTOCOL_ERROR, "AUTH without an authentication method")
        if p.properties.get("authentication_method") != method:
            raise ProtocolError(rc.PROTOCOL_ERROR, f"AUTH with a method other than {method}")
        if p.reason_code == rc.RE_AUTHENTICATE:
            self._reauth = True
        elif p.reason_code != rc.CONTINUE_AUTHENTICATION or not self._reauth:
            raise ProtocolError(rc.PROTOCOL_ERROR, f"unexpected AUTH 0x{p.reason_code:02X}")
        return AuthReceived(p, True)

    def reauth_done(self, data: bytes | None) -> None:
        """A re-authentication succeeded: AUTH 0x00 (a failure is a Closing, 0x87)."""
        self._reauth = False
        self._answer_now(encode(self._auth(rc.SUCCESS, data), 5))

    if TYPE_CHECKING:  # the protocol's own (gateway.mqtt.protocol.MqttProtocol)
        def _send(self, data: bytes) -> None: ...

        def reason(self, text: str) -> dict[str, Any]: ...

        def handle(self, packets: list[Packet], now: float) -> list[Event]: ...

        def _arm(self) -> None: ...

        def _answer_now(self, data: bytes) -> None: ...
