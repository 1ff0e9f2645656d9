"""A connection's one write path. Bytes go to the socket at once when it takes them (a
plain TCP socket is written directly, non-blocking); what it cannot take waits here, in
order and in one buffer, until it can: the reactor watches a TCP socket for
writability, a TLS or WebSocket stream gets a writer task for as long as something
waits. What may wait and how fast the client must take it is gateway.backpressure's
rule: past the high-water mark the connection is not read until it is down to the low
one, and a client that takes less than --min-drain-bytes per --write-timeout is
disconnected: its messages wait in the store, not in the gateway's memory."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import trio

from gateway.backpressure import WriteRules
from gateway.stats import Stats

STREAM_CHUNK = 64 * 1024  # bytes a stream's writer sends at a time, at most


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

    def stuck(self) -> None: ...  # the client took too little for the write timeout

    def hold_reading(self, full: bool) -> None: ...  # past the high-water mark, or back

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None: ...


class Output:
    __slots__ = ("owner", "fd", "stream", "rules", "stats", "written", "lost", "_buf",
                 "_packets", "_sending", "_due", "_deadline", "_writer", "_full", "_room")

    def __init__(self, owner: Owner, fd: int, stream: trio.abc.Stream | None,
                 rules: WriteRules, stats: Stats) -> None:
        self.owner = owner
        self.fd = fd  # a plain TCP socket (-1: none)
        self.stream = stream  # a trio stream (TLS, WebSocket), or None
        self.rules = rules
        self.stats = stats
        self.written = 0  # bytes written here over the connection's life
        self.lost = 0  # of them, what never went out (the connection ended first)
        # What the socket has not taken yet (None: nothing waits, or no writer runs).
        # One buffer: a flood of small answers as separate objects weighed 20 times
        # their bytes.
        self._buf: bytearray | None = None
        self._packets = 0  # packets in it (as the drain goes: about)
        self._sending = 0  # bytes a stream's writer has taken from `_buf` and sends
        self._due = 0  # bytes the client must still take before `_deadline`
        self._deadline = 0.0
        self._writer = False  # a writer task drains a stream's backlog
        self._full = False  # past the high-water mark: the connection is not read
        self._room: trio.Event | None = None  # the lane waits for the low-water mark

    @property
    def backlog(self) -> int:
        """Bytes written but not taken by the socket yet."""
        buf = self._buf
        return (len(buf) if buf is not None else 0) + self._sending

    @property
    def taken(self) -> int:
        """Bytes the socket has taken over the connection's life: what was written here
        up to this position is on its way to the client (or in the kernel's buffers)."""
        return self.written - self.backlog - self.lost

    @property
    def full(self) -> bool:
        """Past the high-water mark: not read until down to the low one."""
        return self._full

    @property
    def over(self) -> bool:
        """Past the high-water mark now: deliveries wait."""
        return self._buf is not None and self.rules.full(self.backlog, self._packets)

    def would_pass(self, more: int, packets: int) -> bool:
        """Whether `packets` more packets of `more` bytes would pass the mark."""
        return self.rules.full(self.backlog + more, self._packets + packets)

    def write(self, data: bytes, packets: int = 1) -> None:
        if not data or (self.fd < 0 and self.stream is None):
            return
        self.stats.bytes_out += len(data)
        self.written += len(data)
        buf = self._buf
        if buf is not None:  # behind what waits already
            buf += data
            self._packets += packets
            self.stats.unsent_bytes += len(data)
            if not self._full and self.rules.full(self.backlog, self._packets):
                self._hold(True)
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
        self._buf = bytearray(data)
        self._packets = packets
        self.stats.unsent_bytes += len(data)
        self._due = self.rules.due(len(data))
        self._deadline = trio.current_time() + self.rules.timeout
        if self.rules.full(len(data), packets):
            self._hold(True)
        if self.owner.reactor is not None:
            self.owner.reactor.want_write(self.owner)
        elif not self._writer:
            self._writer = True
            try:
                self.owner.spawn(self._drain_stream)
            except RuntimeError:  # shutting down, its tasks gone: `last_words` sends it
                self._writer = False

    def writable(self) -> bool:
        """The socket takes more (the reactor says): write what waits; True when all of
        it is out."""
        buf = self._buf
        if buf:
            try:
                sent = os.write(self.fd, buf)
            except BlockingIOError:
                sent = 0
            except OSError:
                self.owner.lost()
                return True
            if sent:
                del buf[:sent]  # from the front of a bytearray: no copy of the rest
                self._taken(sent)
            if buf:
                return False
        self._buf, self._packets = None, 0
        self.owner.drained()  # may write more: it goes out at once, or waits anew
        return self._buf is None

    def _taken(self, n: int) -> None:
        """The socket took `n` bytes: the drain rule's count, and the low-water mark."""
        rules, left = self.rules, self.backlog
        self.stats.unsent_bytes -= n
        if self._packets:  # gone in proportion to the bytes: packet boundaries are not kept
            self._packets = self._packets * left // (left + n)
        self._due -= n
        if self._due <= 0:  # this window's share is in: the next one's clock starts
            self._due = rules.due(left)
            self._deadline = trio.current_time() + rules.timeout
        if self._full and rules.room(left, self._packets):
            self._hold(False)

    def _hold(self, full: bool) -> None:
        self._full = full
        self.stats.unsent_held += full
        self.owner.hold_reading(full)
        if not full and self._room is not None:
            self._room.set()
            self._room = None

    async def room(self) -> None:
        """Until what waits is down to the low-water mark (the lane waits here before
        it answers more)."""
        while self._full:
            if self._room is None:
                self._room = trio.Event()
            await self._room.wait()

    def stuck(self, now: float) -> bool:
        """The client took too little of what waits before the deadline (the reactor
        asks every second)."""
        return self._due > 0 and now > self._deadline and self.backlog > 0

    async def _drain_stream(self) -> None:
        assert self.stream is not None
        try:
            while self._buf:
                while self._buf:
                    buf = self._buf
                    # No more than is due: the deadline holds for what is due, and a
                    # send cut short breaks the stream.
                    n = min(len(buf), STREAM_CHUNK, max(self._due, 4096))
                    data = bytes(buf[:n])
                    del buf[:n]
                    self._sending = n
                    with trio.move_on_at(self._deadline) as scope:
                        await self.stream.send_all(data)
                    if scope.cancelled_caught:
                        self.owner.stuck()
                        return
                    self._sending = 0
                    self._taken(n)
                self._buf, self._packets = None, 0
                self.owner.drained()  # what it writes waits for this task: no other
        finally:
            self._writer = False
            self._forget(self._sending)  # a send cut short: the stream is broken
            self._sending = 0

    async def last_words(self) -> None:
        """At close: what still waits (a DISCONNECT), as far as the socket takes it; the
        rest is `lost`."""
        if not self._buf:
            return
        data = bytes(self._buf)
        self.stats.unsent_bytes -= len(data)
        self._buf, self._packets = None, 0
        sent = 0
        if self.stream is not None:
            with trio.move_on_after(0.5):
                try:
                    await self.stream.send_all(data)
                    sent = len(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError,
                        trio.BusyResourceError, OSError):
                    pass
        elif self.fd >= 0:
            try:
                sent = os.write(self.fd, data)
            except OSError:
                pass
        self.lost += len(data) - sent

    def _forget(self, n: int) -> None:
        """`n` bytes that waited will never go out (the connection ends)."""
        self.stats.unsent_bytes -= n
        self.lost += n

    async def close(self) -> None:
        if self._buf is not None:
            self._forget(len(self._buf))
            self._buf, self._packets = None, 0
        if self.stream is not None:
            with trio.move_on_after(1):
                await self.stream.aclose()
        elif self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)
