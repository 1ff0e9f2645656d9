"""A raw-socket MQTT peer for the conformance tests: packets out as bytes (built by hand
where they must be wrong, else by the project's codec), packets in through the tests' own
reader (`reader.py`), which shares no code with the project's codec."""

from __future__ import annotations

import socket
import struct
import time
import uuid
from typing import Any

from gateway import mqtt
from tests.conformance.reader import (
    Connack,
    Disconnect,
    Pingresp,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Reader,
    Received,
    Suback,
    Unsuback,
)

TIMEOUT = 3.0


def uid(prefix: str = "c") -> str:
    return f"{prefix}{uuid.uuid4().hex[:10]}"


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        n, b = divmod(n, 128)
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def s(text: str | bytes) -> bytes:
    """A length-prefixed string (bytes are sent as given, valid UTF-8 or not)."""
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("!H", len(data)) + data


def frame(b0: int, body: bytes) -> bytes:
    return bytes([b0]) + varint(len(body)) + body


def props(*items: bytes) -> bytes:
    """A property block from already-encoded (id + value) items."""
    body = b"".join(items)
    return varint(len(body)) + body


def connect_bytes(client_id: bytes | str = b"", flags: int = 0x02, level: int = 5,
                  name: bytes = b"MQTT", keepalive: int = 60, cprops: bytes = b"\x00",
                  payload_tail: bytes = b"") -> bytes:
    """A CONNECT built by hand: `flags` and `payload_tail` (will, user name, password)
    are taken as they are, consistent or not."""
    cid = client_id if isinstance(client_id, bytes) else client_id.encode()
    var = s(name) + bytes([level, flags]) + struct.pack("!H", keepalive)
    if level == 5:
        var += cprops
    return frame(0x10, var + s(cid) + payload_tail)


def publish_bytes(topic: bytes | str, payload: bytes = b"", qos: int = 0, pid: int = 1,
                  pprops: bytes = b"\x00", b0: int | None = None, version: int = 5) -> bytes:
    head = 0x30 | (qos << 1) if b0 is None else b0
    body = s(topic) + (struct.pack("!H", pid) if (head >> 1) & 3 else b"")
    if version == 5:
        body += pprops
    return frame(head, body + payload)


