"""Regressions for defects found in the CommitLog and the queues: offsets after retention and a
restart (store level and end to end over MQTT), the segment list shared by the writer
and retention, and the directory fsync after a segment roll."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from gateway import mqtt
from lightqueue.index import ConsumeQueueIndex
from store import record
from store.commitlog import CommitLog
from store.record import CorruptRecord, Message
from tests.conftest import Server
from tests.mqtt.raw import RawClient


def _open(root: Path, **kw: object) -> tuple[CommitLog, ConsumeQueueIndex]:
    index = ConsumeQueueIndex(root / "index")
    log = CommitLog(root / "log", index, **kw)
    log.open()
    return log, index


def _close(log: CommitLog, index: ConsumeQueueIndex) -> None:
    log.close()
    index.close()


def _append(log: CommitLog, topic: str, body: bytes = b"x" * 1000) -> Message:
    [m] = log.append([Message(topic, body)], [[topic]]).result(10)
    return m


# -- 3: offsets keep rising across retention and restarts ------------------------------


def test_queue_offsets_are_not_reused_after_retention_and_restart(tmp_path: Path) -> None:
    log, index = _open(tmp_path, segment_size=16 * 1024)
    assert [_append(log, "idle/t").offset_in("idle/t") for _ in range(3)] == [0, 1, 2]
    for _ in range(100):  # filler: many segments past the idle queue's
        _append(log, "busy/t")
    log.enforce_retention(retention_bytes=32 * 1024)
    assert index.min_offset("idle/t") == index.max_offset("idle/t") == 3  # entries gone
    _close(log, index)
    log, index = _open(tmp_path, segment_size=16 * 1024)
    try:
        assert [_append(log, "idle/t").offset_in("idle/t") for _ in range(2)] == [3, 4]
    finally:
        _close(log, index)


def test_persistent_subscriber_gets_messages_after_retention_and_restart(
        tmp_path: Path) -> None:
    """The issue's reproduction: a persistent subscriber acks 0-2 of idle/t and leaves,
    retention removes every entry of idle/t, the server restarts, two messages follow."""
    srv = Server(tmp_path / "data", "--segment-size", "65536", "--retention-bytes",
                 "131072", "--retention-check-s", "0.2").start()
    try:
        sub = RawClient(srv.port)
        sub.connect("idle-sub", clean=False)
        sub.subscribe("idle/t", 1)
        pub = RawClient(srv.port)
        pub.connect("idle-pub")
        for i in range(3):
            pub.send(mqtt.Publish("idle/t", b"old%d" % i, 1, False, False, i + 1))
            assert isinstance(pub.recv(), mqtt.Puback)
        for _ in range(3):
            p = sub.recv()
            sub.send(mqtt.Puback(p.packet_id))
        sub.send(mqtt.Disconnect())
        sub.close()
        for i in range(400):  # ~400 kB of filler: retention must remove idle/t's segment
            pub.send(mqtt.Publish("filler/t", b"f" * 1000, 1, False, False, i % 60000 + 10))
            assert isinstance(pub.recv(), mqtt.Puback)
        time.sleep(1.0)  # a retention round
        pub.close()
        assert srv.stop() == 0
        srv.start()
        pub = RawClient(srv.port)
        pub.connect("idle-pub-2")
        for i in range(2):
            pub.send(mqtt.Publish("idle/t", b"new%d" % i, 1, False, False, i + 1))
            assert isinstance(pub.recv(), mqtt.Puback)
        back = RawClient(srv.port)
        assert back.connect("idle-sub", clean=False).session_present
        got = [back.recv() for _ in range(2)]
        assert [p.payload for p in got] == [b"new0", b"new1"]
        back.close()
        pub.close()
    finally:
        if srv.proc is not None:
            assert srv.stop() == 0, srv.logs()[-3000:]


# -- suspicion: the segment list, changed by the writer's roll and by retention ---------


def test_a_roll_during_retention_keeps_the_new_segment(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Retention (a worker thread) removes the oldest segment while the writer rolls to
    a new one. Each read-modify-writes the segment tuple; widen the window between read
    and write in retention and the roll must still be kept."""
    log, index = _open(tmp_path, segment_size=8 * 1024)
    try:
        for _ in range(20):
            _append(log, "a/t")
        original = CommitLog._set_segments
        in_retention = threading.Event()

        def slow_set(self: CommitLog, segs: tuple) -> None:
            if threading.current_thread().name == "retention":
                in_retention.set()
                time.sleep(0.3)  # the writer rolls meanwhile
            original(self, segs)

        monkeypatch.setattr(CommitLog, "_set_segments", slow_set)
        total = sum(size for _, size in log.segments())
        t = threading.Thread(target=log.enforce_retention, name="retention",
                             kwargs={"retention_bytes": total - 1})  # the oldest goes
        t.start()
        assert in_retention.wait(5)
        last = [_append(log, "a/t") for _ in range(12)]  # rolls at least once
        t.join()
        files = sorted(int(p.name) for p in (tmp_path / "log").iterdir() if p.name.isdigit())
        listed = [base for base, _ in log.segments()]
        assert listed == files, (listed, files)
        for m in last:
            assert log.read(m.phys_offset).body == m.body
    finally:
        _close(log, index)


