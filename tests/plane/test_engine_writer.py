"""The CommitLog with the native engine as its one writer, against the Python writer, the
reference: the same appends (several queues, wildcard queues, idempotent producers and
their retries, a request no record can hold) make the same segment files, byte for byte,
and the same index; native publishes and Python's appends share the queues' offsets in
log order; a full disk refuses the append, keeps everything acknowledged before it and
uses no offset."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from gateway import mqtt
from gateway.stats import APPEND_BUCKETS
from lightqueue.index import ConsumeQueueIndex
from serving import plane
from store import commitlog as commitlog_module
from store.commitlog import CommitLog
from store.common import StoreFullError
from store.engine_tail import DISPATCH_LAZY_S
from store.producers import Stamp
from store.record import Message
from tests.plane.test_engine_native import SETTINGS, pair, recv_exact

if plane.NATIVE is None:
    if os.environ.get("LIGHTGATE_NATIVE") == "1":
        pytest.fail("LIGHTGATE_NATIVE=1 but the native extension is not installed")
    pytest.skip("the native extension is not installed", allow_module_level=True)

STORE_TS = 1_700_000_000_000
TOPICS = ["a/b", "a/c", "d/e/f", "g"]


def _requests(seed: int) -> list[tuple[list[Message], list[list[str]], Stamp | None]]:
    """A seeded mix of appends, made afresh for each log (an append fills its messages)."""
    rng = random.Random(seed)
    out: list[tuple[list[Message], list[list[str]], Stamp | None]] = []
    seq = 0
    last: tuple[int, int] | None = None  # the producer's last request: (seq, count)
    for i in range(120):
        roll = rng.random()
        if roll < 0.15 and last is not None:  # a producer's retry: stored once
            first, n = last
            msgs = [Message("t", b"p%d" % (first + k), qos=1, born_ts=i) for k in range(n)]
            out.append((msgs, [["t#0"]] * n, Stamp("p1", "t", 0, first)))
        elif roll < 0.35:
            n = rng.randint(1, 4)
            msgs = [Message("t", b"p%d" % (seq + k), qos=1, born_ts=i) for k in range(n)]
            out.append((msgs, [["t#0"]] * n, Stamp("p1", "t", 0, seq)))
            last, seq = (seq, n), seq + n
        elif roll < 0.38:  # no record holds a client id this long: refused alone
            msgs = [Message("g", b"x", client_id="c" * 70_000)]
            out.append((msgs, [["g"]], None))
        else:
            msgs, queues = [], []
            for _ in range(rng.randint(1, 5)):
                topic = rng.choice(TOPICS)
                props: dict[str, Any] = {}
                if rng.random() < 0.3:
                    props = {"user": [["k", "v"]], "correlation_data": rng.randbytes(4)}
                msgs.append(Message(topic, rng.randbytes(rng.randint(0, 300)),
                                    qos=rng.randint(0, 2), retain=rng.random() < 0.1,
                                    client_id=f"dev{i}", properties=props, born_ts=i,
                                    key=rng.choice(["", "k1"])))
                qs = [topic]
                if topic.startswith("a/"):
                    qs.append("a/+")
                queues.append(qs)
            out.append((msgs, queues, None))
    return out


def _run(directory: Path, engine: bool, flush: str, seed: int) -> list[Any]:
    log = CommitLog(directory / "log", ConsumeQueueIndex(directory / "index"),
                    segment_size=2048, flush=flush)
    log.open()
    if engine:
        log.start_engine(1, 1)
    answers: list[Any] = []
    try:
        for msgs, queues, stamp in _requests(seed):
            try:
                stored = log.append(msgs, queues, stamp).result(10)
            except Exception as exc:  # noqa: BLE001 - what each refuses, compared
                # Python's encoder says struct.error for a field past its length prefix,
                # the engine a ValueError naming the field.
                answers.append(("refused", str(exc) if engine else ""))
                continue
            answers.append([(m.phys_offset, m.size, m.store_ts, m.queues) for m in stored])
        answers.append(_index(log))
        answers.append([(m.phys_offset, m.body, m.queues) for m in log.scan(0)])
    finally:
        log.close()
        log.index.close()
    return answers


def _index(log: CommitLog) -> dict[str, Any]:
    queues = ["t#0", "a/+", *TOPICS]
    return {q: (log.index.min_offset(q), log.index.max_offset(q),
                [(e.offset, e.phys_offset, e.size, e.store_ts)
                 for e in log.index.read(q, 0, 10_000)]) for q in queues} | {
        "key": log.index.find_key("k1", 10_000), "checkpoint": log.index.checkpoint()}


def _segments(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((directory / "log").iterdir())
            if len(p.name) == 20 and p.name.isdigit()}


@pytest.mark.parametrize("flush", ["async", "sync"])
def test_same_log_and_index_as_the_python_writer(tmp_path: Path, flush: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(commitlog_module, "_now_ms", lambda: STORE_TS)  # one clock for both
    py = _run(tmp_path / "py", False, flush, seed=11)
    native = _run(tmp_path / "native", True, flush, seed=11)
    refused = [a[1] for a in native if isinstance(a, tuple)]
    assert refused and all("client id too long" in why for why in refused)
    assert [("refused", "") if isinstance(a, tuple) else a for a in native] == py
    assert _segments(tmp_path / "native") == _segments(tmp_path / "py")
    assert len(_segments(tmp_path / "py")) > 5  # rolls

    # The Python CommitLog recovers the engine's log as its own.
    again = CommitLog(tmp_path / "native" / "log", ConsumeQueueIndex(tmp_path / "reindex"),
                      segment_size=2048)
    report = again.open()
    try:
        assert report.truncated_at is None
        assert _index(again) == py[-2]
    finally:
        again.close()
        again.index.close()


@pytest.mark.parametrize("read_back", [True, False])
def test_native_publishes_and_python_appends_share_offsets_in_log_order(
        tmp_path: Path, read_back: bool) -> None:
    log = CommitLog(tmp_path / "log", ConsumeQueueIndex(tmp_path / "index"),
                    segment_size=4096)
    log.open()
    heard: list[Any] = []
    ends: list[int] = []
    log.on_batch = lambda msgs, grown: bool(heard.extend(msgs) or ends.append(grown["a/b"]))
    engine = log.start_engine(2, 1)
    if read_back:  # a reader of the queue wants the bodies, or none
        engine.want_queues(["a/b"], 60.0)
    listener = socket.create_server(("127.0.0.1", 0))
    publisher, fd = pair(listener)
    try:
        engine.adopt(1, fd, **SETTINGS)
        for i in range(40):  # a native publish, then a Python append, in turn
            publisher.sendall(mqtt.encode_publish("a/b", b"n%d" % i, 1, False, False, i + 1, 4))
            assert recv_exact(publisher, 4)[3] == i + 1  # acked: in the log
            log.append([Message("a/b", b"p%d" % i)], [["a/b"]]).result(10)
        entries = log.index.read("a/b", 0, 1000)  # Python's append dispatched all before it
        assert [e.offset for e in entries] == list(range(80))
        bodies = [log.read(e.phys_offset, e.size).body for e in entries]
        assert bodies == [b for i in range(40) for b in (b"n%d" % i, b"p%d" % i)]
        # Notify hears of every batch's queues and ends; the recent ring gets the
        # messages in log order: Python's appends, and the native publishes only for a
        # reader that wants their bodies (the engine kept their records: none is read
        # back from the log).
        assert ends == sorted(ends) and ends[-1] == 80
        wanted = entries if read_back else entries[1::2]
        assert [(m.phys_offset, m.queues[0]) for m in heard] == [
            (e.phys_offset, ("a/b", e.offset)) for e in wanted]
        assert [m.body for m in heard] == (bodies if read_back else bodies[1::2])
        assert len(log.segments()) > 1  # rolls the engine made, known to readers
        assert log.max_offset == engine.write_pos
    finally:
        publisher.close()
        log.close()
        log.index.close()


def test_the_dispatcher_indexes_native_publishes_on_its_own(tmp_path: Path) -> None:
    log = CommitLog(tmp_path / "log", ConsumeQueueIndex(tmp_path / "index"))
    log.open()
    engine = log.start_engine(1, 1)
    engine.register_wildcard("a/+")
    listener = socket.create_server(("127.0.0.1", 0))
    publisher, fd = pair(listener)
    try:
        engine.adopt(1, fd, **SETTINGS)
        publisher.sendall(b"".join(mqtt.encode_publish("a/b", b"%d" % i, 1, False, False,
                                                       i + 1, 4) for i in range(10)))
        recv_exact(publisher, 40)
        deadline = time.monotonic() + 5
        while log.index.max_offset("a/+") < 10 and time.monotonic() < deadline:
            time.sleep(0.01)  # no reader asks: the dispatcher thread, woken by the engine
        assert log.index.max_offset("a/+") == 10
    finally:
        publisher.close()
        log.close()
        log.index.close()


def test_replication_is_refused_with_the_engine(tmp_path: Path) -> None:
    log = CommitLog(tmp_path / "log", ConsumeQueueIndex(tmp_path / "index"))
    log.open()
    log.start_engine(1, 1)
    try:
        for call in (lambda: log.write_raw(0, b"", 0), lambda: log.truncate_to(0),
                     lambda: log.restart_at(10)):
            with pytest.raises(Exception, match="native engine"):
                call()
    finally:
        log.close()
        log.index.close()


def test_a_full_disk_refuses_the_append_and_loses_nothing(tmp_path: Path) -> None:
    mnt = tmp_path / "small"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        ballast = mnt / "ballast"
        ballast.write_bytes(b"\0" * (64 * 1024))  # taken back to make room again
        log = CommitLog(mnt / "log", ConsumeQueueIndex(tmp_path / "index"),
                        segment_size=64 * 1024, flush="sync")
        log.open()
        log.start_engine(1, 1)
        acked: list[Message] = []
        try:
            with pytest.raises(StoreFullError):
                for i in range(1000):
                    acked += log.append([Message("t", b"%05d" % i + b"x" * 3000)],
                                        [["t"]]).result(10)
            assert [m.queues for m in acked] == [[("t", i)] for i in range(len(acked))]
            entries = log.index.read("t", 0, 10_000)
            assert [log.read(e.phys_offset, e.size).body for e in entries] == \
                [m.body for m in acked]
            ballast.unlink()
            [after] = log.append([Message("t", b"after")], [["t"]]).result(10)
            assert after.queues == [("t", len(acked))]  # the refused one took no offset
        finally:
            log.close()
            log.index.close()
        again = CommitLog(mnt / "log", ConsumeQueueIndex(tmp_path / "index2"),
                          segment_size=64 * 1024)
        report = again.open()
        try:
            assert report.truncated_at is None
            assert [m.body for m in again.scan(0)] == [m.body for m in acked] + [b"after"]
        finally:
            again.close()
            again.index.close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)



def test_close_dispatches_what_the_engine_appended_last(tmp_path: Path) -> None:
    log = CommitLog(tmp_path / "log", ConsumeQueueIndex(tmp_path / "index"))
    log.open()
    engine = log.start_engine(1, 1)
    # The dispatcher thread stops first, so that the rows are still the engine's when
    # the log closes (else it races the close for them).
    log._dispatch_stop = True
    engine.wake()
    assert log._dispatcher is not None
    log._dispatcher.join()
    listener = socket.create_server(("127.0.0.1", 0))
    publisher, fd = pair(listener)
    try:
        engine.adopt(1, fd, **SETTINGS)
        publisher.sendall(b"".join(mqtt.encode_publish("a/b", b"%d" % i, 1, False, False,
                                                       i + 1, 4) for i in range(10)))
        recv_exact(publisher, 40)
    finally:
        log.close()
        log.index.close()
        publisher.close()
    again = CommitLog(tmp_path / "log", ConsumeQueueIndex(tmp_path / "index"))
    report = again.open()
    try:
        assert report.clean_shutdown and report.redispatched == 0  # indexed before the end
        assert [again.read(e.phys_offset, e.size).body
                for e in again.index.read("a/b", 0, 100)] == [b"%d" % i for i in range(10)]
    finally:
        again.close()
        again.index.close()


@pytest.mark.parametrize("flush", ["async", "sync"])
def test_the_flusher_syncs_and_checkpoints_what_the_engine_wrote(tmp_path: Path,
                                                                  flush: str) -> None:
    """async: the flusher fsyncs native publishes and Python's appends within its
    interval; sync: the engine synced each, and the checkpoint follows either way."""
    log = CommitLog(tmp_path / "log", ConsumeQueueIndex(tmp_path / "index"), flush=flush,
                    flush_interval_ms=100)
    log.open()
    engine = log.start_engine(1, 1)
    listener = socket.create_server(("127.0.0.1", 0))
    publisher, fd = pair(listener)
    try:
        engine.adopt(1, fd, **SETTINGS)
        publisher.sendall(mqtt.encode_publish("a/b", b"native", 1, False, False, 1, 4))
        recv_exact(publisher, 4)
        log.append([Message("a/b", b"python")], [["a/b"]]).result(10)
        end = engine.write_pos
        assert end == log.max_offset > 0
        # The native append's latency, in the gateway's buckets (they add up).
        bounds, counts, count, total = engine.append_latency()
        assert tuple(bounds) == APPEND_BUCKETS and count >= 1 and total > 0
        assert counts[-1] == count and counts == sorted(counts)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (
                engine.flushed < end or log._read_checkpoint() != end):
            time.sleep(0.05)
        assert engine.flushed == end == log.flushed_offset
        assert log._read_checkpoint() == end  # recovery verifies from here after a crash
    finally:
        publisher.close()
        log.close()
        log.index.close()


def test_the_flusher_does_not_wait_for_a_lazy_dispatch(tmp_path: Path) -> None:
    """Native publishes nobody in Python hears are dispatched late (`DISPATCH_LAZY_S`),
    and fsync'd within the flush interval all the same."""
    log = CommitLog(tmp_path / "log", ConsumeQueueIndex(tmp_path / "index"),
                    flush="async", flush_interval_ms=20)
    log.open()
    log.on_batch = lambda msgs, grown: False
    engine = log.start_engine(1, 1)
    listener = socket.create_server(("127.0.0.1", 0))
    publisher, fd = pair(listener)
    try:
        engine.adopt(1, fd, **SETTINGS)
        for i in range(1, 4):  # the first batch is heard of at once; then it is lazy
            publisher.sendall(mqtt.encode_publish("a/b", b"m", 1, False, False, i, 4))
            recv_exact(publisher, 4)
            if i == 1:
                time.sleep(0.05)
        end, t0 = engine.write_pos, time.monotonic()
        while engine.flushed < end and time.monotonic() - t0 < 5:
            time.sleep(0.002)
        # Within the interval (and a loaded machine's delay), long before the dispatch.
        took = time.monotonic() - t0
        assert took < DISPATCH_LAZY_S * 0.6, f"fsync waited {took:.3f} s for the dispatch"
    finally:
        publisher.close()
        log.close()
        log.index.close()


