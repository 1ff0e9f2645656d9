"""What Python and trio themselves cost per message and per idle connection, with none of
Lightgate's code: the floors beneath any figure Lightgate's own code can reach.

    .venv/bin/python bench/floors.py cpu     # CPU us/msg at 2,000 msg/s, six forwarders
    .venv/bin/python bench/floors.py idle    # Python heap per idle connection under trio

`cpu`: a minimal MQTT 3.1.1 forwarder (CONNECT, SUBSCRIBE to exact topics, QoS 0 PUBLISH,
PINGREQ), each PUBLISH read forwarded as received, driven by the same load as the
`cpu_at_rate` row of bench/mqtt_bench.py (one publisher at 2,000 msg/s, one subscriber,
separate processes), and the same row for Mosquitto and `lightgate serve`. Loops:
  raw       a select.epoll loop, no trio
  task      trio, a task per connection, os.read + wait_readable (Lightgate's read path)
  driver    trio, one task over an inner epoll for every connection
  *store    the same, storing every message: one record per message (CRC32) in one
            os.write per read, two index entries each in one RocksDB WriteBatch, WAL off
`idle`: tracemalloc of 2,000 connections to a trio server whose handler only waits for
its socket (`bare`), or also holds a nursery and a keepalive deadline (`nursery`).
Prints one JSON object.
"""

from __future__ import annotations

import gc
import json
import os
import select
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
import zlib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODES = ["raw", "rawstore", "task", "taskstore", "driver", "driverstore"]


