"""A store group whose disks fill up: each node's data directory on a small tmpfs of its
own, filled with a file while a producer sends. A node out of space must stay alive,
refuse writes with a clear reason, step down if it is master, go on serving reads, and
come back by itself once space returns; a replica that cannot write leaves the in-sync
set at once. Nothing acknowledged is lost."""

from __future__ import annotations

import errno
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import pytest

from store.sdk import Producer
from tests.conftest import RedisServer, Server
from tests.ha.cluster import Group, cluster, read_topic, same_log, wait_for
from tests.ha.load import Load, collect, subscriber

DISK_MB = 64
TOPIC = "full"


@dataclass
class Sender:
    """One producer sending numbered bodies through the group, one at a time, sending
    again what was refused; `acked` is every body the group acknowledged."""

    addrs: str
    acked: list[bytes] = field(default_factory=list)
    acked_at: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        # Each refusal seen, not retried for the SDK's default two minutes: the test
        # reads what the group answers while its disks are full.
        with Producer(self.addrs, timeout=5, delivery_timeout=1) as prod:
            i = 0
            while not self.stop.is_set():
                body = b"%06d:" % i + b"x" * 1000
                try:
                    prod.send(TOPIC, body)
                except Exception as exc:  # noqa: BLE001 - refused: send it again
                    self.errors.append(str(exc))
                    time.sleep(0.05)
                    continue
                self.acked.append(body)
                self.acked_at.append(time.monotonic())
                i += 1

    def start(self) -> Sender:
        threading.Thread(target=self.run, daemon=True).start()
        return self

    def wait_more(self, n: int, timeout: float) -> None:
        have = len(self.acked)
        wait_for(lambda: len(self.acked) >= have + n, timeout, f"{n} more acks")