def _publish_slowly(log: CommitLog, n: int) -> socket.socket:
    """`n` native QoS 1 publishes, one every ~5 ms, each acknowledged (in the log)."""
    listener = socket.create_server(("127.0.0.1", 0))
    publisher, fd = pair(listener)
    log.engine.adopt(1, fd, **SETTINGS)
    for i in range(n):
        publisher.sendall(mqtt.encode_publish("a/b", b"m%d" % i, 1, False, False, i + 1, 4))
        assert recv_exact(publisher, 4)[3] == i + 1
        time.sleep(0.005)
    return publisher


@pytest.mark.parametrize("heard", [True, False])
def test_dispatch_waits_longer_while_nobody_in_python_hears(tmp_path: Path,
                                                            heard: bool) -> None:
    """Native publishes only native subscribers read: the dispatcher takes them into the
    index in fewer, larger batches; a reader of the index dispatches first, at once."""
    log = CommitLog(tmp_path / "log", ConsumeQueueIndex(tmp_path / "index"))
    log.open()
    batches: list[int] = []  # the queue's end after each

    def on_batch(msgs: list[Any], grown: dict[str, int]) -> bool:
        batches.append(grown["a/b"])
        return heard

    log.on_batch = on_batch
    log.start_engine(1, 1)
    publisher = _publish_slowly(log, 60)  # ~0.4 s
    try:
        log.catch_up()  # a reader: everything is in the index when it returns
        assert [e.offset for e in log.index.read("a/b", 0, 100)] == list(range(60))
        assert batches[-1] == 60
        if heard:  # one per 5 ms window
            assert len(batches) > 20
        else:  # one per DISPATCH_LAZY_S
            assert len(batches) < 15
    finally:
        publisher.close()
        log.close()


