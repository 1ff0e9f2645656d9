"""Transports under MQTT: a server TLS context that follows its files on disk, the TLS
handshake with certificate identity, and a WebSocket connection seen as a byte stream.

The listeners in `gateway.listener` put these together; `Connection` only ever sees a
`trio.abc.Stream`.
"""

from __future__ import annotations

import logging
import os
import ssl
from typing import Any

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

log = logging.getLogger("lightgate.gateway.tls")

TLS_HANDSHAKE_TIMEOUT = 10.0  # a stalled client gives up its slot after this long
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
        self._context = build_server_context(*self._args)  # a bad file at start is fatal

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
                self._context = build_server_context(*self._args)
                log.info("reloaded TLS certificate from %s", self._args[0])
            except (OSError, ssl.SSLError, ValueError) as exc:
                log.error("TLS certificate %s did not load, keeping the previous one: %s",
                          self._args[0], exc)
        return self._context


class ServerTLS:
    """The TLS side of the mqtt_tls and wss listeners (they share one context)."""

    def __init__(
        self, cert: str, key: str, ca: str | None = None, client_auth: str = "none",
        username_from: str = "none",
    ) -> None:
        if username_from not in USERNAME_SOURCES:
            raise ValueError(f"TLS username source must be none, cn or san, not {username_from!r}")
        self.contexts = ReloadingContext(cert, key, ca, client_auth)
        self.username_from = username_from
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
            with trio.fail_after(TLS_HANDSHAKE_TIMEOUT):
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


class WebSocketStream(trio.abc.Stream):
    """An accepted MQTT WebSocket connection as a byte stream, for `Connection`.

    MQTT 6.0: packets travel in binary messages and need not be aligned with them, so
    reads hand out message bytes (keeping the rest for the next read) and every write
    is one binary message."""

    # Closes that are the peer simply going away; others are reported as a broken stream.
    _NORMAL_CLOSES = (1000, 1001, 1005)

    def __init__(self, ws: WebSocketConnection) -> None:
        self.ws = ws
        self._buf = b""
        self._pos = 0

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        while self._pos >= len(self._buf):
            try:
                message = await self.ws.get_message()
            except ConnectionClosed as exc:
                if exc.reason is None or exc.reason.code in self._NORMAL_CLOSES:
                    return b""
                raise trio.BrokenResourceError(f"websocket closed: {exc.reason}") from exc
            if isinstance(message, str):  # MQTT-6.0.0-1: text frames close the connection
                with trio.move_on_after(1):  # a peer that never answers the close
                    await self.ws.aclose(1003, "MQTT needs binary frames")
                raise trio.BrokenResourceError("text frame on an MQTT websocket")
            self._buf, self._pos = message, 0
        end = len(self._buf) if max_bytes is None else min(len(self._buf), self._pos + max_bytes)
        data = self._buf[self._pos:end]  # the whole message is not copied (bytes slice)
        self._pos = end
        return data

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        try:
            await self.ws.send_message(bytes(data))
        except ConnectionClosed as exc:
            raise trio.BrokenResourceError(f"websocket closed: {exc.reason}") from exc

    async def wait_send_all_might_not_block(self) -> None:
        return  # messages go straight to the transport; send_all is where it waits

    async def aclose(self) -> None:
        await self.ws.aclose()  # close handshake, then the TCP/TLS stream under it


class WatchedStream(trio.abc.Stream):
    """A stream that sets `ended` once it reads EOF, breaks or is closed.

    trio-websocket's reader stops quietly when the peer leaves or sends something other
    than an upgrade request; this lets the listener stop waiting for the upgrade then,
    rather than holding the connection's task until the handshake timeout."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner
        self.ended = trio.Event()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        try:
            data = await self.inner.receive_some(max_bytes)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.ended.set()
            raise
        if not data:
            self.ended.set()
        return data

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        try:
            await self.inner.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.ended.set()
            raise

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        self.ended.set()
        await self.inner.aclose()
