"""A connection's one write path. Bytes go to the socket at once when it takes them (a
plain TCP socket is written directly, non-blocking); what it cannot take waits here, in
order, until it can: the reactor watches a TCP socket for writability, a TLS or
WebSocket stream gets a writer task for as long as something waits. A client that
takes nothing for --write-timeout is disconnected: its messages wait in the store,
not in the gateway's memory."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import trio

from gateway.stats import Stats


class Poller(Protocol):
    """The node's reactor as a connection sees it (gateway.reactor.Reactor): it reads
    and writes plain TCP sockets, one task for them all."""

    def want_write(self, conn: Owner) -> None: ...  # tell when the socket takes more

    def pause(self, conn: Owner) -> None: ...  # read no more until `resume`

    def resume(self, conn: Owner) -> None: ...

    def rearm(self, conn: Owner) -> None: ...  # its deadline moved

    def forget(self, conn: Owner) -> None: ...  # closed


class Owner(Protocol):
    """The connection the output belongs to (gateway.connection.Connection)."""

    reactor: Poller | None  # for a plain TCP socket

    def lost(self) -> None: ...  # the socket failed

    def drained(self) -> None: ...  # everything that waited went out

    def stuck(self) -> None: ...  # the client took nothing for the write timeout

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None: ...


class Output:
    __slots__ = ("owner", "fd", "stream", "write_timeout", "stats", "_waiting", "_bytes",
                 "_since", "_writer")

    def __init__(self, owner: Owner, fd: int, stream: trio.abc.Stream | None,
                 write_timeout: float, stats: Stats) -> None:
        self.owner = owner
        self.fd = fd  # a plain TCP socket (-1: none)
        self.stream = stream  # a trio stream (TLS, WebSocket), or None
        self.write_timeout = write_timeout
        self.stats = stats
        self._waiting: list[bytes] | None = None  # what the socket has not taken yet
        self._bytes = 0
        self._since = 0.0  # when it last made progress while something waits
        self._writer = False  # a writer task drains a stream's backlog

    @property
    def backlog(self) -> int:
        """Bytes written but not taken by the socket yet."""
        return self._bytes

    def write(self, data: bytes) -> None:
        if not data or (self.fd < 0 and self.stream is None):
            return
        self.stats.bytes_out += len(data)
        if self._waiting:  # behind what waits already
            self._waiting.append(data)
            self._bytes += len(data)
            return
        if self.fd >= 0:
            try:
                sent = os.write(self.fd, data)
            except BlockingIOError:
                sent = 0
            except OSError:
                self.owner.lost()
                return
            if sent == len(data):
                return
            data = data[sent:]
        self._waiting = [data]
        self._bytes = len(data)
        self._since = trio.current_time()
        if self.owner.reactor is not None:
            self.owner.reactor.want_write(self.owner)
        elif not self._writer:
            self._writer = True
            self.owner.spawn(self._drain_stream)

    def writable(self) -> bool:
        """The socket takes more (the reactor says): write what waits; True when all of
        it is out."""
        waiting = self._waiting
        if waiting:
            data = waiting[0] if len(waiting) == 1 else b"".join(waiting)
            try:
                sent = os.write(self.fd, data)
            except BlockingIOError:
                sent = 0
            except OSError:
                self.owner.lost()
                return True
            if sent < len(data):
                self._waiting = [data[sent:]]
                self._bytes = len(data) - sent
                if sent:
                    self._since = trio.current_time()
                return False
            self._waiting, self._bytes = None, 0
        self.owner.drained()  # may write more: it goes out at once, or waits anew
        return self._waiting is None

    def stuck_for(self, now: float) -> float:
        return now - self._since if self._waiting else 0.0

    async def _drain_stream(self) -> None:
        try:
            while self._waiting:
                data = b"".join(self._waiting)
                self._waiting, self._bytes = None, 0
                with trio.move_on_after(self.write_timeout) as scope:
                    await self.stream.send_all(data)
                if scope.cancelled_caught:
                    self.owner.stuck()
                    return
            self.owner.drained()
        finally:
            self._writer = False

    async def last_words(self) -> None:
        """At close: what still waits (a DISCONNECT), as far as the socket takes it."""
        if not self._waiting:
            return
        data = b"".join(self._waiting)
        self._waiting, self._bytes = None, 0
        if self.stream is not None:
            with trio.move_on_after(0.5):
                try:
                    await self.stream.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError,
                        trio.BusyResourceError, OSError):
                    pass
        elif self.fd >= 0:
            try:
                os.write(self.fd, data)
            except OSError:
                pass

    async def close(self) -> None:
        if self.stream is not None:
            with trio.move_on_after(1):
                await self.stream.aclose()
        elif self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)
