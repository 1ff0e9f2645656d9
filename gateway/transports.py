"""Transports under MQTT: a server TLS context that follows its files on disk, the TLS
handshake with certificate identity, and the WebSocket upgrade and a WebSocket
connection seen as a byte stream (on wsproto, which does no I/O of its own: the reads
are Connection's, so they obey its budgets).

The listeners in `gateway.listener` put these together; `Connection` only ever sees a
`trio.abc.Stream`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import ssl
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from wsproto import ConnectionState, ConnectionType, WSConnection
from wsproto.events import (
    BytesMessage,
    CloseConnection,
    Event,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

log = logging.getLogger("lightgate.gateway.tls")
ws_log = logging.getLogger("lightgate.gateway.websocket")

TLS_HANDSHAKE_TIMEOUT = 10.0  # a stalled client gives up its slot after this long
WS_RECEIVE_BUFFER = 64 * 1024  # bytes per socket read when the caller names no size
WS_CLOSE_TIMEOUT = 1.0  # for the peer's part of a close handshake
WS_CLOSE_DRAIN = 256 * 1024  # bytes read past while waiting for the peer's close frame
CLIENT_AUTH_MODES = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL,
                     "required": ssl.CERT_REQUIRED}
USERNAME_SOURCES = ("none", "cn", "san")
SAN_USERNAME_TYPES = ("DNS", "email")  # the SAN kinds that can name a device


def build_server_context(
    cert: str, key: str, ca: str | None = None, client_auth: str = "none"
) -> ssl.SSLContext:
    """A server-side context (TLS 1.2+, the ssl module's safe defaults) for `cert`/`key`;
    with `ca`, client certificates are asked for ('optional') or demanded ('required')."""
    if client_auth not in CLIENT_AUTH_MODES:
        raise ValueError(f"TLS client auth must be none, optional or required, not {client_auth!r}")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    if client_auth != "none":
        # Never fall back to the system store: any public certificate would then log in.
        if not ca:
            raise ValueError(f"TLS client auth {client_auth!r} needs a CA file (--tls-ca)")
        ctx.load_verify_locations(cafile=ca)
        ctx.verify_mode = CLIENT_AUTH_MODES[client_auth]
    return ctx


def cert_identity(peercert: dict[str, Any] | None, source: str) -> str | None:
    """The username a verified client certificate stands for: its first commonName
    ('cn') or its first DNS/email subjectAltName ('san'); None if it has none.

    `peercert` is `SSLObject.getpeercert()`, which is empty unless the certificate was
    verified against the CA, so an unverified certificate never names anyone."""
    if not peercert or source == "none":
        return None
    if source == "cn":
        for rdn in peercert.get("subject", ()):
            for name, value in rdn:
                if name == "commonName" and value:
                    return value
        return None
    if source == "san":
        for kind, value in peercert.get("subjectAltName", ()):
            if kind in SAN_USERNAME_TYPES and value:
                return value
        return None
    raise ValueError(f"TLS username source must be none, cn or san, not {source!r}")


class ReloadingContext:
    """The current server context, rebuilt when the certificate, key or CA file changes.

    Checked with a few stats on each new connection, so a renewed certificate (certbot,
    cert-manager) is used without a restart while open connections keep theirs. A file
    that does not load (half written, wrong key) keeps the old context in service."""

    def __init__(self, cert: str, key: str, ca: str | None, client_auth: str) -> None:
        self._args = (cert, key, ca, client_auth)
        self._files = tuple(p for p in (cert, key, ca if client_auth != "none" else None) if p)
        self._signature = self._stat()
        self._digests = self._digest()  # what the context in service was built from
        self._context = build_server_context(*self._args)  # a bad file at start is fatal

    def _digest(self) -> tuple[bytes | None, ...]:
        out: list[bytes | None] = []
        for path in self._files:
            try:
                with open(path, "rb") as fh:
                    out.append(hashlib.sha256(fh.read()).digest())
            except OSError:
                out.append(None)
        return tuple(out)

    def reload(self) -> list[str]:
        """Rebuild the context now (SIGHUP), whatever the files' stats say: the files
        whose contents differ from those of the context in service. A file that does not
        load raises, and the context in service stays."""
        self._signature = self._stat()  # (one error per change: `current` says no more)
        digests = self._digest()
        self._context = build_server_context(*self._args)
        changed = [path for path, old, new in zip(self._files, self._digests, digests,
                                                  strict=True) if old != new]
        self._digests = digests
        return changed

    def _stat(self) -> tuple[tuple[int, int, int] | None, ...]:
        # mtime, size and inode: an atomic rename and an in-place rewrite both show up.
        out: list[tuple[int, int, int] | None] = []
        for path in self._files:
            try:
                st = os.stat(path)
                out.append((st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                out.append(None)
        return tuple(out)

    def current(self) -> ssl.SSLContext:
        signature = self._stat()
        if signature != self._signature:
            # Remember the signature even on failure: one error per change, not per accept.
            self._signature = signature
            try:
                digests = self._digest()
                self._context = build_server_context(*self._args)
                self._digests = digests
                log.info("reloaded TLS certificate from %s", self._args[0])
            except (OSError, ssl.SSLError, ValueError) as exc:
                log.error("TLS certificate %s did not load, keeping the previous one: %s",
                          self._args[0], exc)
        return self._context


class ServerTLS:
    """The TLS side of the mqtt_tls and wss listeners (they share one context)."""

    def __init__(
        self, cert: str, key: str, ca: str | None = None, client_auth: str = "none",
        username_from: str = "none", handshake_timeout: float = TLS_HANDSHAKE_TIMEOUT,
        max_handshakes: int = 1024,
    ) -> None:
        if username_from not in USERNAME_SOURCES:
            raise ValueError(f"TLS username source must be none, cn or san, not {username_from!r}")
        self.contexts = ReloadingContext(cert, key, ca, client_auth)
        self.username_from = username_from
        self.handshake_timeout = handshake_timeout
        # Handshakes under way at once (each is a private-key operation): the next ones
        # wait for a turn, then have their own time.
        self._turns = trio.CapacityLimiter(max_handshakes)
        if username_from != "none" and client_auth == "none":
            log.warning("--tls-username-from %s has no effect without --tls-client-auth",
                        username_from)

    async def handshake(
        self, stream: trio.SocketStream, peer: str
    ) -> tuple[trio.SSLStream[trio.SocketStream], str | None] | None:
        """Server TLS handshake on a fresh connection, bounded in time; the encrypted
        stream and the certificate identity, or None (logged, closed) if it failed."""
        # https_compatible: a device that drops TCP without close_notify reads as EOF.
        tls = trio.SSLStream(stream, self.contexts.current(), server_side=True,
                             https_compatible=True)
        try:
            async with self._turns:
                with trio.fail_after(self.handshake_timeout):
                    await tls.do_handshake()
        except trio.TooSlowError:
            log.info("TLS handshake with %s timed out", peer)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.info("TLS handshake with %s failed: %s", peer, exc.__cause__ or exc)
        except Exception:  # never let one client's handshake end the accept loop
            log.exception("TLS handshake with %s failed", peer)
        else:
            return tls, cert_identity(tls.getpeercert(), self.username_from)
        await trio.aclose_forcefully(stream)
        return None


async def receive_upgrade(stream: trio.abc.Stream) -> tuple[WSConnection, Request] | None:
    """The client's HTTP upgrade request on a new connection, with the WebSocket state
    it opens; None if the peer leaves first or sends something else (answered 400). h11
    under wsproto bounds the request's head (16 KiB); the caller bounds the time."""
    ws = WSConnection(ConnectionType.SERVER)
    while True:
        try:
            data = await stream.receive_some(WS_RECEIVE_BUFFER)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return None
        if not data:
            return None
        try:
            ws.receive_data(data)
            request = next((e for e in ws.events() if isinstance(e, Request)), None)
        except RemoteProtocolError as exc:
            if exc.event_hint is not None:
                await _send_quietly(stream, ws, exc.event_hint)
            return None
        if request is not None:
            return ws, request


async def reject_upgrade(stream: trio.abc.Stream, ws: WSConnection, status: int,
                         body: bytes) -> None:
    headers = [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(body))]
    await _send_quietly(stream, ws, RejectConnection(status_code=status, headers=headers,
                                                     has_body=True))
    await _send_quietly(stream, ws, RejectData(data=body))


