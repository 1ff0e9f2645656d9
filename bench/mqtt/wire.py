"""MQTT 3.1.1 as the load generator speaks it on raw sockets: packets encoded once with our
codec (gateway.mqtt), frames split by their fixed header instead of decoded, so that the
clients stay cheaper than the broker they measure. With set_tls every connection is TLS
(Python's ssl): reads are batched over TLS records (recv_batch) as plain reads are, and a
non-blocking connection's handshake goes on under its selector (handshake)."""

from __future__ import annotations

import errno
import os
import selectors
import socket
import ssl
import time
from typing import Any

from gateway import mqtt

# Linux: pick the source port at connect() time, not bind(), so each source address
# gets the whole ephemeral range per destination (Python may not export the constant).
IP_BIND_ADDRESS_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)


def split_frames(buf: bytes, bodies: bool) -> tuple[int, list[tuple[int, bytes]], int]:
    """Walk the complete MQTT packets at the start of `buf` without decoding them.

    Returns (PUBLISH packets seen, [(first byte, body)] when `bodies`, bytes consumed).
    About 10x cheaper than a full decode, so counting is not what limits a run.
    """
    n, p, count = len(buf), 0, 0
    out: list[tuple[int, bytes]] = []
    while p + 2 <= n:
        q, mult, length = p + 1, 1, 0
        while True:  # remaining length: a varint of at most 4 bytes
            if q >= n:
                return count, out, p
            byte = buf[q]
            q += 1
            length += (byte & 0x7F) * mult
            if byte < 0x80:
                break
            mult <<= 7
        end = q + length
        if end > n:
            break
        b0 = buf[p]
        if b0 >> 4 == 3:
            count += 1
        if bodies:
            out.append((b0, buf[q:end]))
        p = end
    return count, out, p


def publish_fields(b0: int, body: bytes) -> tuple[bytes, bytes]:
    """(packet id bytes, payload) of an MQTT 3.1.1 PUBLISH body."""
    pos = 2 + (body[0] << 8 | body[1])
    if b0 & 0x06:
        return body[pos:pos + 2], body[pos + 2:]
    return b"", body[pos:]


def puback(pid: bytes) -> bytes:
    return b"\x40\x02" + pid


# The clients' keepalive: 0 (none) unless the broker under test refuses it (rumqttd
# does); the load generator's workers are forked, so they see what the runner set.
_keepalive = 0


def set_keepalive(seconds: int) -> None:
    global _keepalive
    _keepalive = seconds


# TLS for every client connection when set (the runner's, before the workers fork).
_tls: ssl.SSLContext | None = None


def set_tls(ctx: ssl.SSLContext | None) -> None:
    global _tls
    _tls = ctx


def dial(port: int, timeout: float = 30) -> socket.socket:
    """A blocking connection to the broker, TLS handshake done when set_tls asked for it."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return _tls.wrap_socket(s, server_hostname="127.0.0.1") if _tls else s


def connect_packet(client_id: str, clean: bool = True) -> bytes:
    return mqtt.encode(mqtt.Connect(client_id=client_id, clean_start=clean,
                                    keepalive=_keepalive), 4)


def _recv_until(s: socket.socket, want: type, deadline: float) -> Any:
    """Blocking read until a packet of type `want` arrives (bounded by deadline)."""
    dec = mqtt.Decoder(server=False, version=4)
    while time.monotonic() < deadline:
        s.settimeout(max(0.1, deadline - time.monotonic()))
        data = s.recv(65536)
        if not data:
            raise ConnectionError("broker closed the connection")
        for p in dec.feed(data):
            if isinstance(p, want):
                return p
    raise TimeoutError(f"no {want.__name__} in time")


def connect(port: int, client_id: str, clean: bool = True, timeout: float = 30) -> socket.socket:
    s = dial(port, timeout)
    s.sendall(connect_packet(client_id, clean))
    ack = _recv_until(s, mqtt.Connack, time.monotonic() + timeout)
    if ack.reason_code != 0:
        raise RuntimeError(f"CONNACK refused: {ack.reason_code}")
    return s


def subscribe(s: socket.socket, topic_filter: str, qos: int, timeout: float = 30) -> None:
    s.sendall(mqtt.encode(mqtt.Subscribe(1, [(topic_filter, mqtt.SubscriptionOptions(qos))]),
                          4))
    ack = _recv_until(s, mqtt.Suback, time.monotonic() + timeout)
    if ack.reason_codes[0] >= 0x80:
        raise RuntimeError(f"SUBACK refused {topic_filter}: {ack.reason_codes}")


def nb_connect(port: int, source: str | None) -> socket.socket:
    """Start a non-blocking TCP connect (optionally from a given 127.x.y.z address).
    Register it for EVENT_WRITE; once that fires, handshake() says when it is ready for
    its CONNECT. With TLS the socket is wrapped now (the same object throughout), its
    handshake left for handshake()."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setblocking(False)
    if source:
        s.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
        s.bind((source, 0))
    if _tls:
        s = _tls.wrap_socket(s, server_hostname="127.0.0.1", do_handshake_on_connect=False)
    s.connect_ex(("127.0.0.1", port))
    return s


