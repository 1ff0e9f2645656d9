"""What the native plane needs of a connection's rules when it takes the connection
over after CONNACK and hands it back (gateway.handover): whether the rules are quiet
enough to be carried elsewhere, the state it goes on from, and the state it returns.
A mixin of MqttProtocol: the state is the protocol's, declared here."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from .codec import Decoder
from .events import CONNECTED, Flows, Limits, Outgoing

NEVER = float("inf")  # no deadline (one object, not a float for each idle connection)
# The most of a partial packet the native side takes over with a connection (it holds
# up to 64 KiB of one before it hands the connection back).
HANDOVER_PARTIAL = 16 * 1024


class Handback:
    __slots__ = ()

    limits: Limits
    version: int
    deadline: float
    decoder: Decoder
    phase: int
    flows: Flows | None
    closed_by: object
    expires_at: float | None
    exchanging: bool
    _reauth: bool
    _answers: deque[object] | None
    _inbound_unacked: int
    _inbound_qos2: set[int] | None
    _out: list[bytes]
    _aliases_in: dict[int, str] | None
    _read_at: float

    if TYPE_CHECKING:
        def _arm(self) -> None: ...  # the protocol's

    def quiet(self) -> bool:
        """Connected with nothing under way: no answer owed, no inbound QoS 1/2 counted,
        nothing in flight or in the outbox, no more of a partial packet than the native
        side takes over (`handed_over`), no credentials' end."""
        return (self.settles() and not self._answers and not self._inbound_unacked
                and not self._out and self.decoder.buffered <= HANDOVER_PARTIAL)

    def settles(self) -> bool:
        """Whether `quiet` comes without reading more: what keeps it from quiet (answers
        owed, QoS 1 publishes being stored) finishes on its own. Not so for a QoS 2
        exchange, a delivery in flight, an AUTH exchange or credentials that end."""
        return (self.phase == CONNECTED and self.closed_by is None and not self._inbound_qos2
                and self.flows is not None and not self.flows.in_flight()
                and self.expires_at is None and not self._reauth and not self.exchanging)

    def handed_over(self, now: float) -> tuple[dict[int, str], float, bytes, int]:
        """What the native side goes on from: the inbound topic aliases, seconds idle,
        the start of a packet read here (taken from the decoder: `handed_back_unread`
        gives it back should the native side not take the connection), and the QoS 1
        publishes read before it and not acknowledged (none, once `quiet`)."""
        return (dict(self._aliases_in or {}), max(0.0, now - self._read_at),
                self.decoder.take_buffered(), self._inbound_unacked)

    def handed_back_unread(self, unread: bytes) -> None:
        """The native side did not take the connection: the partial packet is ours."""
        if unread:
            self.decoder.feed(unread)

    def park(self) -> None:
        """The native side took the connection (after `handed_over`): what only reading
        and writing here use, the decoder and the outbox, and the state it took (the
        aliases, the keepalive's clock) are let go until `handed_back` (idle devices are
        most of a gateway's connections, and most of them are carried there)."""
        self.decoder = None  # type: ignore[assignment]
        self._out = None  # type: ignore[assignment]
        self._aliases_in = None
        self._read_at = self.deadline = NEVER  # no timer here: the engine's

    def handed_back(self, now: float, idle_for: float, next_packet_id: int,
                    aliases_in: dict[int, str], outgoing: list[Outgoing]) -> None:
        """The native side's state at its demotion: the keepalive's clock, packet ids,
        aliases, the QoS 1 sends it has in flight."""
        assert self.flows is not None
        if self.decoder is None:  # parked: CONNECT was decoded before, so the version
            # is known and the limit is the one after it
            self.decoder = Decoder(max_packet_size=self.limits.max_packet_size,
                                   version=self.version)
            self._out = []
        self._read_at = now - idle_for
        self._arm()
        self.flows.next_packet_id = next_packet_id
        self._aliases_in = aliases_in or None
        for o in outgoing:
            self.flows.outgoing[o.packet_id] = o

    @contextmanager
    def read_behind(self, unacked: int) -> Iterator[None]:
        """Bytes the native side handed back unread, read here behind `unacked` QoS 1
        publishes it had not acknowledged when it read them (their PUBACKs are out now):
        counted on top of those against our Receive Maximum, as a burst read here at
        once is counted [MQTT-3.3.4-7]."""
        self._inbound_unacked += unacked
        try:
            yield
        finally:
            self._inbound_unacked -= unacked
