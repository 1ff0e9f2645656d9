"""What a connection may have waiting for its socket, and how fast the client must take
it: one rule for every transport (the reactor's plain TCP sockets, TLS and WebSocket
streams), sans-IO, so that another data plane can keep to the same.

- **High-water mark** (--max-unsent-bytes): past it the connection is not read, and
  nothing is delivered to it, until what waits is down to the low-water mark (a
  quarter of it). Every answer is to something read, so a client that does not read
  what it asked for cannot make the server hold more than the mark plus the answers
  to one read. What waits counts its bytes plus PACKET_COST per packet: an answer
  costs the server more than its bytes (a PINGRESP is two), and a client must not make
  it answer a million before it stops reading.
- **Drain rate** (--min-drain-bytes per --write-timeout): while bytes wait, the client
  must take `min_drain` of them (all of them, if fewer wait) within `timeout`, then the
  next as many within the next `timeout`, and so on. A client that takes a byte now and
  then is as stuck as one that takes none, and is disconnected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

PACKET_COST = 64  # what a packet waiting for the socket counts beyond its bytes


class Settings(Protocol):
    """Where the rule's numbers come from (gateway.config.GatewayConfig)."""

    max_unsent_bytes: int
    min_drain_bytes: int
    write_timeout: float


@dataclass(frozen=True, slots=True)
class WriteRules:
    high: int  # bytes waiting past which the connection is not read
    low: int  # ... until they are down to this
    min_drain: int  # bytes the client must take per `timeout` while some wait
    timeout: float

    @classmethod
    def of(cls, cfg: Settings) -> WriteRules:
        high = cfg.max_unsent_bytes
        return cls(high, high // 4, max(1, cfg.min_drain_bytes), cfg.write_timeout)

    def full(self, waiting: int, packets: int) -> bool:
        """Stop reading (and delivering): too much waits (bytes, and packets)."""
        return waiting + PACKET_COST * packets > self.high

    def room(self, waiting: int, packets: int) -> bool:
        """Read again (after `full`)."""
        return waiting + PACKET_COST * packets <= self.low

    def due(self, waiting: int) -> int:
        """Bytes the client must take within the next `timeout`."""
        return min(self.min_drain, waiting)