# -- suspicion: the directory entry of a new segment is durable before an ack -----------


def test_sync_flush_fsyncs_the_directory_after_a_roll(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    log, index = _open(tmp_path, segment_size=8 * 1024, flush="sync")
    try:
        logdir = str((tmp_path / "log").resolve())
        first = len(log.segments())
        while len(log.segments()) == first:
            synced.clear()
            m = _append(log, "a/t")
        # The append that rolled has been acknowledged: the new file's name is durable.
        assert m.phys_offset >= log.segments()[-1][0]
        assert logdir in synced, synced
    finally:
        _close(log, index)


# -- 3, continued: an index rebuilt from the log keeps what retention left behind --------


def _trim_idle_queue(root: Path) -> None:
    """idle/t gets offsets 0-2, then retention removes every record (and entry) of it."""
    log, index = _open(root, segment_size=16 * 1024)
    assert [_append(log, "idle/t").offset_in("idle/t") for _ in range(3)] == [0, 1, 2]
    for _ in range(100):
        _append(log, "busy/t")
    assert log.enforce_retention(retention_bytes=32 * 1024)
    assert index.max_offset("idle/t") == 3 and not index.read("idle/t", 0, 10)
    _close(log, index)


def test_an_index_rebuilt_after_a_cut_keeps_the_floors_of_trimmed_queues(
        tmp_path: Path) -> None:
    """A torn tail puts the index past the end of the log, so it is rebuilt from the log;
    the rebuild wiped the floor retention had left for idle/t, and it started at 0."""
    _trim_idle_queue(tmp_path)
    last = sorted(p for p in (tmp_path / "log").iterdir() if p.name.isdigit())[-1]
    os.truncate(last, last.stat().st_size - 100)
    index = ConsumeQueueIndex(tmp_path / "index")
    log = CommitLog(tmp_path / "log", index, segment_size=16 * 1024)
    assert log.open().index_rebuilt
    try:
        assert index.max_offset("idle/t") == 3
        assert [_append(log, "idle/t").offset_in("idle/t") for _ in range(2)] == [3, 4]
    finally:
        _close(log, index)


def test_a_lost_index_rebuilt_from_a_trimmed_log_gives_no_trimmed_offset_again(
        tmp_path: Path) -> None:
    """The index is derived data and may be lost (it is rebuilt from the log), but the
    log no longer holds any record of idle/t: its next offset was 0 again, below where a
    persistent reader of it stands (3). Any offset at or past 3 is right (a gap is)."""
    _trim_idle_queue(tmp_path)
    shutil.rmtree(tmp_path / "index")
    log, index = _open(tmp_path, segment_size=16 * 1024)
    try:
        busy = index.read("busy/t", 0, 1000)
        assert busy and busy[-1].offset == 99  # queues with records are rebuilt exactly
        assert index.max_offset("busy/t") == 100
        first = _append(log, "idle/t").offset_in("idle/t")
        assert first >= 3
        assert _append(log, "idle/t").offset_in("idle/t") == first + 1
        assert index.min_offset("idle/t") == first
        assert _append(log, "busy/t").offset_in("busy/t") == 100
    finally:
        _close(log, index)
    log, index = _open(tmp_path, segment_size=16 * 1024)  # and it stays so
    try:
        assert _append(log, "idle/t").offset_in("idle/t") == first + 2
    finally:
        _close(log, index)


# -- suspicion a, continued: retention against a roll the writer undoes ------------------


@pytest.mark.parametrize("retention_finishes", [False, True])
def test_retention_and_a_failed_roll_keep_the_log_writable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, retention_finishes: bool) -> None:
    """A batch wrote its first record to segment A, rolled to B, and failed on the next
    write (disk full); its undo cuts back into A. Retention ran meanwhile:
    - it had seen [A, B] and chosen A, then removed it after the undo made A active
      again: the list was empty, and the writer thread died at the next append;
    - or it removed A before the undo, which then cut B to a negative size: the log
      stopped taking writes."""
    log, index = _open(tmp_path, segment_size=8 * 1024)
    try:
        while len(log.segments()) == 1:
            m = _append(log, "a/t")
        _close(log, index)  # back to one nearly full segment: start over from it
        for p in (tmp_path / "log").iterdir():
            if p.name.isdigit() and int(p.name) >= m.phys_offset:
                p.unlink()
        os.truncate(tmp_path / "log" / "00000000000000000000", m.phys_offset)
        log, index = _open(tmp_path, segment_size=8 * 1024)
        assert log.segments() == [(0, m.phys_offset)]
        room = 8 * 1024 - m.phys_offset
        reached, go = threading.Event(), threading.Event()
        original_update = CommitLog._update_segments
        original_roll = CommitLog._roll

        def update(self: CommitLog, change) -> None:  # noqa: ANN001
            if threading.current_thread().name == "retention":
                reached.set()
                if not retention_finishes:
                    assert go.wait(10)
            original_update(self, change)

        retention = threading.Thread(target=log.enforce_retention, name="retention",
                                     kwargs={"retention_bytes": 1})

        def roll(self: CommitLog) -> None:
            original_roll(self)
            retention.start()  # sees [A, B]: A is to go
            if retention_finishes:
                retention.join(1.0)
            else:
                reached.wait(1.0)
            raise OSError(28, "No space left on device")  # the write after the roll

        monkeypatch.setattr(CommitLog, "_update_segments", update)
        monkeypatch.setattr(CommitLog, "_roll", roll)
        batch = [Message("a/t", b"y" * (room - 200)), Message("a/t", b"z" * 1000)]
        with pytest.raises(Exception, match="no space"):
            log.append(batch, [["a/t"], ["a/t"]]).result(10)
        monkeypatch.setattr(CommitLog, "_roll", original_roll)
        go.set()
        retention.join(10)
        files = sorted(int(p.name) for p in (tmp_path / "log").iterdir() if p.name.isdigit())
        assert [base for base, _ in log.segments()] == files and files
        after = _append(log, "a/t")  # the writer is alive and writes to a listed file
        assert log.read(after.phys_offset).body == after.body
        assert after.phys_offset == m.phys_offset  # the failed batch left nothing
    finally:
        _close(log, index)