async def _send_quietly(stream: trio.abc.Stream, ws: WSConnection, event: Event) -> None:
    """An answer to a client that may be gone already: nothing to do if it is."""
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError,
                             LocalProtocolError):
        await stream.send_all(ws.send(event))


class WebSocketStream(trio.abc.Stream):
    """An accepted MQTT WebSocket connection as a byte stream, for `Connection`.

    MQTT 6.0: packets travel in binary messages and need not be aligned with them, so a
    read hands out message bytes as they arrive and no message is held whole: what a
    client sent of a packet waits in Connection's decoder, counted in the node's read
    budget (--max-partial-bytes) as for TCP, and a read takes no more from the socket
    than Connection asks for, so a connection that budget holds back is not read. A
    message longer than `message_limit()` allows (asked as it starts) is refused with
    close code 1009. Every write is one binary message."""

    # Closes that are the peer simply going away; others are reported as a broken stream.
    _NORMAL_CLOSES = (1000, 1001, 1005)

    def __init__(self, transport: trio.abc.Stream, ws: WSConnection, peer: str) -> None:
        self.transport = transport
        self.peer = peer
        self._ws = ws
        # These two depend on the Connection reading this stream, so whoever makes both
        # sets them. The bytes a message may have and the setting that says so (until
        # set, no message is let through);
        self.message_limit: Callable[[], tuple[int, str]] = lambda: (0, "not set up")
        # and a read of at most that many bytes of frames (a plain socket's may count
        # them in the node's read budget meanwhile, as Connection's reads of TCP do).
        self.read: Callable[[int], Awaitable[bytes]] = transport.receive_some
        self._limit: tuple[int, str] | None = None  # of the message under way, if any
        self._message_size = 0  # bytes of it so far
        self._ready: deque[bytes] = deque()  # message bytes not yet handed out
        self._peer_closed: int | None = None  # the code of the peer's close frame
        self._send_lock = trio.StrictFIFOLock()  # the reader answers pings and closes

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        while not self._ready:
            if self._peer_closed is not None:
                if self._peer_closed in self._NORMAL_CLOSES:
                    return b""
                raise trio.BrokenResourceError(f"websocket closed: {self._peer_closed}")
            data = await self.read(max_bytes or WS_RECEIVE_BUFFER)
            if not data:
                raise trio.BrokenResourceError("websocket closed without a close frame")
            self._ws.receive_data(data)
            for event in self._ws.events():
                await self._on_event(event)
        return self._take(max_bytes)

    async def _on_event(self, event: Event) -> None:
        if isinstance(event, BytesMessage):
            await self._on_message_bytes(event)
        elif isinstance(event, TextMessage):  # MQTT-6.0.0-1: text frames close it
            await self._close(1003, "MQTT needs binary frames")
            raise trio.BrokenResourceError("text frame on an MQTT websocket")
        elif isinstance(event, Ping):
            await self._send(event.response())
        elif isinstance(event, CloseConnection):
            if self._ws.state is ConnectionState.REMOTE_CLOSING:
                await self._send_quietly(event.response())
            else:  # a frame wsproto could not parse, told as a close: ours
                await self._close(event.code, event.reason or "")
            self._peer_closed = event.code

    async def _on_message_bytes(self, event: BytesMessage) -> None:
        if self._limit is None:
            self._limit = self.message_limit()
        limit, setting = self._limit
        self._message_size += len(event.data)
        if self._message_size > limit:
            ws_log.warning("websocket client %s closed: a message of more than %d bytes "
                           "(%s)", self.peer, limit, setting)
            await self._close(1009, f"message over {limit} bytes")
            raise trio.BrokenResourceError(f"websocket message over {limit} bytes ({setting})")
        if event.message_finished:
            self._limit, self._message_size = None, 0
        if event.data:
            self._ready.append(bytes(event.data))

    def _take(self, max_bytes: int | None) -> bytes:
        """Up to `max_bytes` of the bytes received, in one piece."""
        out: list[bytes] = []
        n = 0
        while self._ready and (max_bytes is None or n < max_bytes):
            chunk = self._ready.popleft()
            if max_bytes is not None and n + len(chunk) > max_bytes:
                keep = max_bytes - n
                self._ready.appendleft(chunk[keep:])
                chunk = chunk[:keep]
            out.append(chunk)
            n += len(chunk)
        return out[0] if len(out) == 1 else b"".join(out)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._send(BytesMessage(data=bytes(data)))

    async def wait_send_all_might_not_block(self) -> None:
        return  # messages go straight to the transport; send_all is where it waits

    async def _send(self, event: Event) -> None:
        async with self._send_lock:  # frames go out whole and in the order made
            try:
                data = self._ws.send(event)
            except LocalProtocolError as exc:  # closing: nothing more goes out
                raise trio.ClosedResourceError(f"websocket closing: {exc}") from None
            await self.transport.send_all(data)

    async def _send_quietly(self, event: Event) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self._send(event)

    async def _close(self, code: int, reason: str) -> None:
        """Start the close handshake (aclose waits for the answer)."""
        with trio.move_on_after(WS_CLOSE_TIMEOUT):  # a peer that reads nothing
            await self._send_quietly(CloseConnection(code=code, reason=reason))

    async def aclose(self) -> None:
        """The close handshake, then the TCP/TLS stream under it. Waiting for the peer's
        close frame (reading past what it still sends) before closing the socket keeps
        unread bytes from turning the close into a reset that loses our close frame."""
        try:
            if self._ws.state is ConnectionState.OPEN:
                await self._close(1000, "")
            if self._ws.state is ConnectionState.LOCAL_CLOSING:
                with trio.move_on_after(WS_CLOSE_TIMEOUT):
                    await self._await_close_frame()
        finally:
            await trio.aclose_forcefully(self.transport)

    async def _await_close_frame(self) -> None:
        drained = 0
        while drained < WS_CLOSE_DRAIN:
            try:
                data = await self.transport.receive_some(WS_RECEIVE_BUFFER)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if not data:
                return
            drained += len(data)
            self._ws.receive_data(data)
            if any(isinstance(e, CloseConnection) for e in self._ws.events()):
                return