# -- the forwarder (runs in its own process: `floors.py serve MODE PORT`) --------------
class _Store:
    """A record per message in one os.write per read; two index entries each in one
    WriteBatch (exact topic and first level), as Lightgate's CommitLog and index do."""

    HDR = struct.Struct(">QQH")
    FRAME = struct.Struct(">III")
    ENT = struct.Struct(">QIQ")
    U64 = struct.Struct(">Q")

    def __init__(self) -> None:
        from rocksdict import Options, Rdict, WriteOptions

        d = tempfile.mkdtemp(prefix="floors-")
        self.db = Rdict(d + "/index", Options(raw_mode=True))
        self.wo = WriteOptions()
        self.wo.disable_wal = True
        self.fd = os.open(d + "/log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        self.pos = 0
        self.next: dict[bytes, int] = {}

    def append(self, msgs: list[tuple[bytes, bytes]]) -> None:
        from rocksdict import WriteBatch

        recs, wb, ts = [], WriteBatch(raw_mode=True), time.time_ns() // 1_000_000
        for topic, packet in msgs:
            rest = self.HDR.pack(ts, ts, len(topic)) + topic + packet
            rec = self.FRAME.pack(0x4C474D31, 12 + len(rest), zlib.crc32(rest)) + rest
            for q in (topic, topic.split(b"/")[0]):
                off = self.next.get(q, 0)
                self.next[q] = off + 1
                wb.put(b"q" + q + b"\0" + self.U64.pack(off), self.ENT.pack(self.pos, len(rec), ts))
            recs.append(rec)
            self.pos += len(rec)
        os.write(self.fd, b"".join(recs))
        self.db.write(wb, self.wo)


class _Conn:
    subs: dict[bytes, list[_Conn]] = {}
    store: _Store | None = None

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.buf = b""
        self.out: list[bytes] = []

    def handle(self, data: bytes) -> None:
        buf, i, n = self.buf + data, 0, 0
        touched, stored = [], []
        while True:
            n = len(buf)
            if i + 2 > n:
                break
            length, mult, j = 0, 1, i + 1
            while j < n:
                length += (buf[j] & 127) * mult
                mult <<= 7
                j += 1
                if not buf[j - 1] & 128:
                    break
            else:
                break
            if j + length > n:
                break
            kind, packet, body = buf[i] >> 4, buf[i:j + length], j - i
            i = j + length
            if kind == 1:
                self.sock.send(b"\x20\x02\x00\x00")
            elif kind == 8:
                tl = int.from_bytes(packet[body + 2:body + 4], "big")
                _Conn.subs.setdefault(packet[body + 4:body + 4 + tl], []).append(self)
                self.sock.send(b"\x90\x03" + packet[body:body + 2] + b"\x00")
            elif kind == 3:
                tl = int.from_bytes(packet[body:body + 2], "big")
                topic = packet[body + 2:body + 2 + tl]
                stored.append((topic, packet))
                for c in _Conn.subs.get(topic, ()):
                    c.out.append(packet)
                    touched.append(c)
            elif kind == 12:
                self.sock.send(b"\xd0\x00")
        self.buf = buf[i:]
        if stored and _Conn.store is not None:
            _Conn.store.append(stored)
        for c in touched:
            if c.out:
                data, c.out = b"".join(c.out), []
                try:
                    c.sock.send(data)
                except BlockingIOError:
                    pass


def _accept(ls: socket.socket) -> _Conn:
    s, _ = ls.accept()
    s.setblocking(False)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return _Conn(s)


def _epoll_pass(ep: select.epoll, ls: socket.socket, conns: dict[int, _Conn],
                timeout: float) -> None:
    for fd, _ in ep.poll(timeout):
        if fd == ls.fileno():
            c = _accept(ls)
            conns[c.fd] = c
            ep.register(c.fd, select.EPOLLIN)
            continue
        c = conns[fd]
        try:
            data = c.sock.recv(65536)
        except BlockingIOError:
            continue
        if not data:
            ep.unregister(fd)
            c.sock.close()
            del conns[fd]
            continue
        c.handle(data)


def serve(mode: str, port: int) -> None:
    import trio

    if mode.endswith("store"):
        _Conn.store = _Store()
    loop = mode.removesuffix("store")
    if loop == "task":
        async def handler(stream: trio.SocketStream) -> None:
            c = _Conn(stream.socket._sock)  # type: ignore[attr-defined]
            while True:
                try:
                    data = os.read(c.fd, 65536)
                except BlockingIOError:
                    await trio.lowlevel.wait_readable(c.fd)
                    continue
                if not data:
                    return
                c.handle(data)

        trio.run(trio.serve_tcp, handler, port)
        return
    ls = socket.create_server(("127.0.0.1", port))
    ls.setblocking(False)
    ep = select.epoll()
    ep.register(ls.fileno(), select.EPOLLIN)
    conns: dict[int, _Conn] = {}
    if loop == "raw":
        while True:
            _epoll_pass(ep, ls, conns, -1)

    async def driver() -> None:
        while True:
            await trio.lowlevel.wait_readable(ep.fileno())
            _epoll_pass(ep, ls, conns, 0)

    trio.run(driver)


# -- the measurements ------------------------------------------------------------------
def cpu_floor(rounds: int) -> dict[str, Any]:
    from bench.mqtt.brokers import Broker, free_port, start_broker
    from bench.mqtt.procfs import cpu_seconds
    from bench.mqtt.scenarios import _fixed_rate

    def measure(b: Broker) -> float:
        c0 = cpu_seconds([p.pid for p in b.procs])
        res = _fixed_rate(b, 2000, 5, 0)
        used = cpu_seconds([p.pid for p in b.procs]) - c0
        return round(used * 1e6 / max(1, res.get("received") or 1), 1)

    out: dict[str, list[float]] = {}
    for r in range(rounds):
        for name in ["mosquitto", *MODES, "lightgate-async"]:
            print(f"[floors] round {r + 1}/{rounds}: {name}", file=sys.stderr, flush=True)
            if name in ("mosquitto", "lightgate-async"):
                b = start_broker(name)
            else:
                port = free_port()
                proc = subprocess.Popen([sys.executable, __file__, "serve", name, str(port)])
                time.sleep(1.0)
                b = Broker(name, port, [proc])
            try:
                out.setdefault(name, []).append(measure(b))
            finally:
                b.stop()
    return {"cpu_us_per_msg_at_2000": out}


def idle_floor(n: int = 2000) -> dict[str, Any]:
    import trio

    result: dict[str, int] = {}
    for mode in ("bare", "nursery"):
        async def handler(stream: trio.SocketStream, mode: str = mode) -> None:
            fd = stream.socket.fileno()
            if mode == "bare":
                while True:
                    await trio.lowlevel.wait_readable(fd)
                    if not os.read(fd, 4096):
                        return
            async with trio.open_nursery():
                while True:
                    with trio.move_on_after(90):
                        await trio.lowlevel.wait_readable(fd)
                    if not os.read(fd, 4096):
                        return

        async def main(mode: str = mode, handler: Any = handler) -> None:
            socks: list[socket.socket] = []

            def connect(port: int, count: int, done: Any) -> None:
                socks.extend(socket.create_connection(("127.0.0.1", port))
                             for _ in range(count))
                done()

            async def batch(port: int, count: int) -> None:
                ev, token = trio.Event(), trio.lowlevel.current_trio_token()
                threading.Thread(target=connect, args=(
                    port, count, lambda: token.run_sync_soon(ev.set))).start()
                await ev.wait()
                await trio.sleep(0.5)
                gc.collect()

            async with trio.open_nursery() as nursery:
                listeners = await nursery.start(trio.serve_tcp, handler, 0)
                port = listeners[0].socket.getsockname()[1]
                await batch(port, 20)  # warm-up
                tracemalloc.start()
                before = tracemalloc.take_snapshot()
                await batch(port, n)
                after = tracemalloc.take_snapshot()
                tracemalloc.stop()
                result[mode] = round(sum(s.size_diff for s in after.compare_to(
                    before, "filename")) / n)
                nursery.cancel_scope.cancel()
            for s in socks:
                s.close()

        trio.run(main)
    return {"idle_bytes_per_connection": result, "connections": n}


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1:2] == ["idle"]:
        print(json.dumps(idle_floor()))
    elif sys.argv[1:2] == ["cpu"]:
        print(json.dumps(cpu_floor(int(sys.argv[2]) if len(sys.argv) > 2 else 2)))
    else:
        sys.exit(__doc__)