# -- retention and recovery meet a record that does not decode ---------------------------


def _flip(path: Path, pos: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(pos)
        b = fh.read(1)
        fh.seek(pos)
        fh.write(bytes([b[0] ^ 0xFF]))


def test_retention_survives_a_corrupt_record_in_the_segment_it_deletes(
        tmp_path: Path) -> None:
    """Old segments are not verified at start-up; retention decodes the oldest to learn
    which index entries go. A flipped byte there raised out of the retention thread,
    which ended the server at every retention check from then on."""
    log, index = _open(tmp_path, segment_size=16 * 1024)
    try:
        idle = [_append(log, "idle/t") for _ in range(3)]
        for _ in range(100):
            _append(log, "busy/t")
        _flip(tmp_path / "log" / "00000000000000000000", idle[1].phys_offset + 60)
        deleted = log.enforce_retention(retention_bytes=32 * 1024)
        assert deleted and deleted[0] == 0
        assert not (tmp_path / "log" / "00000000000000000000").exists()
        assert index.max_offset("idle/t") == 3
        assert _append(log, "idle/t").offset_in("idle/t") == 3
    finally:
        _close(log, index)


def test_recovery_reads_around_a_record_whose_decode_raises_anything(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """record.decode is meant to raise only CorruptRecord; should anything else escape
    it, recovery treats it as damage at that position instead of never starting, and
    reads on after it."""
    log, index = _open(tmp_path)
    sent = [_append(log, "a/t") for _ in range(5)]
    _close(log, index)
    real = record.decode

    def decode(buf, pos=0, phys_offset=-1):  # noqa: ANN001, ANN202
        if phys_offset == sent[3].phys_offset:
            raise IndexError("a decoder bug")
        return real(buf, pos, phys_offset)

    monkeypatch.setattr(record, "decode", decode)
    index = ConsumeQueueIndex(tmp_path / "index")
    log = CommitLog(tmp_path / "log", index)
    report = log.open()
    try:
        assert report.truncated_at is None and report.damaged == 1
        assert [m.body for m in log.scan(0)] == [m.body for m in sent[:3] + sent[4:]]
        assert _append(log, "a/t").offset_in("a/t") >= 5
    finally:
        _close(log, index)


# -- suspicion c, continued: an id inside a record that holds a whole record -------------


def test_read_by_id_refuses_a_record_carried_in_a_body(tmp_path: Path) -> None:
    """Magic, length and CRC all check out for a record that a client sent as its message
    body: reading by an id inside the real record returned the forged one."""
    log, index = _open(tmp_path)
    try:
        forged = record.encode(Message("secret/t", b"forged", client_id="admin", store_ts=1,
                                       queues=[("secret/t", 0)]))
        m = _append(log, "a/t", b"pad" + forged)
        inner = m.phys_offset + record.encode(Message(
            "a/t", b"pad" + forged, store_ts=m.store_ts, queues=m.queues)).index(forged)
        with pytest.raises((CorruptRecord, KeyError)):
            log.read(inner)
        assert log.read(m.phys_offset).body == b"pad" + forged
        with_key = log.append([Message("k/t", b"x", key="k1")], [["k/t"]]).result(10)[0]
        assert log.read(with_key.phys_offset).key == "k1"
    finally:
        _close(log, index)


# -- 3, continued: retention and a kill -9 -----------------------------------------------

_KILLED_AFTER_RETENTION = """
import os, signal, sys
from pathlib import Path
from lightqueue.index import ConsumeQueueIndex
from store.commitlog import CommitLog
from store.record import Message
root = Path(sys.argv[1])
index = ConsumeQueueIndex(root / "index")
log = CommitLog(root / "log", index, segment_size=16 * 1024)
log.open()
def append(topic):
    return log.append([Message(topic, b"x" * 1000)], [[topic]]).result(10)[0]
for _ in range(10):
    append("q/t")
index.flush()  # the index is durable up to here (as after any memtable flush)
assert [append("q/t").offset_in("q/t") for _ in range(3)] == [10, 11, 12]
assert [append("idle/t").offset_in("idle/t") for _ in range(3)] == [0, 1, 2]
for _ in range(100):
    append("busy/t")
assert log.enforce_retention(retention_bytes=32 * 1024)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_offsets_keep_rising_after_retention_and_a_kill(tmp_path: Path) -> None:
    """The index is written without a WAL: after a kill, what it had not flushed is
    re-dispatched from the log. Retention had removed the records the index was missing
    (q/t 10-12, idle/t 0-2) and the floors it left were lost with the memtable, so those
    offsets were given again."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", _KILLED_AFTER_RETENTION, str(tmp_path)],
                          cwd=Path(__file__).parents[2], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == -9, proc.stderr
    log, index = _open(tmp_path, segment_size=16 * 1024)
    try:
        assert _append(log, "q/t").offset_in("q/t") >= 13
        assert _append(log, "idle/t").offset_in("idle/t") >= 3
    finally:
        _close(log, index)


def test_a_recovery_cut_is_durable_before_anything_is_appended(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cut moves the later segments to quarantine; unless the directory is fsync'd, a
    power loss after new (acknowledged) records can bring them back behind those. (A
    segment missing between two others is such a cut: what follows it cannot be
    trusted to follow on.)"""
    log, index = _open(tmp_path, segment_size=8 * 1024)
    for _ in range(30):
        _append(log, "a/t")
    _close(log, index)
    second = sorted(p for p in (tmp_path / "log").iterdir() if p.name.isdigit())[1]
    second.unlink()
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    index = ConsumeQueueIndex(tmp_path / "index")
    log = CommitLog(tmp_path / "log", index, segment_size=8 * 1024, full_verify=True)
    report = log.open()
    try:
        assert report.truncated_at == int(second.name) and report.quarantined
        logdir = (tmp_path / "log").resolve()
        assert str(logdir) in synced and str(logdir / "quarantine") in synced, synced
    finally:
        _close(log, index)
