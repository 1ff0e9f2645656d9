"""The Raft port, hardened. pysyncobj's TCP transport trusts whoever connects: it buffers
a frame of any announced length (up to 2 GiB) before it can tell who sent it, keeps a
connection that never says a word for as long as the kernel does, counts a peer as
known once any frame of it decrypts, and its listener unbinds for good on any accept
error but EAGAIN (EMFILE included). Subclasses that pysyncobj is told to use change
that:

- **A peer is authenticated only by answering this connection's challenge.** With the
  group secret, pysyncobj's handshake is a challenge-response already: each side sends
  a fresh 32-byte random key (os.urandom) in a frame encrypted and MACed with the
  secret (Fernet: AES-CBC and HMAC-SHA256, from `cryptography`), and every later frame
  must carry the other side's key inside that encryption. A first frame proves nothing:
  it can be captured on the wire and replayed on any number of new connections, and it
  decrypts every time. What a replay cannot do is answer the key the accepting side
  made for *this* connection. So a connection counts as authenticated once a frame
  carrying our key for it decrypted (`GuardedConnection.proven`); until then it may not
  make the node hold more than PRE_AUTH_BYTES. (A nonce and timestamp window on the
  first frame would need clocks in step across nodes and still admit replays within
  the window; the challenge needs neither.)
- **Strangers are bounded in time and in number.** An accepted connection that has not
  authenticated within PRE_AUTH_DEADLINE_S is closed (a peer takes a round trip). At
  most PRE_AUTH_PER_ADDRESS such connections per source address and PRE_AUTH_TOTAL in
  all are kept: a new one past a cap closes the oldest unauthenticated one (from that
  address, or of all), so a peer dialling in during an attack still gets its round trip.
  Authenticated peers' connections are never counted.
- **The listener never stops.** An accept error rests the listener ACCEPT_BACKOFF_S
  (serving.accepting), out of the poller so that it does not spin, and it accepts again.
  Its backlog is BACKLOG, not pysyncobj's 5, so that strangers connecting as fast as
  they can do not leave a peer's SYN dropped (and retried only a second later).
- TCP keepalive and TCP_USER_TIMEOUT make a link that stops carrying packets (a
  partition, a paused peer) fail within LINK_DEAD_S, so pysyncobj reconnects when the
  network heals instead of waiting on a dead connection.

The secret itself (pysyncobj's `password`) is what keeps a stranger's bytes away from
its unpickler: every frame is checked (Fernet's HMAC) before it is deserialised. Its key
is derived with PBKDF2 and a salt fixed in pysyncobj, so a weak secret could be guessed
offline from one captured frame: it must be random (docs/store-groups.md).

This reaches into pysyncobj's private names (`_TcpConnection__...`, `_TcpServer__...`);
the version is pinned below 0.4 in pyproject.toml, and tests/ha/test_raft_port.py and
tests/ha/test_raft_port_attacks.py check every rule."""

from __future__ import annotations

import logging
import socket
import struct
import time
from typing import Any

import pysyncobj.tcp_server
import pysyncobj.transport
from pysyncobj.poller import POLL_EVENT_TYPE
from pysyncobj.tcp_connection import CONNECTION_STATE, TcpConnection
from pysyncobj.tcp_server import TcpServer
from pysyncobj.transport import TCPTransport

from serving.accepting import ACCEPT_BACKOFF_S, must_rest
from serving.rate_limited_log import RateLimitedLog

log = logging.getLogger("lightgate.store.raft_port")

PRE_AUTH_BYTES = 4096  # a peer's handshake frames are ~120-200 bytes encrypted
MAX_FRAME_BYTES = 16 << 20  # the group state is a few kB; appends come in 64 KiB batches
PRE_AUTH_DEADLINE_S = 5.0
PRE_AUTH_PER_ADDRESS = 8
PRE_AUTH_TOTAL = 64
BACKLOG = 128  # pysyncobj listens with 5: a flood of strangers would crowd peers' SYNs out
ACCEPTS_PER_WAKE = 32
LINK_DEAD_S = 3

