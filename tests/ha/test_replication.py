"""A fixed replica (`lightgate store --replica-of`): it copies the master's CommitLog
byte for byte at the same offsets, indexes it, copies the metadata, refuses clients'
writes naming the master, and catches up after a restart or from an empty disk."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from serving import plane
from store import protocol as p
from store.sdk import Consumer, Producer
from tests.conftest import Server
from tests.ha.cluster import cluster, log_bytes, native_call, read_topic, wait_for
from tests.proc import pause

TOPIC = "ha"


def _send(addr: str, n: int, start: int = 0) -> list[str]:
    # Not idempotent: its id would wait, as metadata, for the in-sync set that some of
    # these tests stop (what they look at is the appends).
    with Producer(addr, idempotent=False) as prod:
        return [prod.send(TOPIC, f"m{i}".encode(), key=f"k{i % 7}").msg_id
                for i in range(start, start + n)]


def test_replica_copies_log_and_metadata(tmp_path: Path) -> None:
    master = Server(tmp_path / "m", command="store").start()
    replica = Server(tmp_path / "r", "--replica-of", master.native, command="store").start()
    try:
        _send(master.native, 300)
        with Consumer(master.native, group="g", topic=TOPIC) as c:  # metadata: offsets
            n = 0
            for _ in range(50):
                for m in c.poll(timeout=0.5):
                    c.ack(m)
                    n += 1
                if n >= 300:
                    break
        wait_for(lambda: log_bytes(tmp_path / "r")
                 == log_bytes(tmp_path / "m"), 10, "the replica's log to equal the master's")
        assert len(log_bytes(tmp_path / "m")) > 300 * 20
        # The replica indexed what it copied: PULL on the replica finds every message.
        got = read_topic(replica.native, TOPIC)
        assert sorted(got) == sorted(f"m{i}".encode() for i in range(300))
        # ... and copied the metadata: the group's committed offsets.
        want = native_call(master.native, p.META_ITEMS, {"cf": "offsets"})["items"]
        assert want
        wait_for(lambda: native_call(replica.native, p.META_ITEMS, {"cf": "offsets"})["items"]
                 == want, 10, "the replica's offsets to equal the master's")
        # Writes on the replica are refused, naming the master.
        with pytest.raises(Exception, match=f"replica: writes go to the master at "
                                            f"{master.native}"), Producer(replica.native) as prod:
            prod.send(TOPIC, b"nope")
        st = cluster(master)
        assert st["role"] == "master" and st["replicas"][0]["lag_bytes"] == 0
        assert cluster(replica)["role"] == "replica"
    finally:
        for node in (replica, master):
            if node.proc is not None:
                node.kill()


def test_replica_restarts_and_resyncs_from_empty_disk(tmp_path: Path) -> None:
    master = Server(tmp_path / "m", command="store").start()
    replica = Server(tmp_path / "r", "--replica-of", master.native, command="store").start()
    try:
        _send(master.native, 100)
        wait_for(lambda: log_bytes(tmp_path / "r") == log_bytes(tmp_path / "m"), 10, "copy")
        replica.kill()
        _send(master.native, 100, 100)
        replica.start()
        wait_for(lambda: log_bytes(tmp_path / "r") == log_bytes(tmp_path / "m"), 10,
                 "catch-up after a restart")
        replica.kill()
        shutil.rmtree(tmp_path / "r")
        _send(master.native, 100, 200)
        replica.start()
        wait_for(lambda: log_bytes(tmp_path / "r") == log_bytes(tmp_path / "m"), 10,
                 "resync from an empty disk")
        assert len(read_topic(replica.native, TOPIC)) == 300
    finally:
        for node in (replica, master):
            if node.proc is not None:
                node.kill()


def _holds_masters_log(replica: Path, master: Path) -> bool:
    """The replica has each of the master's segments byte for byte and none after them
    (it may keep older ones: retention on the master goes on, the replica's has not)."""
    def segments(d: Path) -> dict[str, bytes]:
        return {f.name: f.read_bytes() for f in (d / "commitlog").iterdir()
                if f.name.isdigit()}
    mine, theirs = segments(replica), segments(master)
    return bool(theirs) and max(mine) == max(theirs) and all(
        mine.get(name) == data for name, data in theirs.items())


def _ranges(addr: str, queues: list[str]) -> dict[str, tuple[int, int]]:
    out = {}
    for q in queues:
        h = native_call(addr, p.QUEUE_RANGE, {"queue": q})
        out[q] = (h["min_offset"], h["max_offset"])
    return out


def test_replica_behind_the_masters_retention_starts_over(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """Retention on the master removed the log a replica would continue from (a new disk
    on a long-running group, or a replica down longer than retention): it starts over at
    the master's first offset, with every queue's end where the master has it (the
    master's index floors, here in pages of three queues)."""
    monkeypatch.setenv("LIGHTGATE_REPL_FLOORS_PAGE", "3")
    master = Server(tmp_path / "m", "--segment-size", "4096", "--retention-bytes", "8192",
                    "--retention-check-s", "0.2", command="store").start()
    replica = Server(tmp_path / "r", "--replica-of", master.native, command="store")
    queues = [f"{t}#{i}" for t in ("old", TOPIC) for i in range(4)]
    try:
        with Producer(master.native) as prod:  # "old": every record of it goes
            for i in range(60):
                prod.send("old", f"o{i}".encode(), key=f"k{i % 7}")
        _send(master.native, 400)
        first = lambda: int(sorted(os.listdir(tmp_path / "m" / "commitlog"))[0])  # noqa: E731
        def old_gone() -> bool:
            ranges = _ranges(master.native, queues[:4]).values()
            return all(lo == hi for lo, hi in ranges) and sum(hi for _, hi in ranges) == 60

        wait_for(old_gone, 15, "retention to remove every record of 'old'")
        assert first() > 0
        old_ends = {q: hi for q, (_, hi) in _ranges(master.native, queues[:4]).items()}
        assert sum(1 for end in old_ends.values() if end) > 1

        trimmed = lambda: len(log_bytes(tmp_path / "m")) <= 8192  # noqa: E731
        wait_for(trimmed, 15, "retention to finish on the master")
        replica.start()  # an empty disk: the master's log no longer starts at 0
        wait_for(lambda: _holds_masters_log(tmp_path / "r", tmp_path / "m"), 15,
                 "the new replica to copy the master's log from its start")
        assert _ranges(replica.native, queues) == _ranges(master.native, queues)
        assert sorted(read_topic(replica.native, TOPIC)) == sorted(read_topic(master.native,
                                                                              TOPIC))
        assert cluster(replica)["restarted_bytes"] == 0  # it had nothing to drop

        # Down while retention on the master passes its end: it drops its log and
        # starts over from the master's start.
        replica.kill()
        end_before = len(log_bytes(tmp_path / "r"))
        _send(master.native, 400, 400)
        wait_for(trimmed, 15, "retention to finish on the master")
        replica.start()
        wait_for(lambda: _holds_masters_log(tmp_path / "r", tmp_path / "m"), 15,
                 "the replica to start over after retention passed it")
        st = cluster(replica)
        assert st["restarted_bytes"] == end_before, (st["restarted_bytes"], end_before)
        # New messages continue every queue's offsets on both nodes alike, "old" too.
        with Producer(master.native) as prod:
            for i in range(8):
                prod.send("old", f"new{i}".encode(), key=f"k{i % 7}")
        wait_for(lambda: _holds_masters_log(tmp_path / "r", tmp_path / "m"), 15, "copy")
        ranges = _ranges(master.native, queues)
        # (Their starts may differ from here on: the replica's own retention is its own.)
        ends = lambda node: {q: hi for q, (_, hi) in _ranges(node.native, queues).items()}  # noqa: E731
        assert ends(replica) == ends(master)
        assert sum(hi - lo for q, (lo, hi) in ranges.items() if q.startswith("old")) == 8
        assert all(ranges[q][0] == end for q, end in old_ends.items())  # no offset again
        assert sorted(read_topic(replica.native, "old")) == sorted(
            f"new{i}".encode() for i in range(8))
        # A restart of the replica that started over finds its log as it left it.
        replica.kill()
        replica.start()
        wait_for(lambda: cluster(replica)["role"] == "replica", 10, "restart")
        # Its readers see up to the master's read limit, which comes with its first fetch.
        wait_for(lambda: ends(replica) == ends(master), 10, "the same queue ends")
    finally:
        for node in (replica, master):
            if node.proc is not None:
                node.kill()


def test_metadata_larger_than_a_frame_is_copied_in_pages(tmp_path: Path) -> None:
    """96 MB of sessions, more than one native frame holds (64 MiB): a replica that was
    stopped while they were written gets the changes in bounded answers, and one with an
    empty disk copies the snapshot in pages, then is in sync again."""
    master = Server(tmp_path / "m", command="store").start()
    replica = Server(tmp_path / "r", "--replica-of", master.native, command="store").start()
    blob = "x" * 12_000
    try:
        wait_for(lambda: cluster(master)["replicas"], 10, "the replica to fetch")
        pause(replica.proc.pid)  # (every thread: a native copy thread too)
        for batch in range(16):
            native_call(master.native, p.META_WRITE, {"ops": [
                ["put", "sessions", f"dev-{batch}-{i}", {"blob": blob, "n": i}]
                for i in range(500)]})
        native_call(master.native, p.META_WRITE, {"ops": [["delete", "sessions", "dev-0-0",
                                                           None]]})

        def items(node: Server, batch: int) -> list:
            return native_call(node.native, p.META_ITEMS, {"cf": "sessions",
                                                           "prefix": f"dev-{batch}-"})["items"]

        def same(batches: tuple[int, ...] = (0, 9)) -> bool:  # copied first and last
            return all(items(replica, b) == items(master, b) for b in batches)

        replica.proc.send_signal(signal.SIGCONT)
        wait_for(same, 60, "8,000 changes (96 MB) to reach the stopped replica")
        replica.kill()
        shutil.rmtree(tmp_path / "r")  # a new disk copies a snapshot: 96 MB in pages
        replica.start()
        wait_for(same, 60, "the snapshot to reach the restarted replica")
        wait_for(lambda: cluster(master)["replicas"][0]["insync"], 10, "in sync again")
        assert same(tuple(range(16)))
        assert len(items(replica, 0)) == 499 and len(items(replica, 15)) == 500
        assert not (tmp_path / "r" / "metadata.incomplete").exists()
        log = "".join(master.log)
        assert "exceeds" not in log, log[-2000:]
    finally:
        for node in (replica, master):
            if node.proc is not None:
                node.kill()


@pytest.fixture(params=["python", pytest.param("native", marks=pytest.mark.skipif(
    plane.NATIVE is None or not hasattr(plane.NATIVE, "ReplicaCopy"),
    reason="the native data plane is not built"))])
def copy_plane(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The replicas' steady-state copy: Python's, or the native loop's
    (LIGHTGATE_GROUP_NATIVE=1: store.replication.native_copy)."""
    monkeypatch.setenv("LIGHTGATE_GROUP_NATIVE", "1" if request.param == "native" else "0")
    return str(request.param)


def test_readers_of_a_replica_see_acknowledged_messages_only(tmp_path: Path,
                                                             copy_plane: str) -> None:
    """Sync mode: a replica holds bytes the group has not acknowledged yet (another
    replica is stopped); its readers do not see them, as the master's do not, for a
    failover may cut them. Once acknowledged, they do."""
    master = Server(tmp_path / "m", "--replication", "sync", "--min-insync", "3",
                    "--max-lag-s", "30", command="store").start()
    a = Server(tmp_path / "a", "--replica-of", master.native, command="store").start()
    b = Server(tmp_path / "b", "--replica-of", master.native, command="store").start()
    try:
        wait_for(lambda: len(cluster(master)["insync"]) == 3, 10, "both replicas in sync")
        _send(master.native, 5)
        wait_for(lambda: len(read_topic(a.native, TOPIC)) == 5, 10, "acked messages on a")
        b.proc.send_signal(signal.SIGSTOP)
        done: list[object] = []
        sender = threading.Thread(target=lambda: done.append(_send(master.native, 3, 5)))
        sender.start()
        # a copies the first of them (the producer waits for each ack); b's copy is what
        # would acknowledge it
        wait_for(lambda: cluster(a)["log_end"] == cluster(master)["log_end"]
                 > cluster(master)["replicated_offset"], 5, "a to hold the unacked tail")
        assert len(read_topic(a.native, TOPIC)) == 5
        assert len(read_topic(master.native, TOPIC)) == 5
        assert cluster(a)["read_limit"] < cluster(a)["log_end"]
        # nor does a new subscription start past it (QUEUE_RANGE's end, on either node)
        parts = [f"{TOPIC}#{i}" for i in range(4)]
        assert sum(hi for _, hi in _ranges(master.native, parts).values()) == 5
        assert sum(hi for _, hi in _ranges(a.native, parts).values()) == 5
        ends = native_call(master.native, p.QUEUE_ENDS, {"queues": parts})["ends"]
        assert sum(ends.values()) == 5
        b.proc.send_signal(signal.SIGCONT)
        sender.join(10)
        assert done, "the sends were acknowledged once b fetched"
        wait_for(lambda: len(read_topic(a.native, TOPIC)) == 8, 5, "the acked three on a")
        assert sum(hi for _, hi in _ranges(a.native, parts).values()) == 8
    finally:
        for node in (a, b, master):
            if node.proc is not None:
                node.proc.send_signal(signal.SIGCONT)
                node.kill()


def test_one_fetch_answer_per_append_and_waiting_readers_see_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, copy_plane: str) -> None:
    """Sync mode: each replica is answered once per append (the bytes), not a second time
    for the read limit alone while nobody reads it; a pull that starts waiting on a
    replica holding a tail its readers may not see yet gets it at once, not when the
    replica's fetch would next be answered (held 5 s here)."""
    monkeypatch.setenv("LIGHTGATE_REPL_FETCH_WAIT_MS", "5000")
    master = Server(tmp_path / "m", "--replication", "sync", "--min-insync", "3",
                    command="store").start()
    a = Server(tmp_path / "a", "--replica-of", master.native, command="store").start()
    b = Server(tmp_path / "b", "--replica-of", master.native, command="store").start()
    try:
        wait_for(lambda: len(cluster(master)["insync"]) == 3, 10, "both replicas in sync")
        n = 40
        before = cluster(master)["fetches"]
        _send(master.native, n)
        answered = cluster(master)["fetches"] - before
        assert answered <= n * 2 + 8, answered  # was about 4 an append
        # The last append is acknowledged, and a and b hold it; their fetches are held
        # at the master, lazy: neither knows yet that its readers may see it.
        with Producer(master.native, idempotent=False) as prod:
            ((queue, offset),) = prod.send(TOPIC, b"last", key="k0").queues
        t0 = time.monotonic()
        got = native_call(a.native, p.PULL, {"queue": queue, "offset": offset,
                                             "wait_ms": 4000})
        assert len(got["messages"]) == 1 and time.monotonic() - t0 < 2.5
        copied = cluster(a)["copied"]  # (which loop wrote the copies)
        assert (copied["native_answers"] >= n) == (copy_plane == "native"), copied
    finally:
        for node in (a, b, master):
            if node.proc is not None:
                node.kill()