class Peer:
    """One client connection, over TCP to `port` or over `sock` (a `ws.WebSocket`).

    What the Server sends is kept as bytes (`raw_in`) and, unless `decode` is False (for
    the tests that compare the exact bytes of an answer in another protocol version), read
    into packets by `reader.Reader`: bytes it refuses fail the test where they arrive."""

    def __init__(self, port: int | None = None, version: int = 5, timeout: float = TIMEOUT,
                 decode: bool = True, sock: Any = None) -> None:
        self.sock = sock if sock is not None else \
            socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.version = version
        self.reader = Reader(version) if decode else None
        self.pending: list[Any] = []
        self.log: list[Any] = []  # every packet read, in order (pending ones too)
        self.raw_in = bytearray()

    # -- sending --------------------------------------------------------------------
    def send(self, packet: Any) -> None:
        self.sock.sendall(mqtt.encode(packet, self.version))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def connect(self, client_id: str = "", clean: bool = True, keepalive: int = 60,
                will: mqtt.Will | None = None, check: bool = True, **properties: Any) -> Any:
        self.send(mqtt.Connect(client_id=client_id, protocol_level=self.version,
                               clean_start=clean, keepalive=keepalive, will=will,
                               properties=properties))
        ack = self.recv()
        assert isinstance(ack, Connack), ack
        if check:
            assert ack.reason_code == 0, ack
        return ack

    def subscribe(self, topic_filter: str, qos: int = 0, pid: int = 1, sid: int | None = None,
                  **opts: Any) -> Any:
        p = {"subscription_identifier": sid} if sid else {}
        self.send(mqtt.Subscribe(pid, [(topic_filter, mqtt.SubscriptionOptions(qos, **opts))],
                                 p))
        return self.expect(Suback)

    def publish(self, topic: str, payload: bytes = b"", qos: int = 0, pid: int | None = None,
                retain: bool = False, **properties: Any) -> Any:
        """Publish; for QoS 1/2 wait for the PUBACK/PUBREC (and complete QoS 2)."""
        pid = pid or (1 if qos else None)
        self.send(mqtt.Publish(topic, payload, qos, retain, False, pid, properties))
        if qos == 1:
            return self.expect(Puback)
        if qos == 2:
            rec = self.expect(Pubrec)
            if rec.reason_code < 0x80:
                self.send(mqtt.Pubrel(pid))
                self.expect(Pubcomp)
            return rec
        return None

    def disconnect(self, code: int = 0, **properties: Any) -> None:
        try:
            self.send(mqtt.Disconnect(code, properties))
        except OSError:
            pass
        self.close()

    def close(self) -> None:
        self.sock.close()

    # -- receiving ------------------------------------------------------------------
    def _fill(self, timeout: float) -> None:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except ConnectionResetError:
            data = b""
        except TimeoutError:
            raise TimeoutError("no packet") from None
        if not data:
            raise ConnectionError("closed by the server")
        self.raw_in += data
        if self.reader is not None:
            packets = self.reader.feed(data)
            self.pending.extend(packets)
            self.log.extend(packets)

    def recv(self, timeout: float = TIMEOUT) -> Any:
        deadline = time.monotonic() + timeout
        while not self.pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no packet")
            self._fill(left)
        return self.pending.pop(0)

    def expect(self, cls: type, timeout: float = TIMEOUT) -> Any:
        """The next packet of this type (a `reader` class); others before it are kept
        for later."""
        if not issubclass(cls, Received):
            raise TypeError(f"{cls} is not a packet type of tests.conformance.reader")
        skipped: list[Any] = []
        try:
            while True:
                p = self.recv(timeout)
                if isinstance(p, cls):
                    return p
                skipped.append(p)
        finally:
            self.pending[:0] = skipped

    def messages(self, n: int, timeout: float = TIMEOUT, ack: bool = True) -> list[Any]:
        """The next `n` PUBLISH packets (acknowledged unless `ack` is False)."""
        out = []
        for _ in range(n):
            p = self.expect(Publish, timeout)
            out.append(p)
            if ack:
                self.ack(p)
        return out

    def ack(self, p: Any) -> None:
        if p.qos == 1:
            self.send(mqtt.Puback(p.packet_id))
        elif p.qos == 2:
            self.send(mqtt.Pubrec(p.packet_id))
            self.expect(Pubrel)
            self.send(mqtt.Pubcomp(p.packet_id))

    def quiet(self, seconds: float = 0.6, cls: type = Publish) -> bool:
        """True if no packet of type `cls` arrives within `seconds`."""
        try:
            p = self.expect(cls, seconds)
        except TimeoutError:
            return True
        self.pending.insert(0, p)
        return False

    def publishes_within(self, seconds: float) -> list[Any]:
        """Every PUBLISH that arrives within `seconds` (unacknowledged)."""
        out: list[Any] = []
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                out.append(self.expect(Publish, left))
            except TimeoutError:
                break
        return out

    def ping(self) -> None:
        """A PINGREQ answered: everything the Server sent before its PINGRESP is in."""
        self.send(mqtt.Pingreq())
        self.expect(Pingresp)

    def closed(self, timeout: float = TIMEOUT) -> bool:
        """True if the server closes the connection within `timeout`; the packets that
        came first stay in `pending` (a CONNACK or DISCONNECT with a reason code)."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._fill(left)
        except ConnectionError:
            return True
        except TimeoutError:
            return False

    def refused(self, timeout: float = TIMEOUT) -> list[Any]:
        """Assert the server closes the connection; any CONNACK/DISCONNECT it sends
        first must carry a failure code. Returns those packets."""
        assert self.closed(timeout), f"connection left open; got {self.pending}"
        for p in self.pending:
            if isinstance(p, (Connack, Disconnect)):
                assert p.reason_code >= 0x80, p
        return list(self.pending)

    def refused_with(self, code: int, timeout: float = TIMEOUT) -> None:
        """Assert the server sends exactly one CONNACK or DISCONNECT, with `code`, and
        closes the connection."""
        got = [p for p in self.refused(timeout) if isinstance(p, (Connack, Disconnect))]
        assert [p.reason_code for p in got] == [code], got


def connected(port: int, client_id: str | None = None, version: int = 5, **kw: Any) -> Peer:
    peer = Peer(port, version)
    peer.connect(client_id if client_id is not None else uid(), **kw)
    return peer


def subscribe_bytes(pid: int, filters: list[tuple[bytes | str, int]], sprops: bytes = b"\x00",
                    b0: int = 0x82, version: int = 5) -> bytes:
    """SUBSCRIBE by hand: (filter, options byte) pairs, taken as they are."""
    body = struct.pack("!H", pid) + (sprops if version == 5 else b"")
    for f, opts in filters:
        body += s(f) + bytes([opts])
    return frame(b0, body)


def unsubscribe_bytes(pid: int, filters: list[bytes | str], b0: int = 0xA2,
                      version: int = 5) -> bytes:
    body = struct.pack("!H", pid) + (b"\x00" if version == 5 else b"")
    return frame(b0, body + b"".join(s(f) for f in filters))


def sweep(port: int, version: int = 5) -> list[Any]:
    """Every kind of packet the Server sends but AUTH, as read: CONNACK, PUBLISH at each
    QoS, PUBACK, PUBREC, PUBREL, PUBCOMP, SUBACK, UNSUBACK and PINGRESP, failures among
    them (SUBACK 0x8F or 0x80, UNSUBACK 0x11, PUBREL and PUBCOMP 0x92), and in 5.0 the
    refusals: PUBACK, PUBREC, CONNACK and DISCONNECT."""
    v5 = version == 5
    sub, pub = connected(port, version=version), connected(port, version=version)
    topic = uid("sweep/")
    sub.subscribe(topic, 2)
    sub.send_raw(subscribe_bytes(2, [("a/" * 128, 0)], version=version))  # too many levels
    assert sub.expect(Suback).reason_codes == [0x8F if v5 else 0x80]
    sub.subscribe(topic + "/gone", 0, pid=3)
    sub.send(mqtt.Unsubscribe(4, [topic + "/none", topic + "/gone"]))
    sub.expect(Unsuback)
    for qos in (0, 1, 2):
        pub.publish(topic, b"x", qos, pid=qos or None)
    pub.send(mqtt.Pubrel(999))  # nothing to release: PUBCOMP (0x92 in 5.0)
    pub.expect(Pubcomp)
    for m in sub.messages(3, ack=False):
        sub.ack(m)
    sub.send(mqtt.Pubrec(998))  # nothing was sent with it: PUBREL (0x92 in 5.0)
    sub.expect(Pubrel)
    sub.ping()
    got = sub.log + pub.log
    if v5:
        pub.publish("$x/" + uid(), b"x", 1, pid=3)
        pub.publish("$x/" + uid(), b"x", 2, pid=4)
        got = sub.log + pub.log
        bad = connected(port)
        bad.send_raw(b"\x20\x02\x00\x00")
        refusing = Peer(port)
        refusing.send(mqtt.Connect(uid(), 5, properties={"authentication_method": "X-NONE"}))
        got += bad.refused() + refusing.refused()
    return got
