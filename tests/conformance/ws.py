"""A small WebSocket client (RFC 6455) over a plain socket, for MQTT over WebSocket
(MQTT chapter 6). Written here rather than taken from a library, so that the tests choose
every frame (opcode, fragmentation, where one packet ends) and see every frame the Server
sends, and so that a bug of the WebSocket library under the Server cannot hide on both
sides."""

from __future__ import annotations

import base64
import hashlib
import os
import socket
import ssl
import struct

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455 §1.3
CONTINUATION, TEXT, BINARY, CLOSE, PING, PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA


class HandshakeRefused(Exception):
    def __init__(self, status: int, headers: dict[str, str]) -> None:
        super().__init__(f"upgrade answered {status}")
        self.status, self.headers = status, headers


class WebSocket:
    """One client connection. `sendall`/`recv`/`settimeout`/`close` make it usable as
    the socket of a `wire.Peer`: every `sendall` is one binary frame, `recv` hands out
    the payload of the next data frame."""

    def __init__(self, port: int, subprotocols: tuple[str, ...] = ("mqtt",),
                 path: str = "/mqtt", timeout: float = 3.0,
                 tls: ssl.SSLContext | None = None) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        if tls is not None:  # secure WebSocket
            self.sock = tls.wrap_socket(self.sock, server_hostname="localhost")
        self.frames: list[tuple[bool, int, bytes]] = []  # (FIN, opcode, payload) received
        self.close_code: int | None = None
        self._buf = b""
        key = base64.b64encode(os.urandom(16))
        request = [f"GET {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Upgrade: websocket",
                   "Connection: Upgrade", f"Sec-WebSocket-Key: {key.decode()}",
                   "Sec-WebSocket-Version: 13"]
        if subprotocols:
            request.append(f"Sec-WebSocket-Protocol: {', '.join(subprotocols)}")
        self.sock.sendall(("\r\n".join(request) + "\r\n\r\n").encode())
        while b"\r\n\r\n" not in self._buf:
            data = self.sock.recv(4096)
            if not data:
                raise ConnectionError("closed during the WebSocket handshake")
            self._buf += data
        head, self._buf = self._buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        self.status = int(lines[0].split()[1])
        self.headers = {k.strip().lower(): v.strip()
                        for k, v in (line.split(":", 1) for line in lines[1:])}
        if self.status != 101:
            self.sock.close()
            raise HandshakeRefused(self.status, self.headers)
        accept = base64.b64encode(hashlib.sha1(key + GUID).digest()).decode()
        assert self.headers.get("sec-websocket-accept") == accept, self.headers
        self.subprotocol = self.headers.get("sec-websocket-protocol")

    # -- frames (RFC 6455 §5.2) -------------------------------------------------------
    def send_frame(self, opcode: int, payload: bytes, fin: bool = True) -> None:
        """One frame, masked as a client's must be (§5.3)."""
        head = bytes([(0x80 if fin else 0) | opcode])
        n = len(payload)
        if n < 126:
            head += bytes([0x80 | n])
        elif n < 1 << 16:
            head += bytes([0x80 | 126]) + struct.pack("!H", n)
        else:
            head += bytes([0x80 | 127]) + struct.pack("!Q", n)
        mask = os.urandom(4)
        self.sock.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    def _read(self, n: int) -> bytes:
        while len(self._buf) < n:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("closed by the server")
            self._buf += data
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def read_frame(self) -> tuple[bool, int, bytes]:
        b0, b1 = self._read(2)
        assert not b0 & 0x70, f"reserved frame bits set without an extension: {b0:08b}"
        assert not b1 & 0x80, "a server's frame is never masked (RFC 6455 §5.1)"
        n = b1 & 0x7F
        if n == 126:
            n = struct.unpack("!H", self._read(2))[0]
        elif n == 127:
            n = struct.unpack("!Q", self._read(8))[0]
        frame = (bool(b0 & 0x80), b0 & 0x0F, self._read(n))
        self.frames.append(frame)
        return frame

    # -- as a socket --------------------------------------------------------------------
    def sendall(self, data: bytes) -> None:
        self.send_frame(BINARY, data)

    def recv(self, _size: int = 65536) -> bytes:
        """The payload of the next data frame; b"" once the Server closed (its close
        frame answered). A text frame from the Server fails the test [MQTT-6.0.0-1]."""
        while True:
            try:
                _fin, opcode, payload = self.read_frame()
            except ConnectionError:
                return b""
            if opcode == TEXT:
                raise AssertionError(f"the Server sent a text frame {payload!r} "
                                     "[MQTT-6.0.0-1]")
            if opcode in (BINARY, CONTINUATION) and payload:
                return payload
            if opcode == CLOSE:
                self.close_code = struct.unpack("!H", payload[:2])[0] if payload else None
                try:
                    self.send_frame(CLOSE, payload[:2])
                except OSError:
                    pass
                return b""
            if opcode == PING:
                self.send_frame(PONG, payload)

    def tcp_closed(self, timeout: float = 3.0) -> bool:
        """True if the TCP connection under it ends within `timeout` (what is left of the
        WebSocket conversation is read and dropped)."""
        self.sock.settimeout(timeout)
        try:
            while self.sock.recv(65536):
                pass
        except (ConnectionResetError, ssl.SSLError):
            pass
        except TimeoutError:
            return False
        return True

    def settimeout(self, timeout: float) -> None:
        self.sock.settimeout(timeout)

    def close(self) -> None:
        self.sock.close()
