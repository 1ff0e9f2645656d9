"""Helpers of the store-group tests: store nodes as `lightgate store` subprocesses, their
logs compared byte by byte, their /api/v1/cluster read."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.conftest import Server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log_bytes(data_dir: Path) -> bytes:
    """The node's CommitLog, its segments concatenated (as the tests' logs stay small)."""
    segs = sorted(p for p in (data_dir / "commitlog").iterdir() if p.name.isdigit())
    return b"".join(p.read_bytes() for p in segs)


def cluster(node: Server) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{node.addrs['http']}/api/v1/cluster", timeout=5) as r:
        return json.loads(r.read())


def wait_for(pred: Any, timeout: float, what: str, step: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = pred()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - a node restarting: ask again
            last_exc = exc
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} ({last_exc!r})")


def same_log(a: Path, b: Path) -> bool:
    return log_bytes(a) == log_bytes(b)


def native_call(addr: str, code: int, header: dict[str, Any]) -> dict[str, Any]:
    """One native request (a fresh connection), from synchronous test code."""
    import trio

    from store.client import NativeClient

    async def main() -> dict[str, Any]:
        async with NativeClient.open(addr) as c:
            out, _ = await c.request(code, header)
            return out

    return trio.run(main)


def read_topic(addr: str, topic: str, partitions: int = 4) -> list[bytes]:
    """Every message body in the topic's queues, read with PULL (any node: replicas too)."""
    import trio

    from store import protocol as p
    from store.client import NativeClient

    async def main() -> list[bytes]:
        out: list[bytes] = []
        async with NativeClient.open(addr) as c:
            for part in range(partitions):
                offset = 0
                while True:
                    h, body = await c.request(p.PULL, {"queue": f"{topic}#{part}",
                                                       "offset": offset, "max": 512})
                    msgs = p.unpack_messages(h["messages"], body)
                    out += [m.body for m in msgs]
                    if not msgs:
                        break
                    offset = h["next_offset"]
        return out

    return trio.run(main)
