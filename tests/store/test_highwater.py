"""The queues' high-water marks (store.highwater): written before offsets reach them,
read back after a crash, and the floors recovery takes from them."""

from __future__ import annotations

import orjson

from store import highwater
from store.commitlog import ABORT_FILE
from store.highwater import HighWater, parse
from store.record import Message


def test_marks_are_raised_ahead_and_read_back(tmp_path) -> None:
    hw = HighWater(tmp_path)
    hw.open({})
    hw.cover([("a", 0), ("b", 0), ("a", 1)])
    assert hw.mark("a") == hw.mark("b") == 1 + highwater.STEP_MIN  # covers "a" 1 too
    writes = hw.writes
    hw.cover([("a", 5), ("b", 10)])  # below their marks: nothing written
    assert hw.writes == writes == 1
    hw.cover([("a", 100_000)])
    assert hw.mark("a") == 100_001 + 25_000
    assert parse(hw.path.read_bytes()) == hw.marks()
    # A torn last record (its append never went on) is left out.
    raw = hw.path.read_bytes()
    hw.path.write_bytes(raw[:-3])
    first = 1 + highwater.STEP_MIN
    assert parse(hw.path.read_bytes()) == {"a": first, "b": first}
    hw.path.write_bytes(raw)
    hw.close()
    again = HighWater(tmp_path)
    assert again.load() == {"a": 125_001, "b": first}
    again.open(again.load())
    assert again.raise_for([("b", first)]) == [first + 1 + highwater.STEP_MIN]
    again.clear()
    assert again.load() == {} and again.mark("a") == 0
    again.close()


def test_a_new_queue_writes_its_mark_once_in_its_first_thousand_messages(tmp_path) -> None:
    """Each write is an fdatasync in the appender's path (the event loop of a store
    whose log is async): a queue's first messages after a start must not pay one every
    few dozen messages."""
    hw = HighWater(tmp_path)
    hw.open({})
    for offset in range(1000):
        hw.cover([("dev/1/t", offset)])
    assert hw.writes == 1
    hw.close()


def test_the_file_is_rewritten_when_mostly_stale(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(highwater, "COMPACT_MIN", 0)
    hw = HighWater(tmp_path)
    hw.open({})
    for i in range(0, 200 * highwater.STEP_MIN, highwater.STEP_MIN):
        hw.cover([("q", i)])
    assert hw.path.stat().st_size <= 4 * (highwater.HEAD.size + 1) + 64
    assert parse(hw.path.read_bytes()) == {"q": hw.mark("q")}
    hw.close()


def test_a_new_queue_among_thousands_reads_no_other_mark(tmp_path) -> None:
    """A fleet's first round opens a queue per device, each a mark written: deciding
    whether the file is worth rewriting must not walk every queue's mark each time
    (5,000 queues were 12.5 million steps), and it still rewrites when mostly stale."""
    walks = 0

    class Marks(dict):
        def __iter__(self):
            nonlocal walks
            walks += 1
            return super().__iter__()

        def items(self):
            nonlocal walks
            walks += 1
            return super().items()

    hw = HighWater(tmp_path)
    hw.open({f"dev/{i}/t": 1 + highwater.STEP_MIN for i in range(2000)})
    hw._marks = Marks(hw._marks)
    for i in range(2000, 2100):
        hw.cover([(f"dev/{i}/t", 0)])
    assert walks == 0 and hw.writes == 100
    # The size it keeps of the live marks is the one a walk gives (the rewrite's rule).
    walk = sum(highwater.HEAD.size + len(q.encode()) for q in dict.keys(hw._marks))
    assert hw._live_bytes() == walk
    hw.cover([("dev/5/t", hw.mark("dev/5/t")), ("dév/é", 0)])
    walk += highwater.HEAD.size + len("dév/é".encode())
    assert hw._live_bytes() == walk
    hw.close()


def _append(log, topic: str) -> Message:
    return log.append([Message(topic, b"x")], [[topic]]).result(5)[0]


def test_floors_follow_the_marks_only_when_records_may_be_lost(logs) -> None:
    """A crash on the same boot keeps the page cache: the log holds every record and
    the queues end where they did. After a reboot (another boot id in the abort file)
    an async log may have lost its unsynced tail: the queues resume at their marks."""
    log = logs.open()
    for _ in range(3):
        _append(log, "m/t")
    logs.crash(log)
    log = logs.open()
    assert log.report.marked_queues == 0 and log.index.max_offset("m/t") == 3
    _append(log, "m/t")
    logs.crash(log)
    abort = log.dir / ABORT_FILE
    abort.write_bytes(orjson.dumps({**orjson.loads(abort.read_bytes()), "boot": "other"}))
    log = logs.open()
    assert log.report.marked_queues == 1
    assert log.index.max_offset("m/t") == 1 + highwater.STEP_MIN
    assert _append(log, "m/t").queues == [("m/t", 1 + highwater.STEP_MIN)]
    logs.close(log)  # clean: no marks left, and none needed
    assert HighWater(log.dir).load() == {}
    log = logs.open()
    assert log.index.max_offset("m/t") == 2 + highwater.STEP_MIN
