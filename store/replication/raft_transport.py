"""The Raft port's connections, hardened. pysyncobj's TCP connections buffer a frame of
any announced length (up to 2 GiB) before they can tell who sent it, and notice a peer
gone silent only when the kernel gives up on it (about 15 minutes for a connection with
unacknowledged data, 31 s for an idle one). Two changes, in a subclass that pysyncobj is
told to use for both directions:

- Before a peer has authenticated (its first frame decrypted with the group secret), at
  most PRE_AUTH_BYTES are buffered; a frame announced larger closes the connection. The
  secret itself (pysyncobj's `password`) is what keeps unauthenticated bytes away from
  its unpickler: every frame is checked (Fernet's HMAC) before it is deserialised.
- TCP keepalive and TCP_USER_TIMEOUT make a link that stops carrying packets (a
  partition, a paused peer) fail within LINK_DEAD_S, so pysyncobj reconnects when the
  network heals instead of waiting on a dead connection.

This reaches into pysyncobj's private names (`_TcpConnection__...`); the version is
pinned below 0.4 in pyproject.toml, and tests/ha/test_raft_port.py checks both rules."""

from __future__ import annotations

import socket
from typing import Any

import pysyncobj.tcp_server
import pysyncobj.transport
from pysyncobj.tcp_connection import TcpConnection

PRE_AUTH_BYTES = 4096  # a peer's first frame (its random key) is ~120 bytes encrypted
MAX_FRAME_BYTES = 16 << 20  # the group state is a few kB; appends come in 64 KiB batches
LINK_DEAD_S = 3


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, LINK_DEAD_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, LINK_DEAD_S * 1000)


class GuardedConnection(TcpConnection):
    """pysyncobj's connection with a bounded pre-authentication buffer and a dead-link
    timeout (see the module's docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if kwargs.get("socket") is not None:  # accepted: the socket exists already
            _tune(kwargs["socket"])

    def connect(self, host: str, port: int) -> bool:
        ok = super().connect(host, port)
        sock = self._TcpConnection__socket  # type: ignore[attr-defined]
        if sock is not None:
            try:
                _tune(sock)
            except OSError:
                pass  # connect already failed: pysyncobj retries later
        return ok

    def _authenticated(self) -> bool:
        """With a secret, a peer is known once a frame of its decrypted (the key
        exchange); without one nothing is ever known, and only the size bound holds."""
        return self.encryptor is None or bool(self.sendRandKey)

    def _TcpConnection__processRead(self) -> bool:  # noqa: N802 - pysyncobj's private name
        more = TcpConnection._TcpConnection__processRead(self)  # type: ignore[attr-defined]
        held = len(self._TcpConnection__readBuffer)  # type: ignore[attr-defined]
        if held > (MAX_FRAME_BYTES if self._authenticated() else PRE_AUTH_BYTES):
            self.disconnect()
            return False
        return more


def install() -> None:
    """Make pysyncobj build GuardedConnection for accepted and dialled connections."""
    pysyncobj.tcp_server.TcpConnection = GuardedConnection  # type: ignore[misc]
    pysyncobj.transport.TcpConnection = GuardedConnection  # type: ignore[misc]
