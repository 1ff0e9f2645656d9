"""The Raft port under a stranger's connections: silent sockets are closed at the
pre-authentication deadline, a stranger's connections are capped per source address and
in all, a first frame captured on the wire and replayed does not authenticate, and a
node run out of file descriptors takes connections again once the attacker leaves,
its group whole again. Each measures what the attacked node held (RSS, open fds)."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import struct
import time
import urllib.request
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from store.sdk import Producer
from tests.ha.cluster import Group, cluster, wait_for
from tests.latency import Prober, assert_unhurt
from tests.proc import open_fds, rss_kb

DEADLINE_S = 10.0  # the port's pre-auth deadline is 5 s: closed well within this
PER_ADDRESS = 8  # the caps documented in docs/store-groups.md
TOTAL = 64


def _alive(sock: socket.socket) -> bool:
    """Whether the other side still holds the connection (no FIN, no RST yet)."""
    sock.settimeout(None)  # with a timeout, Python would wait for data before peeking
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def _dial(addr: str, source: str = "127.0.0.1", timeout: float = 2.0) -> socket.socket | None:
    host, port = addr.rsplit(":", 1)
    try:
        s = socket.create_connection((host, int(port)), timeout=timeout,
                                     source_address=(source, 0))
    except OSError:  # a full backlog or a refusal: the attacker moves on
        return None
    s.settimeout(None)  # blocking: _alive's peek must not wait for data
    return s


def _whole(g: Group, timeout: float = 30.0) -> None:
    """One master, all three nodes in its in-sync set, and every node following a Raft
    leader with its own reports committed lately."""
    def whole() -> bool:
        m = g.master(5)
        if len(g.insync(m)) != 3:
            return False
        views = [cluster(n)["controller"] for n in g.nodes]
        return all(v["leader"] and v["silent_s"] < 3.0 for v in views)
    wait_for(whole, timeout, "the group whole", step=0.5)


def _redial(g: Group, victim: int) -> None:
    """Restart the other nodes: every Raft link of the victim (the node they dial) is
    dialled anew through its listener, and the group is whole only if it takes them."""
    others = [i for i in range(len(g.nodes)) if i != victim]
    for i in others:
        g.nodes[i].kill()
    for i in others:
        g.nodes[i].start()
    _whole(g, 60)


def _lowest(g: Group) -> int:
    """The node whose Raft address sorts first: pysyncobj has the others dial it, so
    every Raft link it has goes through its listener."""
    return min(range(len(g.raft)), key=lambda i: g.raft[i])


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Group]:
    g = Group(tmp_path_factory.mktemp("raft"), 3, "--replication", "sync",
              "--min-insync", "2").start()
    _whole(g)
    yield g
    g.stop()


@contextlib.contextmanager
def _holding() -> Iterator[list[socket.socket]]:
    socks: list[socket.socket] = []
    try:
        yield socks
    finally:
        for s in socks:
            s.close()


def test_silent_sockets_are_closed_at_the_pre_auth_deadline(group: Group) -> None:
    victim = _lowest(group)
    pid, addr = group.nodes[victim].proc.pid, group.raft[victim]
    fds0 = open_fds(pid)
    with _holding() as socks:
        for i in range(300):  # from 30 source addresses, 10 each
            s = _dial(addr, f"127.0.0.{10 + i % 30}")
            if s is not None:
                socks.append(s)
        assert len(socks) >= 250
        peak = open_fds(pid)
        wait_for(lambda: not any(_alive(s) for s in socks), DEADLINE_S,
                 "every silent socket closed")
        wait_for(lambda: open_fds(pid) <= fds0 + 4, 5, "the node's fds back to before")
    assert peak - fds0 <= TOTAL + 4, (fds0, peak)
    _whole(group)


def test_a_strangers_connections_are_capped_per_address_and_in_all(group: Group) -> None:
    victim = _lowest(group)
    pid, addr = group.nodes[victim].proc.pid, group.raft[victim]
    fds0 = open_fds(pid)
    with _holding() as one:  # one source address
        for _ in range(50):
            s = _dial(addr, "127.0.0.2")
            if s is not None:
                one.append(s)
        time.sleep(0.5)
        assert sum(map(_alive, one)) <= PER_ADDRESS
        assert open_fds(pid) - fds0 <= PER_ADDRESS + 4
    with _holding() as many:  # 40 source addresses, each within its cap
        for i in range(40 * PER_ADDRESS):
            s = _dial(addr, f"127.0.1.{10 + i % 40}")
            if s is not None:
                many.append(s)
        time.sleep(0.5)
        alive = sum(map(_alive, many))
        assert 0 < alive <= TOTAL, alive
        assert open_fds(pid) - fds0 <= TOTAL + 4
    _whole(group)


def _first_frame(secret: str) -> bytes:
    """The first frame a node sends on a Raft connection it dials (its random key,
    encrypted with the group secret): what a sniffer on the link captures."""
    from pysyncobj import pickle as ppickle
    from pysyncobj.encryptor import getEncryptor

    data = zlib.compress(ppickle.dumps(os.urandom(32)), 3)
    data = getEncryptor(secret).encrypt_at_time(data, int(time.monotonic()))
    return struct.pack("i", len(data)) + data


def _read_frame(sock: socket.socket, timeout: float = 3.0) -> bytes:
    sock.settimeout(timeout)
    buf = b""
    while len(buf) < 4 or len(buf) < 4 + struct.unpack("i", buf[:4])[0]:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf[4:]


def test_a_replayed_first_frame_does_not_authenticate(group: Group) -> None:
    from pysyncobj.encryptor import getEncryptor

    secret = group.secret.read_text().strip()
    first = _first_frame(secret)
    victim = _lowest(group)
    pid, addr = group.nodes[victim].proc.pid, group.raft[victim]
    rss0 = rss_kb(pid)
    big = 8 << 20  # a frame a peer that authenticated could send
    chunk = b"\0" * 65536
    with Prober(lambda: _http_ok(group.nodes[victim])) as before:
        time.sleep(2.0)
    with _holding() as socks, Prober(lambda: _http_ok(group.nodes[victim])) as during:
        for i in range(24):
            s = _dial(addr, f"127.0.2.{10 + i}")
            assert s is not None
            s.sendall(first)
            # The node took it for a peer's first frame: it answers with its own key.
            assert getEncryptor(secret).decrypt(_read_frame(s))
            socks.append(s)
            if i % 2:
                continue
            # Then a large frame at once, as a peer that authenticated may send, all but
            # its last byte: held until it completes (it would not decrypt).
            try:
                s.sendall(struct.pack("i", big))
                for _ in range(big // len(chunk) - 1):
                    s.sendall(chunk)
                s.sendall(chunk[:-1])
            except OSError:
                pass
        peak = rss_kb(pid)
        print(f"replay: RSS {rss0 // 1024} -> {peak // 1024} MiB")
        silent, loud = socks[1::2], socks[::2]
        assert not any(_alive(s) for s in loud), "a replayed frame lifted the 4 KiB bound"
        wait_for(lambda: not any(_alive(s) for s in silent), DEADLINE_S,
                 "every silent replaying connection closed")
    print(f"/healthz before: {before}; during: {during}")
    assert peak - rss0 < 24 * 1024, (rss0, peak)
    assert_unhurt(before, during)
    _whole(group)


def _accepts(addr: str) -> bool:
    """The port takes a connection and does not drop it at once."""
    s = _dial(addr)
    if s is None:
        return False
    with s:
        time.sleep(0.2)
        return _alive(s)


def test_the_raft_listener_survives_running_out_of_fds(group: Group) -> None:
    """pysyncobj's listener unbinds on any accept error but EAGAIN and never binds
    again: the node is cut off from every peer that dials it."""
    victim = _lowest(group)
    pid, addr = group.nodes[victim].proc.pid, group.raft[victim]
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    with _holding() as socks:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (3, hard))  # every new fd: EMFILE
        try:
            for _ in range(3):  # completed by the kernel, refused by accept
                s = _dial(addr)
                if s is not None:
                    socks.append(s)
            time.sleep(2.0)
        finally:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
    wait_for(lambda: _accepts(addr), 10, "the Raft port accepting again")
    _redial(group, victim)


def _http_ok(node: object) -> bool:
    try:
        with urllib.request.urlopen(f"http://{node.addrs['http']}/healthz",  # type: ignore[attr-defined]
                                    timeout=3) as r:
            return r.status == 200
    except OSError:
        return False


def test_a_group_node_out_of_fds_rejoins_once_the_attacker_leaves(tmp_path: Path) -> None:
    """The attack that shut the port for good: a node with a 256-fd limit, hundreds of
    silent sockets to its Raft, native and HTTP ports. Its fds stay in its budget, the
    Raft port takes connections again when the attacker leaves, and the group is whole."""
    limit = 256
    g = Group(tmp_path, 3, "--replication", "sync", "--min-insync", "2")
    victim = _lowest(g)
    node = g.nodes[victim]
    node.prefix = ["prlimit", f"--nofile={limit}:{limit}", "--"]
    g.start()
    try:
        _whole(g)
        pid = node.proc.pid
        assert resource.prlimit(pid, resource.RLIMIT_NOFILE) == (limit, limit)
        producer = Producer(g.addrs)

        def send() -> bool:  # acknowledged once a replica has it (sync, 2 in sync)
            return bool(producer.send("probe", b"x"))

        wait_for(send, 15, "the master taking writes (a new one waits for its lease)")
        with Prober(send) as before:
            time.sleep(3.0)
        rss0, fds0 = rss_kb(pid), open_fds(pid)
        targets = [g.raft[victim], node.native, node.addrs["http"]]
        rss_peak, fds_peak = rss0, fds0
        with _holding() as socks, Prober(send) as during:
            deadline = time.monotonic() + 20
            for i in range(900):
                if time.monotonic() > deadline:
                    break
                s = _dial(targets[i % 3], f"127.0.3.{10 + i % 100}", timeout=0.5)
                if s is not None:
                    socks.append(s)
                if i % 50 == 0:
                    rss_peak, fds_peak = max(rss_peak, rss_kb(pid)), max(fds_peak, open_fds(pid))
            for _ in range(10):  # held for 5 s
                time.sleep(0.5)
                rss_peak, fds_peak = max(rss_peak, rss_kb(pid)), max(fds_peak, open_fds(pid))
            print(f"attack: {len(socks)} sockets, fds {fds0} -> {fds_peak} of {limit}, "
                  f"RSS {rss0 // 1024} -> {rss_peak // 1024} MiB")
            assert fds_peak < limit - 16, "the node ran out of file descriptors"
        print(f"a producer's sends before: {before}; during: {during}")
        producer.close()
        assert_unhurt(before, during)
        wait_for(lambda: _accepts(g.raft[victim]), 10, "the Raft port accepting again")
        assert rss_peak - rss0 < 64 * 1024, (rss0, rss_peak)
        _redial(g, victim)
    finally:
        g.stop()
