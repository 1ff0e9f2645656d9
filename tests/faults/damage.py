"""What the damaged-record tests share: a server on either data plane, QoS 1 publishes
pipelined, a persistent subscriber's catch-up, PULLs through the native protocol, and
the records of a segment file (to damage one where it is)."""

from __future__ import annotations

import json
import struct
import urllib.request
from pathlib import Path

import pytest

from gateway import mqtt
from serving import plane
from spark_streaming.native import StoreClient
from store import record
from tests.conftest import Server
from tests.mqtt.raw import RawClient

PLANES = ["native", "python"]
WINDOW = 64  # QoS 1 publishes in flight


def use_plane(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the servers this test starts on plane `name` (the native one where built)."""
    if name == "native":
        if plane.NATIVE is None:
            pytest.skip("the native extension is not installed")
        monkeypatch.setenv("LIGHTGATE_NATIVE", "1")
    else:
        monkeypatch.setenv("LIGHTGATE_NATIVE", "0")


def publish(srv: Server, topic: str, bodies: list[bytes], client_id: str = "pub") -> None:
    """QoS 1, WINDOW in flight, each one PUBACKed before this returns."""
    pub = RawClient(srv.port)
    pub.connect(client_id)
    waiting: set[int] = set()
    for i, body in enumerate(bodies):
        pid = i % 65535 + 1
        pub.send(mqtt.Publish(topic, body, qos=1, packet_id=pid))
        waiting.add(pid)
        while len(waiting) >= WINDOW or (i == len(bodies) - 1 and waiting):
            ack = pub.recv()
            assert isinstance(ack, mqtt.Puback)
            waiting.discard(ack.packet_id)
    pub.close()


def subscribe(srv: Server, client_id: str, topic_filter: str) -> None:
    """A persistent session reading `topic_filter` at QoS 1, left offline."""
    sub = RawClient(srv.port)
    sub.connect(client_id, clean=False)
    sub.subscribe(topic_filter, 1)
    sub.close()


def pull_all(srv: Server, queue: str, raw: bool = False) -> tuple[list[int], list[bytes]]:
    """Every message of `queue` through PULL (as the Spark source reads it, with `raw`):
    their offsets and bodies."""
    offsets: list[int] = []
    bodies: list[bytes] = []
    with StoreClient(srv.native) as client:
        end = client.queue_range(queue)[1]
        for lo, hi, header, body in client.pull_ranges(queue, 0, end, raw=raw):
            if header.get("raw"):
                for phys, size, first, count in header["runs"]:
                    del phys, size
                    offsets += range(first, first + count)
                bodies += record_bodies(body)
            else:
                from store import protocol as p
                for m in p.unpack_messages(header["messages"], body):
                    off = m.offset_in(queue)
                    if lo <= off < hi:
                        offsets.append(off)
                        bodies.append(m.body)
    return offsets, bodies


def record_bodies(data: bytes) -> list[bytes]:
    """The bodies of the records back to back in `data` (each checked)."""
    out, pos = [], 0
    while pos < len(data):
        msg = record.decode(data, pos)
        out.append(msg.body)
        pos += msg.size
    return out


def records(segment: Path) -> list[tuple[int, int]]:
    """(position, size) of each record in a segment file, as written."""
    data = segment.read_bytes()
    out, pos = [], 0
    while pos + record.FRAME.size <= len(data):
        _, size, _ = record.FRAME.unpack_from(data, pos)
        out.append((pos, size))
        pos += size
    return out


def flip(segment: Path, at: int, mask: int = 0xFF) -> None:
    raw = bytearray(segment.read_bytes())
    raw[at] ^= mask
    segment.write_bytes(bytes(raw))


def segments(data: Path) -> list[Path]:
    return sorted(p for p in (data / "commitlog").iterdir() if p.name.isdigit())


def http_json(srv: Server, path: str) -> dict:
    with urllib.request.urlopen(f"http://{srv.addrs['http']}{path}", timeout=10) as r:
        return json.loads(r.read())


def history(srv: Server, topic_filter: str) -> list[bytes]:
    """Every stored message of `topic_filter` through GET /api/v1/messages, page by page."""
    from urllib.parse import quote
    out: list[bytes] = []
    cursor = None
    while True:
        q = f"/api/v1/messages?filter={quote(topic_filter, safe='')}&since=earliest&limit=500"
        if cursor:
            q += f"&cursor={quote(cursor, safe='')}"
        page = http_json(srv, q)
        out += [m["payload"].encode() for m in page["messages"]]
        cursor = page["next"]
        if not cursor:
            return out


U32 = struct.Struct(">I")
