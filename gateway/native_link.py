"""Connections the native side accepts (the MQTT over TLS, WebSocket and secure
WebSocket listeners on the native plane), on Python's side: a TLS session cannot move
between Python's `ssl` and rustls, so the engine holds it from the accept to the close
(docs/native-plane.md), does the handshake (and a WebSocket's upgrade and frames), and
hands Python the connection as bytes: `NativeStream`, the `trio.abc.Stream` that a
`Connection` reads and writes as it reads any TLS or WebSocket stream. Every rule and
budget is Python's as on a socket: the CONNECT and its deadline, authentication, the
read budget (a read takes no more than the connection may hold), what may wait for the
client and how fast it must take it; for a WebSocket, the subprotocol it is accepted
with and how large its messages may be.

The engine relays at most a window ahead of what Python consumed (past it, it does not
read the socket: TCP holds the rest), and what Python writes waits for the link in the
engine, in order; past a mark the writer waits until the engine says there is room, as
a socket's full send buffer makes it wait. What was relayed and not consumed yet counts
in the node's read budget (--max-partial-bytes), as the bytes of Python's own reads do
until they reach the decoder: while the node is over it, the engine reads no more of a
connection holding its share, and a read here takes what the budget allows when the
bytes are there, not when the wait for them began. A connection Python promotes (gateway.handover)
stays on its link in the engine, carried there; its demotion relays it again."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

from gateway.reading import ReadAgain
from serving.accepting import note_failure
from serving.fd_budget import refused_natively

if TYPE_CHECKING:
    from serving.read_budget import ReadBudget

log = logging.getLogger("lightgate.gateway.tls")
listener_log = logging.getLogger("lightgate.gateway.listener")
ws_log = logging.getLogger("lightgate.gateway.websocket")

WINDOW = 64 * 1024  # what the engine relays ahead of what is consumed (link.rs)


class NativeStream(trio.abc.Stream):
    """A connection the engine accepted, as a byte stream (one `Connection` reads it)."""

    def __init__(self, link: Any, peer: str, budget: ReadBudget | None = None) -> None:
        self.link = link  # serving.lightgate_native.Link
        self.peer = peer
        self.budget = budget  # the node's read budget, which counts what waits here
        # How much a read may take once its bytes are there (set by whoever makes the
        # Connection reading it: the budget's answer for that connection, now).
        self.read_size: Callable[[], int] | None = None
        self._in: deque[bytes] = deque()  # relayed, not taken yet
        self.relayed = 0  # bytes the engine relayed, over the connection's life
        self.consumed = 0  # of them, taken (read, or handed to the engine with a carry)
        self._acked = 0  # what the engine was last told of `consumed`
        self._end: tuple[bool, str] | None = None  # (eof, why) once the client ended it
        self._ready: trio.Event | None = None  # a reader waits for bytes
        self._again = False  # the reader gives up its wait and looks again (ReadAgain)
        self._full = False  # what waits in the engine is past the mark: wait for room
        self._room: trio.Event | None = None
        self._closed = False
        self.carried = False  # the engine carries the connection (gateway.handover)
        # A WebSocket's: how large a message may be, and the setting that says so, asked
        # before each read and write until it changes (once, as the CONNECT is read:
        # before the CONNACK goes out, so every message the client begins after it has
        # the new limit). The engine closes a message past it with 1009.
        self.message_limit: Callable[[], tuple[int, str]] | None = None
        self._limit: tuple[int, str] | None = None

    # -- what the engine says (the handover task's events) ------------------------------
    def fed(self, data: bytes) -> None:
        self._in.append(data)
        self.relayed += len(data)
        self._wake()

    def ended(self, eof: bool, why: str) -> None:
        self._end = (eof, why)
        self._wake()
        self.room()  # a writer waiting learns it is broken

    def room(self) -> None:
        self._full = False
        if self._room is not None:
            self._room.set()
            self._room = None

    def read_again(self) -> None:
        """A reader waiting for bytes gives up its wait (ReadAgain) and looks again
        whether to read, and until when (the connection was promoted, or held still)."""
        self._again = True
        self._wake()

    def _wake(self) -> None:
        if self._ready is not None:
            self._ready.set()
            self._ready = None

    # -- what a promotion takes (gateway.handover) --------------------------------------
    def take_unread(self) -> bytes:
        """What was relayed and not read yet, for the engine to read first."""
        data = b"".join(self._in)
        self._in.clear()
        self.consumed += len(data)
        return data

    def put_back(self, data: bytes) -> None:
        """The promotion did not happen: the bytes taken are read here after all."""
        if data:
            self._in.appendleft(data)
            self.consumed -= len(data)

    def carry(self) -> None:
        """The engine carries the connection: everything relayed is accounted for."""
        self.carried = True
        self._ack()

    def _ack(self) -> None:
        """Tell the engine what was consumed: it may relay more, and counts less."""
        self._acked = self.consumed
        if self.link.consumed(self.consumed) and self.budget is not None:
            self.budget.refresh()  # the node is back within its budget

    def upgrade(self, subprotocol: str) -> None:
        """Accept the WebSocket's upgrade with `subprotocol`: the engine writes the 101,
        and frames what is sent from here as binary messages."""
        assert self.message_limit is not None
        self._limit = self.message_limit()
        self.link.upgrade(subprotocol, *self._limit)

    def refuse(self, status: int, body: bytes) -> None:
        """Refuse the WebSocket's upgrade: the engine answers `status` with `body` (as
        `transports.reject_upgrade` does), then closes the connection."""
        self._closed = True
        self.link.refuse(status, body)

    def _tell_limit(self) -> None:
        assert self.message_limit is not None
        limit = self.message_limit()
        if limit != self._limit:
            self._limit = limit
            self.link.set_message_limit(*limit)
            self.message_limit = None  # (it changes once)

    # -- trio.abc.Stream ----------------------------------------------------------------
    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self.message_limit is not None:
            self._tell_limit()
        while not self._in:
            if self._end is not None:
                eof, why = self._end
                if eof:
                    return b""
                raise trio.BrokenResourceError(why)
            if self._closed:
                raise trio.ClosedResourceError("closed")
            if self._again:
                self._again = False
                raise ReadAgain
            self._ready = trio.Event()
            await self._ready.wait()
            if self.read_size is not None:  # the budget as it is now the bytes came
                max_bytes = self.read_size()
        data = self._take(max_bytes)
        self.consumed += len(data)
        # Acknowledged when all was taken (nothing waits here: nothing counts), or every
        # half window (the engine reads on).
        if not self._in or self.consumed - self._acked >= WINDOW // 2:
            self._ack()
        return data

    def _take(self, max_bytes: int | None) -> bytes:
        chunk = self._in.popleft()
        if max_bytes is not None and len(chunk) > max_bytes:
            self._in.appendleft(chunk[max_bytes:])
            return chunk[:max_bytes]
        if max_bytes is None or not self._in or len(chunk) >= max_bytes:
            return chunk
        parts = [chunk]
        n = len(chunk)
        while self._in and n < max_bytes:
            nxt = self._in.popleft()
            if n + len(nxt) > max_bytes:
                self._in.appendleft(nxt[max_bytes - n:])
                nxt = nxt[:max_bytes - n]
            parts.append(nxt)
            n += len(nxt)
        return b"".join(parts)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed:
            raise trio.ClosedResourceError("closed")
        if self.message_limit is not None:
            self._tell_limit()
        if self._end is not None and not self._end[0]:
            raise trio.BrokenResourceError(self._end[1])
        try:
            full = self.link.send(bytes(data))
        except BrokenPipeError as exc:
            raise trio.BrokenResourceError("connection closed") from exc
        self._full = self._full or full
        await self.wait_send_all_might_not_block()

    async def wait_send_all_might_not_block(self) -> None:
        while self._full and not self._closed and self._end is None:
            if self._room is None:
                self._room = trio.Event()
            await self._room.wait()
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self.link.close()  # what was sent goes out first, then the close_notify
            self._wake()
            self.room()
        await trio.lowlevel.checkpoint()


# A connection's life over its stream: (stream, peer, certificate identity, a WebSocket's
# upgrade request as (target, subprotocols offered) or None).
Serve = Callable[[NativeStream, str, "str | None", "tuple[str, list[str]] | None"],
                 Awaitable[None]]


class NativeLinks:
    """The engine's news of the connections it accepted, for their streams (taken by
    the handover task, which waits on the engine's wake-up for both)."""

    def __init__(self, nursery: Callable[[], trio.Nursery | None], serve: Serve,
                 budget: ReadBudget | None = None) -> None:
        self._nursery = nursery  # where each connection's task runs
        self._serve = serve  # a connection's life, over its stream
        self._budget = budget  # the node's read budget
        self.streams: dict[int, NativeStream] = {}

    def on_event(self, ev: tuple[Any, ...]) -> None:
        kind = ev[0]
        if kind == "data":
            stream = self.streams.get(ev[1])
            if stream is not None:
                stream.fed(ev[2])
        elif kind == "opened":
            self._opened(*ev[1:])
        elif kind == "ended":
            stream = self.streams.get(ev[1])
            if stream is not None:
                stream.ended(ev[2], ev[3])
        elif kind == "room":
            stream = self.streams.get(ev[1])
            if stream is not None:
                stream.room()
        elif kind == "log":
            _log(*ev[1:])

    def _opened(self, link: Any, listener: int, peer: str, identity: str | None,
                upgrade: tuple[str, list[str]] | None = None) -> None:
        nursery = self._nursery()
        if nursery is None:  # shutting down
            link.close()
            return
        stream = NativeStream(link, peer, self._budget)
        self.streams[link.id] = stream
        nursery.start_soon(self._run, stream, identity, upgrade)

    async def _run(self, stream: NativeStream, identity: str | None,
                   upgrade: tuple[str, list[str]] | None) -> None:
        try:
            await self._serve(stream, stream.peer, identity, upgrade)
        finally:
            self.streams.pop(stream.link.id, None)
            # (One the engine carries is closed once it is back: gateway.handover.)
            if not stream._closed and not stream.carried:
                stream._closed = True
                stream.link.close()

    def forget(self, conn_id: int) -> None:
        """A connection Python no longer knows: the engine closes it."""
        stream = self.streams.pop(conn_id, None)
        if stream is not None:
            stream._closed = True
            stream.link.close()


def _log(what: str, text: str, count: int) -> None:
    """A line of the engine's, said as Python's listeners say it."""
    if what in ("handshake", "reloaded"):
        log.info("%s", text)
    elif what == "reload_failed":
        log.error("%s", text)
    elif what == "accept_failed":
        note_failure(text)
    elif what == "refused":
        refused_natively(text, count)
    elif what == "ws_handshake":
        listener_log.info("%s", text)
    elif what == "ws_limit":
        ws_log.warning("%s", text)