def test_while_nobody_reads_bodies_only_the_queue_names_are_told(tmp_path: Path) -> None:
    """No queue is read in Python and no message is this process's: the dispatch writes
    the engine's packed runs into the index and tells `on_batch` the queues' names and
    ends, with no message; once a reader wants a queue, its messages come whole."""
    log = CommitLog(tmp_path / "log", ConsumeQueueIndex(tmp_path / "index"))
    log.open()
    grown: list[dict[str, int]] = []
    heard: list[Any] = []
    log.on_batch = lambda msgs, names: bool(heard.extend(msgs) or grown.append(names))
    engine = log.start_engine(1, 1)
    publisher = _publish_slowly(log, 10)
    try:
        log.catch_up()
        assert heard == [] and set().union(*grown) == {"a/b", "a#0"}
        assert grown[-1] == {"a/b": 10, "a#0": 10}
        assert [e.offset for e in log.index.read("a/b", 0, 100)] == list(range(10))
        assert [e.offset for e in log.index.read("a#0", 0, 100)] == list(range(10))
        engine.want_queues(["a/b"], 60.0)
        publisher.sendall(mqtt.encode_publish("a/b", b"late", 1, False, False, 99, 4))
        assert recv_exact(publisher, 4)[3] == 99
        log.catch_up()
        assert [m.body for m in heard] == [b"late"]
        assert log.index.read("a/b", 10, 1)[0].phys_offset == heard[0].phys_offset
        engine.want_queues(["a/b"], 0.0)  # its reader went: the next comes without it
        publisher.sendall(mqtt.encode_publish("a/b", b"later", 1, False, False, 98, 4))
        assert recv_exact(publisher, 4)[3] == 98
        log.catch_up()
        assert len(heard) == 1 and grown[-1] == {"a/b": 12, "a#0": 12}
    finally:
        publisher.close()
        log.close()



