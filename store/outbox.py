"""A native connection's answers on their way out, within a byte budget.

The server answers a connection's requests concurrently, and an answer can be large (a
HISTORY batch up to 16 MiB). A client that sends requests and reads none of the answers
would have them all held in the server: 64 in flight and 256 queued were 5 GiB on one
connection. So every answer counts against the connection's budget from the moment it
is being read from the store until its last byte is written to the socket:

- a request that reads messages first reserves what its answer may hold (`reserve`),
  waiting while the connection's answers hold too much; one answer alone may always go,
  however large (it then waits until nothing else is held);
- every answer counts from when it is queued (`send`) until written (`written`);
- the connection reads no new request while its answers hold the budget (`wait_room`).

So a connection holds about its budget plus one answer, and the answers of small
requests (stats, appends' acknowledgements) that were under way when it filled up.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio


@dataclass
class OutboxStats:
    """Over every connection of a server: for /metrics."""

    limit: int  # per connection (0: none)
    held: int = 0
    peak: int = 0  # the most one connection held
    paused: int = 0  # times a connection's reading or a request waited for room

    def stats(self) -> dict[str, int]:
        return {"held": self.held, "limit": self.limit, "peak": self.peak,
                "paused": self.paused}


class Outbox:
    def __init__(self, channel: Any, stats: OutboxStats) -> None:
        self._channel = channel  # the writer task's memory channel (send side)
        self.limit = stats.limit  # 0: no budget
        self.held = 0
        self.stats = stats
        self._lot = trio.lowlevel.ParkingLot()
        self._closed = False

    def _add(self, n: int) -> None:
        self.held += n
        self.stats.held += n
        if n > 0:
            self.stats.peak = max(self.stats.peak, self.held)
        else:
            self._lot.unpark_all()

    def _fits(self, n: int) -> bool:
        return not self.limit or not self.held or self.held + n <= self.limit

    async def send(self, data: bytes) -> None:
        """Queue an answer for the writer; it counts until `written`."""
        self._add(len(data))
        await self._channel.send(data)

    def send_nowait(self, data: bytes) -> bool:
        """`send` from synchronous code: False, nothing queued, when the writer's
        channel is full (then `send`)."""
        if self._closed:  # the connection ended: nothing to write to (dropped)
            return True
        try:
            self._channel.send_nowait(data)
        except trio.WouldBlock:
            return False
        self._add(len(data))
        return True

    def written(self, n: int) -> None:
        """The writer wrote `n` bytes of answers to the socket."""
        self._add(-n)

    async def wait_room(self) -> None:
        """Return once the answers hold less than the budget (before reading a request)."""
        if self.limit and self.held >= self.limit:
            self.stats.paused += 1
            while self.held >= self.limit:
                await self._lot.park()

    @asynccontextmanager
    async def reserve(self, n: int) -> AsyncIterator[int]:
        """Hold `n` bytes for an answer being read; the caller keeps its answer within
        them. Released on exit: the answer, queued with `send` before any other await,
        counts from there."""
        if not self._fits(n):
            self.stats.paused += 1
            while not self._fits(n):
                await self._lot.park()
        self._add(n)
        try:
            yield n
        finally:
            self._add(-n)

    def close(self) -> None:
        """The connection is gone: what it held is not held any more."""
        self.stats.held -= self.held
        self.held = 0
        self._closed = True