def handshaking(s: socket.socket) -> bool:
    """A TLS connection whose handshake is not over: its events are handshake()'s."""
    return isinstance(s, ssl.SSLSocket) and s.version() is None


def handshake(s: socket.socket) -> int:
    """Advance a connection from nb_connect, on its EVENT_WRITE (the TCP connect is over)
    and on every event while handshaking(s): 0 once it is ready for its CONNECT, else the
    selector event to wait for. Raises OSError if the connect or the handshake failed."""
    if err := s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
        raise OSError(err, os.strerror(err))
    if not isinstance(s, ssl.SSLSocket):
        return 0
    try:
        s.do_handshake()
    except ssl.SSLWantReadError:
        return selectors.EVENT_READ
    except ssl.SSLWantWriteError:
        return selectors.EVENT_WRITE
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:  # an event before the TCP connect was over
            return selectors.EVENT_WRITE
        raise
    return 0


# The most plaintext one TLS record holds: each TLS read asks for that much, not for the
# whole `limit` (the ssl module allocates the full size for every read).
TLS_RECORD = 16384


def recv_batch(s: socket.socket, limit: int) -> bytes:
    """Up to `limit` bytes of what the socket has: one recv on a plain socket. Over TLS
    one recv yields one record (16 kB at most), so it reads on without blocking until
    nothing is left (nor held decrypted in the TLS object, which a selector cannot see)
    and a TLS client reads in batches as large as a plain one. A non-blocking socket
    with nothing to read raises BlockingIOError on both (TLS: also when only a TLS
    message with no data arrived); b"" is the end of the connection."""
    if not isinstance(s, ssl.SSLSocket):
        return s.recv(limit)
    try:
        data = s.recv(min(limit, TLS_RECORD))
    except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
        raise BlockingIOError(errno.EAGAIN, "nothing to read") from None
    if not data:
        return data
    timeout = s.gettimeout()
    parts, n = [data], len(data)
    if timeout != 0.0:
        s.setblocking(False)
    try:
        while n < limit or s.pending():
            more = s.recv(max(min(limit - n, TLS_RECORD), s.pending()))
            if not more:
                break
            parts.append(more)
            n += len(more)
    except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
        pass
    finally:
        if timeout != 0.0:
            s.settimeout(timeout)
    return b"".join(parts)


def acks_in(rest: bytes, data: bytes) -> tuple[int, bytes]:
    """PUBACKs in what a publisher received (after `rest`, a partial packet from the last
    read), and the new partial rest."""
    if not data:
        raise ConnectionError("broker closed the publisher")
    buf = rest + data
    _, frames, used = split_frames(buf, True)
    return sum(1 for b0, _ in frames if b0 >> 4 == 4), buf[used:]


def read_acks(s: socket.socket, acked: int, rest: bytes) -> tuple[int, bytes]:
    """PUBACKs waiting on a publisher's socket, without blocking."""
    s.setblocking(False)
    try:
        while True:
            n, rest = acks_in(rest, recv_batch(s, 65536))
            acked += n
    except BlockingIOError:
        pass
    return acked, rest