def _reads_while_handed_back(directory: Path) -> list[BaseException]:
    """One round: a thread reads as a store node's event loop does while this one hands
    the log back; what the reads raised."""
    import threading

    log = CommitLog(directory / "log", ConsumeQueueIndex(directory / "index"))
    log.open()
    errors: list[BaseException] = []
    done = threading.Event()

    def read() -> None:
        try:
            while not done.is_set():
                log.catch_up()
                log.undispatched()
                time.sleep(0.0002)  # (as often as reads come: the stop gets a turn)
        except BaseException as exc:  # noqa: BLE001 - what the test reports
            errors.append(exc)

    try:
        log.start_engine(1, 1)
        msgs = [Message(topic="a/b", body=b"x") for _ in range(50)]
        log.append(msgs, [["a/b"]] * len(msgs)).result(10)
        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(0.005)
        try:
            log.hand_back()
        finally:
            done.set()
            reader.join(10)
        assert log.engine is None
        assert len(log.index.read("a/b", 0, 1000)) >= len(msgs)
    finally:
        log.close()
        log.index.close()
    return errors


def test_readers_go_on_while_another_thread_hands_the_log_back(tmp_path: Path) -> None:
    """A store group's node hands its engine back in a worker thread (a role change)
    while its event loop reads (a tick's catch-up, a PULL at the head): the reads go on.
    (The stop held the engine's borrow while it waited, and a reader's call raised
    "Already mutably borrowed", which ended the node.)"""
    for _ in range(20):
        assert _reads_while_handed_back(tmp_path) == []