_strangers = RateLimitedLog(log)


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, LINK_DEAD_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, LINK_DEAD_S * 1000)


class GuardedConnection(TcpConnection):
    """pysyncobj's connection with a bounded buffer until the peer has answered this
    connection's challenge, and a dead-link timeout (see the module's docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.proven = False  # a frame carrying our key for this connection decrypted
        self.peer = ""  # the source address, for accepted connections
        self.accepted_at = time.monotonic()
        if kwargs.get("socket") is not None:  # accepted: the socket exists already
            _tune(kwargs["socket"])

    def connect(self, host: str, port: int) -> bool:
        self.proven = False
        try:
            ok = super().connect(host, port)
        except OSError as exc:  # no socket to be had (EMFILE): pysyncobj retries later
            log.debug("Raft: cannot dial %s:%s: %s", host, port, exc)
            sock = self._TcpConnection__socket  # type: ignore[attr-defined]
            if sock is not None:  # made, then a setsockopt failed: not to be leaked
                sock.close()
                self._TcpConnection__socket = None
            return False
        sock = self._TcpConnection__socket  # type: ignore[attr-defined]
        if sock is not None:
            try:
                _tune(sock)
            except OSError:
                pass  # connect already failed: pysyncobj retries later
        return ok

    def _authenticated(self) -> bool:
        """With a secret, a peer is known once it answered our challenge; without one
        nothing is ever known, and only the size bound holds."""
        return self.proven or self.encryptor is None

    def _TcpConnection__processParseMessage(self) -> Any:  # noqa: N802 - pysyncobj's name
        # pysyncobj checks every frame's key once it has sent its own (recvRandKey):
        # a frame that parses then carries this connection's challenge, answered.
        challenged = bool(self.recvRandKey)
        message = TcpConnection._TcpConnection__processParseMessage(self)  # type: ignore[attr-defined]
        if message is not None and challenged:
            self.proven = True
        return message

    def _TcpConnection__processRead(self) -> bool:  # noqa: N802 - pysyncobj's private name
        more = TcpConnection._TcpConnection__processRead(self)  # type: ignore[attr-defined]
        buf = self._TcpConnection__readBuffer  # type: ignore[attr-defined]
        bound = MAX_FRAME_BYTES if self._authenticated() else PRE_AUTH_BYTES
        if len(buf) <= bound:
            return more
        if struct.unpack("i", buf[:4])[0] + 4 > bound:  # the frame at its head: too large
            self.disconnect()
        # Else whole frames wait: parsed (and the peer perhaps proven) before reading on.
        return False


class GuardedServer(TcpServer):
    """pysyncobj's listener, resting on accept errors instead of unbinding for good,
    with a backlog that a flood of strangers does not fill at once, and taking every
    connection waiting (up to ACCEPTS_PER_WAKE) when it wakes, not one."""

    _resume_at: float | None = None

    def bind(self) -> None:
        super().bind()
        self._TcpServer__socket.listen(BACKLOG)  # type: ignore[attr-defined]

    def _TcpServer__onNewConnection(self, descr: int, event: int) -> None:  # noqa: N802
        if event & POLL_EVENT_TYPE.ERROR:
            self._rest("the listening socket reported an error")
            return
        if event & POLL_EVENT_TYPE.READ:
            for _ in range(ACCEPTS_PER_WAKE):
                if not self._accept_one():
                    return

    def _accept_one(self) -> bool:
        """Accept one connection; False when there is none left (or the listener rests)."""
        try:
            sock, addr = self._TcpServer__socket.accept()  # type: ignore[attr-defined]
        except OSError as exc:
            if must_rest(exc, "Raft"):
                self._rest()
            return False
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._TcpServer__sendBufferSize)  # type: ignore[attr-defined]
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._TcpServer__recvBufferSize)  # type: ignore[attr-defined]
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)
            conn = GuardedConnection(
                poller=self._TcpServer__poller, socket=sock,  # type: ignore[attr-defined]
                timeout=self._TcpServer__connectionTimeout,  # type: ignore[attr-defined]
                sendBufferSize=self._TcpServer__sendBufferSize,  # type: ignore[attr-defined]
                recvBufferSize=self._TcpServer__recvBufferSize,  # type: ignore[attr-defined]
                keepalive=self._TcpServer__keepalive)  # type: ignore[attr-defined]
        except OSError:  # gone before we got to it
            sock.close()
            return True
        conn.peer = addr[0]
        self._TcpServer__onNewConnectionCallback(conn)  # type: ignore[attr-defined]
        return True

    def _rest(self, why: str = "") -> None:
        if why:
            _strangers.note(f"Raft port: {why}; accepting again in {ACCEPT_BACKOFF_S} s")
        fileno = self._TcpServer__fileno  # type: ignore[attr-defined]
        if fileno is not None and self._resume_at is None:
            self._TcpServer__poller.unsubscribe(fileno)  # type: ignore[attr-defined]
            self._resume_at = time.monotonic() + ACCEPT_BACKOFF_S

    def resume_if_due(self, now: float) -> None:
        fileno = self._TcpServer__fileno  # type: ignore[attr-defined]
        if self._resume_at is None or now < self._resume_at:
            return
        self._resume_at = None
        if fileno is not None:
            self._TcpServer__poller.subscribe(  # type: ignore[attr-defined]
                fileno, self._TcpServer__onNewConnection,
                POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.ERROR)


class GuardedTransport(TCPTransport):
    """pysyncobj's TCP transport with accepted connections bounded in time and number
    until they authenticate (pysyncobj keeps them in `_unknownConnections` until then)."""

    def _onNewIncomingConnection(self, conn: GuardedConnection) -> None:  # noqa: N802
        super()._onNewIncomingConnection(conn)
        waiting = [c for c in self._unknownConnections
                   if c is not conn and c.state != CONNECTION_STATE.DISCONNECTED]
        same = [c for c in waiting if c.peer == conn.peer]
        if len(same) >= PRE_AUTH_PER_ADDRESS:
            self._close_stranger(min(same, key=_age), f"more than {PRE_AUTH_PER_ADDRESS} "
                                 "unauthenticated connections from one address")
        elif len(waiting) >= PRE_AUTH_TOTAL:
            self._close_stranger(min(waiting, key=_age), f"more than {PRE_AUTH_TOTAL} "
                                 "unauthenticated connections")

    def _onTick(self) -> None:  # noqa: N802 - pysyncobj's name
        now = time.monotonic()
        server = self._server
        if isinstance(server, GuardedServer):
            server.resume_if_due(now)
        for conn in list(self._unknownConnections):
            if now - conn.accepted_at > PRE_AUTH_DEADLINE_S:
                self._close_stranger(conn, "not authenticated within "
                                     f"{PRE_AUTH_DEADLINE_S:.0f} s")
        super()._onTick()

    def _close_stranger(self, conn: GuardedConnection, why: str) -> None:
        _strangers.note(f"Raft port: connections closed: {why}")
        conn.disconnect()  # pysyncobj's callback drops it from _unknownConnections
        self._unknownConnections.discard(conn)


def _age(conn: GuardedConnection) -> float:
    return conn.accepted_at


def install() -> None:
    """Make pysyncobj build GuardedConnection for dialled connections and GuardedServer
    for its listener (GuardedTransport is passed to SyncObj as its transportClass)."""
    pysyncobj.tcp_server.TcpConnection = GuardedConnection  # type: ignore[misc]
    pysyncobj.transport.TcpConnection = GuardedConnection  # type: ignore[misc]
    pysyncobj.transport.TcpServer = GuardedServer  # type: ignore[misc]
