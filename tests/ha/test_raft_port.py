"""The Raft port as an attacker sees it: a stranger's frames never reach a deserialiser
(a pickle that would run code does nothing), an oversized frame is cut off before it is
buffered, the port binds only the address given, and a node reached under another
address (a proxy, NAT) than the one it binds works through --raft-advertise."""

from __future__ import annotations

import os
import pickle
import socket
import struct
import threading
import time
import zlib
from pathlib import Path

import pytest

from tests.conftest import Server, reserved_port
from tests.ha.cluster import Group, cluster, wait_for
from tests.proc import rss_kb


class _RunsCode:
    """Unpickled, this would create `path`."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.path}",))


def _frame(obj: object) -> bytes:
    """A frame as pysyncobj's unencrypted transport writes one."""
    data = zlib.compress(pickle.dumps(obj, protocol=2), 3)
    return struct.pack("i", len(data)) + data


@pytest.fixture
def group(tmp_path: Path):
    g = Group(tmp_path, 3, "--replication", "sync", "--min-insync", "2").start()
    m = g.master(20)
    wait_for(lambda: len(g.insync(m)) == 3, 15, "all three in sync")
    yield g
    g.stop()


def test_a_strangers_pickle_runs_nothing(group: Group, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = _RunsCode(marker)
    for raft in group.raft:
        host, port = raft.rsplit(":", 1)
        # As a first frame, as a node's address, and as a Raft message after it.
        for frames in ([_frame(payload)], [_frame(raft), _frame(payload)],
                       [_frame({"type": "append_entries", "term": 99, "x": payload})]):
            with socket.create_connection((host, int(port)), timeout=5) as s:
                for f in frames:
                    try:
                        s.sendall(f)
                    except OSError:
                        break
                time.sleep(0.2)
    time.sleep(1.0)
    assert not marker.exists(), "a stranger's frame was unpickled"
    m = group.master(10)
    assert len(group.insync(m)) == 3  # the group carries on as before


def test_an_oversized_frame_is_cut_off_before_it_is_buffered(group: Group) -> None:
    pids = [n.proc.pid for n in group.nodes]
    before = [rss_kb(pid) for pid in pids]
    closed = 0
    for raft in group.raft:
        host, port = raft.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(struct.pack("i", 1 << 30))  # "a 1 GiB frame follows"
            chunk = b"\0" * 65536
            try:
                for _ in range(256):  # 16 MiB, at most
                    s.sendall(chunk)
            except OSError:
                closed += 1
    assert closed == len(group.raft), "a node kept reading a stranger's oversized frame"
    after = [rss_kb(pid) for pid in pids]
    assert all(a - b < 8 * 1024 for a, b in zip(after, before, strict=True)), (before, after)
    m = group.master(10)
    assert len(group.insync(m)) == 3


def test_the_raft_port_binds_only_the_address_given(group: Group) -> None:
    port = int(group.raft[0].rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
    with pytest.raises(OSError):  # another loopback address of the host: not listening
        socket.create_connection(("127.0.0.2", port), timeout=5).close()


class _Proxy:
    """A TCP forwarder the test owns: what a NAT or a Kubernetes Service would be."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.sock = socket.create_server(("127.0.0.1", reserved_port()))
        self.addr = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            try:
                upstream = socket.create_connection(self.target)
            except OSError:  # not listening yet: the caller retries
                client.close()
                continue
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def test_a_node_reached_through_a_proxy_advertises_the_proxys_address(tmp_path: Path
                                                                      ) -> None:
    binds = [reserved_port() for _ in range(3)]
    proxies = [_Proxy(("127.0.0.1", port)) for port in binds]
    advertised = [p.addr for p in proxies]
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    nodes = [Server(tmp_path / f"s{i}", "--raft", f"127.0.0.1:{binds[i]}",
                    "--raft-advertise", advertised[i], "--group-peers", ",".join(advertised),
                    "--raft-secret", f"@{secret}", command="store") for i in range(3)]
    try:
        for n in nodes:
            n.start()
        masters = wait_for(lambda: [i for i, n in enumerate(nodes)
                                    if cluster(n)["role"] == "master"] or None, 20,
                           "a master")
        assert len(masters) == 1
        m = nodes[masters[0]]
        assert cluster(m)["node"] == advertised[masters[0]]
        wait_for(lambda: sorted(cluster(m)["controller"]["nodes"]) == sorted(advertised), 10,
                 "every node known by its advertised address")
        # Every Raft link went through a proxy (one direction each: 3 links).
        assert sum(p.accepted for p in proxies) >= 3
    finally:
        for n in nodes:
            if n.proc is not None:
                n.kill()
        for p in proxies:
            p.close()


def test_the_log_goes_to_store_nodes_that_prove_the_group_secret(group: Group) -> None:
    """REPL_FETCH hands out the whole log and metadata: only to a node of the group,
    which answers the connection's one-time challenge with the group secret (the store
    runs without --auth here: the group secret guards the log all the same)."""
    import trio

    from store import protocol as p
    from store.client import AuthFailed, NativeClient

    m = group.master(10)
    addr = group.nodes[m].native
    secret = group.secret.read_text().strip().encode()
    fetch = {"node": "s-x", "offset": 0, "wait_ms": 0}

    async def attempt(node: tuple[str, bytes] | None) -> int:
        try:
            async with NativeClient.open(addr, node=node, connect_timeout=3.0) as c:
                try:  # returned, not raised: the client's nursery would wrap it
                    await c.request(p.REPL_FETCH, fetch)
                except p.RemoteError as exc:
                    return exc.status
                return 200
        except AuthFailed as exc:
            return exc.status

    assert trio.run(attempt, None) == 403  # anyone else: refused
    assert trio.run(attempt, ("s-x", b"a guess")) == 401  # a wrong secret: refused
    assert trio.run(attempt, ("s-x", secret)) == 200
