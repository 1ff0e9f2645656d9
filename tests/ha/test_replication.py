"""A fixed replica (`lightgate store --replica-of`): it copies the master's CommitLog
byte for byte at the same offsets, indexes it, copies the metadata, refuses clients'
writes naming the master, and catches up after a restart or from an empty disk."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from store import protocol as p
from store.sdk import Consumer, Producer
from tests.conftest import Server
from tests.ha.cluster import cluster, log_bytes, native_call, read_topic, wait_for

TOPIC = "ha"


def _send(addr: str, n: int, start: int = 0) -> list[str]:
    with Producer(addr) as prod:
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
