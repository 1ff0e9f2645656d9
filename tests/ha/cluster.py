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
from tests.ha.netns import Net


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


RAFT_PORT = 7900  # in a test network each node has addresses of its own


class Group:
    """Three (or more) `lightgate store` nodes with the embedded controller; on loopback,
    or each in a network namespace of `net` (tests.ha.netns) with the group secret."""

    def __init__(self, root: Path, n: int = 3, *extra: str, net: Net | None = None) -> None:
        self.net = net
        if net is None:
            self.raft = [f"127.0.0.1:{reserved_port()}" for _ in range(n)]
        else:
            self.raft = [f"{net.ip(i, 'raft')}:{RAFT_PORT}" for i in range(n)]
        root.mkdir(parents=True, exist_ok=True)
        self.secret = root / "group.secret"
        self.secret.write_text(f"{os.urandom(16).hex()}\n")
        extra = ("--raft-secret", f"@{self.secret}", *extra)
        self.dirs = [root / f"s{i}" for i in range(n)]
        self.nodes: list[Server] = []
        for i in range(n):
            place: dict[str, Any] = {} if net is None else {
                "host": net.ip(i, "data"), "http_host": net.ip(i, "mgmt"),
                "prefix": net.prefix(i)}
            node = Server(self.dirs[i], "--raft", self.raft[i], "--group-peers",
                          ",".join(self.raft), *extra, command="store", **place)
            self.nodes.append(node)

    def start(self) -> Group:
        for node in self.nodes:
            node.start()
        return self

    @property
    def addrs(self) -> str:
        return ",".join(f"{n.host}:{n.native_port}" for n in self.nodes)

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

    def replicas_leader_last(self, m: int) -> list[int]:
        """Master m's replicas, the controller's Raft leader last: a test that stops or
        kills the first tests a replica's loss, and the master's lease goes on without a
        Raft election (one may outlast a short lease on a loaded machine, and the master
        steps down)."""
        leader = cluster(self.nodes[m])["controller"]["leader"]
        return sorted((i for i in range(len(self.nodes)) if i != m),
                      key=lambda i: self.raft[i] == leader)

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
