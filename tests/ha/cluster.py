"""Helpers of the store-group tests: store nodes as `lightgate store` subprocesses, their
logs compared byte by byte, their /api/v1/cluster read."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.conftest import Server, reserved_port


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


class Group:
    """Three (or more) `lightgate store` nodes with the embedded controller."""

    def __init__(self, root: Path, n: int = 3, *extra: str) -> None:
        self.raft = [f"127.0.0.1:{reserved_port()}" for _ in range(n)]
        self.dirs = [root / f"s{i}" for i in range(n)]
        self.nodes: list[Server] = []
        for i in range(n):
            peers = ",".join(r for j, r in enumerate(self.raft) if j != i)
            node = Server(self.dirs[i], "--raft", self.raft[i], "--group-peers", peers,
                          *extra, command="store")
            self.nodes.append(node)

    def start(self) -> Group:
        for node in self.nodes:
            node.start()
        return self

    @property
    def addrs(self) -> str:
        return ",".join(f"127.0.0.1:{n.native_port}" for n in self.nodes)

    def roles(self) -> list[str | None]:
        out: list[str | None] = []
        for node in self.nodes:
            try:
                out.append(cluster(node)["role"] if node.proc is not None else None)
            except OSError:
                out.append(None)
        return out

    def master(self, timeout: float = 15.0) -> int:
        """The index of the one master (waits for an election)."""
        def one() -> int | None:
            roles = self.roles()
            return roles.index("master") + 1 if roles.count("master") == 1 else None
        return int(wait_for(one, timeout, "one master")) - 1

    def insync(self, i: int) -> list[str]:
        """Node i's in-sync set as master, if the controller has recorded it too (the
        set elections choose from); else []."""
        st = cluster(self.nodes[i])
        mine = sorted(st.get("insync", []))
        return mine if sorted(st["controller"]["insync"]) == mine else []

    def stop(self) -> None:
        for node in self.nodes:
            if node.proc is not None:
                node.kill()
        dump = os.environ.get("LIGHTGATE_HA_DUMP")  # a directory for the nodes' logs
        if dump:
            for i, node in enumerate(self.nodes):
                Path(dump, f"store{i}.log").write_text(node.logs())
