"""What the hostile-client tests measure: the server's RSS from /proc while an attack
runs, and how a well-behaved client fares meanwhile (round trips of its own messages
through the server, against its baseline measured in the same test), with the attacker
in a process of its own so that it takes no time from the measuring one."""

from __future__ import annotations

import base64
import os
import re
import select
import socket
import ssl
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway import mqtt
from tests.conftest import Server
from tests.mqtt.raw import RawClient

MiB = 1024 * 1024
STALL_S = 0.5  # a round trip slower than this is a stall
NO_ANSWER_S = 5.0  # the probe's wait for its own message


def metrics(srv: Server) -> str:
    with urllib.request.urlopen(f"http://{srv.addrs['http']}/metrics", timeout=10) as r:
        return r.read().decode()


def metric(text: str, name: str, label: str = "") -> float:
    """A value of /metrics' text: `name`, with the label value `label` if given."""
    pattern = re.escape(name) + (r'\{[^}]*"' + re.escape(label) + r'"\}' if label else "")
    m = re.search(r"^" + pattern + r" (-?[0-9.e+]+)$", text, re.M)
    assert m, f"{name} {label} not in /metrics"
    return float(m.group(1))


def rss(pid: int) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) * 1024


class RssPeak:
    """The highest RSS of a process, sampled every 50 ms until stopped."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, rss(pid), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.peak = max(self.peak, rss(self.pid))
            except FileNotFoundError:  # the server is gone
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(5)
        return self.peak


@dataclass
class Latency:
    """Round trips of a well-behaved client, in seconds."""

    samples: list[float]

    @property
    def p50(self) -> float:
        return statistics.median(self.samples)

    @property
    def worst(self) -> float:
        return max(self.samples)

    def __str__(self) -> str:
        return (f"p50 {self.p50 * 1000:.2f} ms, worst {self.worst * 1000:.1f} ms over "
                f"{len(self.samples)} round trips")


class Probe:
    """A well-behaved client: publishes to a topic of its own and times each message's
    way back, one every `interval` seconds, in a thread of its own."""

    def __init__(self, port: int, interval: float = 0.02) -> None:
        self.interval = interval
        self.topic = f"probe/{os.urandom(4).hex()}"
        self.client = RawClient(port, version=5, timeout=NO_ANSWER_S)
        self.client.connect(self.topic.replace("/", "-"))
        self.client.subscribe(self.topic, 0)
        self._samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.measure(0.5)  # warm

    def _one(self) -> float:
        started = time.perf_counter()
        self.client.send(mqtt.Publish(self.topic, b"ping", qos=0))
        try:
            while not isinstance(self.client.recv(), mqtt.Publish):
                pass
        except TimeoutError:
            return NO_ANSWER_S
        return time.perf_counter() - started

    def _run(self, until: float | None) -> None:
        while not self._stop.is_set() and (until is None or time.monotonic() < until):
            self._samples.append(self._one())
            time.sleep(self.interval)

    def measure(self, seconds: float) -> Latency:
        """Round trips for `seconds`, here and now."""
        self._samples = []
        self._run(time.monotonic() + seconds)
        return Latency(self._samples)

    def start(self) -> None:
        """Measure in the background until `stop`."""
        self._samples, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._run, args=(None,), daemon=True)
        self._thread.start()

    def stop(self) -> Latency:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(NO_ANSWER_S + 1)
        return Latency(self._samples)

    def close(self) -> None:
        self.client.close()


def assert_unharmed(baseline: Latency, during: Latency) -> None:
    """A well-behaved client's round trips during an attack: the median within twice
    the baseline's, and none stalled."""
    assert during.p50 <= 2 * baseline.p50, f"baseline {baseline}; during the attack {during}"
    assert during.worst <= STALL_S, f"baseline {baseline}; during the attack {during}"


def ws_upgrade(s: socket.socket, host: str) -> None:
    """The WebSocket upgrade (subprotocol mqtt) to `host` (HOST:PORT), by hand."""
    key = base64.b64encode(os.urandom(16)).decode()
    s.sendall(f"GET /mqtt HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\n"
              f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
              "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: mqtt\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(4096)
        assert chunk, "closed during the upgrade"
        head += chunk
    assert head.startswith(b"HTTP/1.1 101"), head


def ws_frame(payload: bytes) -> bytes:
    """A client's binary frame, masked with a zero key: the payload goes as is."""
    n = len(payload)
    size = bytes([0x80 | n]) if n < 126 else b"\xfe" + n.to_bytes(2, "big") if n < 65536 \
        else b"\xff" + n.to_bytes(8, "big")
    return b"\x82" + size + b"\0\0\0\0" + payload


def _open(port: int, transport: str) -> tuple[socket.socket, Callable[[bytes], bytes]]:
    """A connection over `transport` (tcp, ws, tls) with a small receive buffer (so the
    answers stay on the server's side), and how a payload is framed on it."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(5)
    s.connect(("127.0.0.1", port))
    if transport == "tls":
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        s = ctx.wrap_socket(s, server_hostname="localhost")
    if transport == "ws":
        ws_upgrade(s, f"127.0.0.1:{port}")
        return s, ws_frame
    return s, lambda payload: payload


def flood(port: int, packet: bytes, seconds: float, read_every: float, read_bytes: int,
          out: Any, transport: str = "tcp", version: int = 5,
          properties: dict[str, Any] | None = None, repeat: bool = True) -> None:
    """An attacker, in its own process: connect over `transport` (tcp, ws, tls; v5 with
    `properties`), then send `packet` over and over (once, unless `repeat`) for
    `seconds`, reading `read_bytes` every `read_every` seconds (0: never). Puts what
    happened on `out`: bytes sent, bytes read, and after how long the server closed the
    connection (None: it did not)."""
    s, frame = _open(port, transport)
    s.sendall(frame(mqtt.encode(mqtt.Connect(client_id=f"flood-{os.urandom(4).hex()}",
                                             protocol_level=version, clean_start=True,
                                             properties=properties or {}), version)))
    assert s.recv(4096), "no CONNACK"
    s.setblocking(False)
    chunk = frame(packet * max(1, 16384 // len(packet))) if repeat else frame(packet)
    started = time.monotonic()
    deadline, next_read = started + seconds, started + read_every
    sent = got = pos = 0
    closed: float | None = None
    while closed is None and (now := time.monotonic()) < deadline:
        if read_every and now >= next_read:
            next_read += read_every
            want, until = read_bytes, now + 0.5
            while want > 0 and time.monotonic() < until:
                try:
                    data = s.recv(min(want, 16384))
                except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                    select.select([s], [], [], 0.05)
                    continue
                except OSError:
                    data = b""
                if not data:
                    closed = now - started
                    break
                got += len(data)
                want -= len(data)
        if not chunk:  # sent once: wait out the time
            time.sleep(0.05)
            continue
        _, writable, _ = select.select([], [s], [], 0.05)
        if writable:
            try:
                n = s.send(chunk[pos:])
            except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                continue
            except OSError:
                closed = time.monotonic() - started
                break
            sent += n
            pos = (pos + n) % len(chunk)
            if not repeat and sent >= len(chunk):
                chunk = b""
    s.close()
    out.put({"sent": sent, "read": got, "closed_after": closed})