def _mount(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", "tmpfs",
                          str(path)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")


def fill(disk: Path) -> Path:
    """Fill the filesystem to its last byte with a file; returns the file."""
    filler = disk / "filler"
    chunk = b"\0" * (1 << 20)
    with open(filler, "wb", buffering=0) as f:
        for size in (1 << 20, 4096, 1):
            try:
                while True:
                    f.write(chunk[:size])
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
    return filler


@pytest.fixture
def group(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Group]:
    """Three nodes in sync mode, each with its data directory alone on a small disk (and
    a Redis for gateways, when the test asks for `redis_server`)."""
    disks = [tmp_path / f"disk{i}" for i in range(3)]
    for disk in disks:
        _mount(disk)
    notify = []
    if "redis_server" in request.fixturenames:
        notify = ["--notify", request.getfixturevalue("redis_server").url]
    g = Group(tmp_path / "group", 3, "--replication", "sync", "--min-insync", "2",
              "--segment-size", str(1 << 20), *notify)
    for i, node in enumerate(g.nodes):
        node.data_dir = g.dirs[i] = disks[i] / "data"
    g.disks = disks  # type: ignore[attr-defined]
    try:
        g.start()
        m = g.master(20)
        wait_for(lambda: len(g.insync(m)) == 3, 15, "all three in sync")
        yield g
    finally:
        g.stop()
        for disk in disks:
            subprocess.run(["umount", "-l", str(disk)], check=False)


def _alive(g: Group) -> None:
    for i, node in enumerate(g.nodes):
        assert node.proc is not None and node.proc.poll() is None, (
            f"store {i} died ({node.proc and node.proc.returncode}): {node.logs()[-3000:]}")


def _masters(g: Group) -> list[int]:
    return [i for i, role in enumerate(g.roles()) if role == "master"]


def _committed(g: Group, master: int) -> list[str]:
    """The in-sync set the controller holds, as the master reads it."""
    return list(cluster(g.nodes[master])["controller"]["insync"])


def _nothing_lost(g: Group, sender: Sender) -> int:
    """Once the sender stopped: every node up, and every body the group acknowledged
    in the master's log; the master's index."""
    time.sleep(0.5)
    _alive(g)
    m = g.master()
    stored = set(read_topic(g.nodes[m].native, TOPIC))
    lost = [b[:6] for b in sender.acked if b not in stored]
    assert not lost, f"{len(lost)} acknowledged messages lost: {lost[:10]}"
    return m


def test_a_full_master_steps_down_serves_reads_and_comes_back(group: Group) -> None:
    g = group
    m = g.master()
    sender = Sender(g.addrs).start()
    try:
        sender.wait_more(50, 20)
        filler = fill(g.disks[m])  # type: ignore[attr-defined]
        filled = time.monotonic()
        # Another node takes over; the full one stays alive, no longer master.
        new = wait_for(lambda: [i for i in _masters(g) if i != m] or None, 20,
                       "another master", step=0.02)[0]
        print(f"another master {time.monotonic() - filled:.2f} s after the master's disk "
              "filled")
        sender.wait_more(50, 20)
        time.sleep(2.0)  # the full node meanwhile: it must not die
        _alive(g)
        assert cluster(g.nodes[m])["role"] != "master"
        assert _masters(g) == [new]
        log = g.nodes[m].logs()
        assert "No space left on device" in log or "no space left" in log, log[-3000:]
        # It still serves reads (what it holds).
        assert read_topic(g.nodes[m].native, TOPIC)
        filler.unlink()  # space is back: it catches up and rejoins the in-sync set
        wait_for(lambda: len(g.insync(new)) == 3, 30, "the full node back in sync")
        sender.wait_more(50, 20)
    finally:
        sender.stop.set()
    new = _nothing_lost(g, sender)
    wait_for(lambda: same_log(g.dirs[m], g.dirs[new]), 20, "the same log on both")


def test_all_three_full_refuse_writes_clearly_and_recover(group: Group) -> None:
    g = group
    sender = Sender(g.addrs).start()
    try:
        sender.wait_more(50, 20)
        fillers = [fill(d) for d in g.disks]  # type: ignore[attr-defined]
        wait_for(lambda: any("no space" in e.lower() for e in sender.errors[-20:]), 20,
                 "writes refused for want of space")
        acked = len(sender.acked)
        time.sleep(3.0)
        _alive(g)
        assert len(sender.acked) <= acked + 1  # nothing is acknowledged without space
        for node in g.nodes:  # every node still serves reads
            assert read_topic(node.native, TOPIC)
        for f in fillers:
            f.unlink()
        freed = time.monotonic()
        wait_for(lambda: sender.acked_at[-1] > freed, 30, "an ack after space was freed")
        again = min(t for t in list(sender.acked_at) if t > freed)
        print(f"writes acknowledged again {again - freed:.2f} s after space was freed")
        sender.wait_more(50, 30)
    finally:
        sender.stop.set()
    m = _nothing_lost(g, sender)
    wait_for(lambda: len(g.insync(m)) == 3, 30, "all three back in sync")


def test_a_replica_that_cannot_write_leaves_the_in_sync_set_at_once(group: Group
                                                                    ) -> None:
    g = group
    m = g.master()
    r = (m + 1) % 3
    replica = cluster(g.nodes[r])["node"]
    sender = Sender(g.addrs).start()
    try:
        sender.wait_more(50, 20)
        filler = fill(g.disks[r])  # type: ignore[attr-defined]
        filled = time.monotonic()
        left = wait_for(lambda: replica not in _committed(g, m) and time.monotonic(), 10,
                        "the replica out of the in-sync set") - filled
        sender.wait_more(50, 20)
        ack_gaps = [b - a for a, b in pairwise(list(sender.acked_at)) if b > filled]
        stall = max(ack_gaps, default=0.0)
        print(f"replica out of the in-sync set {left:.2f} s after its disk filled; "
              f"longest wait for an ack {stall:.2f} s")
        # At once: well before --max-lag-s (2 s) would drop a replica that stopped.
        assert left < 1.5, left
        assert stall < 1.5, stall
        _alive(g)
        filler.unlink()
        wait_for(lambda: len(g.insync(m)) == 3, 30, "the replica back in sync")
        sender.wait_more(20, 20)
    finally:
        sender.stop.set()
    _nothing_lost(g, sender)


def test_a_full_master_under_mqtt_load_loses_nothing(group: Group,
                                                     redis_server: RedisServer) -> None:
    """Through a gateway, with a persistent subscriber: the full master's first failed
    writes are often the metadata's (sessions, offsets), RocksDB's, not the log's."""
    g = group
    m = g.master()
    gw = Server(None, "--store", g.addrs, "--notify", redis_server.url,
                "--max-offline-messages", "10000000", command="gateway").start()
    load: Load | None = None
    try:
        sub = subscriber(gw.port)
        sub.subscribe("ha/#", 1)
        load = Load([gw.port], 2).start()
        wait_for(lambda: load.acked() > 100, 20, "publishing under way")
        filler = fill(g.disks[m])  # type: ignore[attr-defined]
        new = wait_for(lambda: [i for i in _masters(g) if i != m] or None, 20,
                       "another master")[0]
        n = load.acked()
        wait_for(lambda: load.acked() > n + 100, 20, "publishing to go on")
        filler.unlink()
        wait_for(lambda: len(g.insync(new)) == 3, 30, "the full node back in sync")
        n = load.acked()
        wait_for(lambda: load.acked() > n + 100, 20, "publishing to go on")
        load.stop()
        delivered = collect(sub, 5.0)
        lost = set(load.all_acked()) - set(delivered)
        print(f"{load.acked()} acked, {len(delivered)} delivered, {len(lost)} lost")
        assert not lost
        _alive(g)
        # A metadata write on the full disk is answered with the reason; it does not
        # end the gateway's connection with a traceback.
        assert "native connection from 127.0.0.1 failed" not in g.nodes[m].logs()
        sub.disconnect()
    except AssertionError as exc:  # what the gateway and each node said, to see why
        tails = "\n".join(f"--- {name}: {srv.logs()[-3000:]}" for name, srv in
                           [("gateway", gw), *((f"node {i}", n) for i, n in enumerate(g.nodes))])
        raise AssertionError(f"{exc}\n{tails}") from exc
    finally:
        if load is not None:
            load.stop_event.set()
        if gw.proc is not None:
            gw.kill()
