"""The newest messages of queues being read: served from memory, and only when exact."""

from __future__ import annotations

import gc
import time
import tracemalloc
from pathlib import Path

import pytest

from store import recent, record
from store.recent import RecentMessages
from store.record import Message
from store.service import EmbeddedStore, StoreConfig


def msg(queue: str, offset: int, body: bytes = b"x") -> Message:
    m = Message(queue, body)
    m.queues = [(queue, offset)]
    return m


def telling(r: RecentMessages) -> list[tuple[list[str], float]]:
    """What `r` tells the native engine its readers read (`want`)."""
    told: list[tuple[list[str], float]] = []
    r.want = lambda names, seconds: told.append((names, seconds))
    return told


def test_a_ring_starts_at_a_dispatched_message_after_a_read() -> None:
    r = RecentMessages()
    r.add([msg("q", 0)])
    assert r.get("q", 0, 10) is None  # nobody read q before: no ring, read the store
    r.add([msg("q", 1)])  # q is wanted now: its ring starts here
    assert r.get("q", 0, 10) is None  # below the ring
    got, end = r.get("q", 1, 10)
    assert [m.queues[0][1] for m in got] == [1] and end == 2
    assert r.get("q", 2, 10) == ([], 2)  # at the end: nothing new, known without a read
    assert r.get("q", 3, 10) is None  # past the end (a repaired log): the store decides


def test_a_gap_restarts_the_ring() -> None:
    r = RecentMessages()
    r.get("q", 0, 1)
    r.add([msg("q", 5), msg("q", 6)])
    r.add([msg("q", 9)])  # offsets jumped (floors after a repair)
    assert r.get("q", 5, 10) is None
    assert [m.queues[0][1] for m in r.get("q", 9, 10)[0]] == [9]


def test_a_message_without_its_body_ends_the_ring() -> None:
    """A native publish dispatched while nobody read its queue comes without its body
    (only its queue's new end does): a ring that would otherwise end before it must not
    answer "nothing new"."""
    r = RecentMessages()
    told = telling(r)
    r.get("q", 0, 1)
    assert told == [(["q"], recent.IDLE_S)]  # a miss: the next message is wanted
    r.add([msg("q", 0)])
    r.grew({"q": 1})  # a ring that ends where its queue does stays
    assert r.get("q", 1, 10) == ([], 1)
    r.grew({"q": 2, "other": 5})  # offset 1 came without its body
    assert r.get("q", 1, 10) is None  # read it from the store
    assert told[-1] == (["q"], recent.IDLE_S)  # that miss wants the next message
    r.add([msg("q", 2)])
    assert [m.queues[0][1] for m in r.get("q", 2, 10)[0]] == [2]


def test_a_ring_tells_the_engine_at_most_twice_per_wanted_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A ring read again and again tells the engine its queue is read once per
    WANTED_S / 2, each time for longer than WANTED_S: a reader that stops is no longer
    given bodies soon after, one that reads on never misses one."""
    r = RecentMessages()
    told = telling(r)
    r.get("q", 0, 1)
    r.add([msg("q", 0)])  # the ring starts: wanted for WANTED_S unless read
    for _ in range(100):
        assert r.get("q", 0, 10) is not None
    assert told == [(["q"], recent.IDLE_S), (["q"], recent.WANTED_S * 1.5)]
    later = time.monotonic() + recent.WANTED_S / 2
    monkeypatch.setattr(recent.time, "monotonic", lambda: later)
    r.get("q", 0, 10)
    assert told[2:] == [(["q"], recent.WANTED_S * 1.5)]


def test_a_reader_that_misses_again_and_again_tells_the_engine_once() -> None:
    """A reader with no ring (reading the store, or waiting at the end) wants the next
    message: the engine is told once per IDLE_S / 2, not once per read."""
    r = RecentMessages()
    told = telling(r)
    for _ in range(100):
        assert r.get("q", 0, 1) is None
    assert told == [(["q"], recent.IDLE_S)]


def test_a_ring_nobody_reads_stops_being_fed_for_a_while(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A queue read once (a subscription's first pull) and then never: past UNREAD_MAX
    messages its ring goes, the engine is told to stop keeping its records, and the
    reader's misses start no ring for COLD_S; one that reads in between keeps its."""
    monkeypatch.setattr(recent, "UNREAD_MAX", 10)
    r = RecentMessages()
    told = telling(r)
    for q in ("once", "read"):
        r.get(q, 0, 1)
    offsets = {"once": 0, "read": 0}

    def feed(n: int) -> None:
        for _ in range(n):
            r.add([msg(q, offsets[q]) for q in offsets])
            offsets["once"] += 1
            offsets["read"] += 1
            got = r.get("read", offsets["read"], 10)
            assert got == ([], offsets["read"])  # at the end, from the ring

    feed(9)
    assert r.get("once", 0, 10) is not None  # still kept: a read now...
    feed(20)  # ... then none for 20 messages
    assert r.stats()["queues"] == 1
    assert told[-1] == (["once"], 0.0)
    told.clear()
    assert r.get("once", offsets["once"], 10) is None  # cold: read the store
    r.add([msg("once", offsets["once"])])
    assert r.get("once", offsets["once"], 10) is None and told == []
    later = time.monotonic() + recent.COLD_S
    monkeypatch.setattr(recent.time, "monotonic", lambda: later)
    assert r.get("once", offsets["once"] + 1, 10) is None
    assert told == [(["once"], recent.IDLE_S)]  # a miss wants the next message again
    r.add([msg("once", offsets["once"] + 1)])
    assert r.get("once", offsets["once"] + 1, 10) is not None


def test_memory_is_bounded() -> None:
    r = RecentMessages(per_queue=10, max_bytes=50_000)
    for q in range(20):
        r.get(f"q{q}", 0, 1)
    for i in range(100):
        r.add([msg(f"q{q}", i, b"x" * 1000) for q in range(20)])
    s = r.stats()
    assert s["bytes"] <= 50_000
    got = r.get("q19", 95, 100)
    assert got is None or len(got[0]) <= 20


@pytest.mark.parametrize(("body", "topic", "client", "queues"), [
    (64, "flow/a", "pub", ["flow/a"]),
    (1024, "flow/a", "pub", ["flow/a"]),
    (0, "building-7/floor-3/room-12/temperature", "", ["building-7/floor-3/room-12/temperature"]),
    (256, "plant/line-4/press", "sensor-0000123456",
     ["plant/line-4/press", "plant/#", "+/line-4/+"]),
])
def test_the_ring_counts_what_its_messages_hold(body: int, topic: str, client: str,
                                                queues: list[str]) -> None:
    """The byte budget is of what the kept messages hold, as read back from the log for
    the ring (a native publish is): not less (within a tenth), and not much more (an
    empty body and client id are shared objects, counted as any other)."""
    now = 1_700_000_000_000  # ms: a time stamp is an int object of its own
    records = [record.encode(Message(topic, b"p" * body, client_id=client, born_ts=now + i,
                                     store_ts=now + i, queues=[(q, 1000 + i) for q in queues]))
               for i in range(5000)]
    r = RecentMessages(per_queue=10**6, max_bytes=1 << 40)
    gc.collect()
    tracemalloc.start()
    try:
        r.get(queues[0], 1000, 1)  # its reader: the ring starts at the next message
        r.add([record.decode(raw, 0, 64 * i) for i, raw in enumerate(records)])
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    counted = r.stats()["bytes"]
    assert 0.9 * held <= counted <= 1.2 * held, (counted / len(records), held / len(records))


async def test_pull_at_the_head_is_served_from_memory(tmp_path: Path) -> None:
    async with EmbeddedStore.open(StoreConfig(data_dir=tmp_path)) as store:
        await store.publish([Message("a/b", b"%d" % i) for i in range(3)])
        first = await store.pull("a/b", 0, 10)  # from the log; the queue is now wanted
        await store.publish([Message("a/b", b"%d" % i) for i in range(3, 6)])
        hits = store.recent.hits
        res = await store.pull("a/b", 3, 10)
        assert store.recent.hits == hits + 1
        assert [m.body for m in first.messages + res.messages] == [b"%d" % i for i in range(6)]
        assert (res.next_offset, res.max_offset) == (6, 6)
        # the same answer as the log gives
        logged = store.pull_sync("a/b", 3, 10)
        assert [(m.msg_id, m.body, m.topic) for m in logged.messages] == \
            [(m.msg_id, m.body, m.topic) for m in res.messages]
        assert (await store.pull("a/b", 6, 10)).messages == []


def test_a_ring_whose_reader_went_native_is_not_read_back_and_goes_when_its_queue_grows(
) -> None:
    r = RecentMessages()
    told = telling(r)
    r.get("q", 0, 1)
    r.add([msg("q", 0), msg("q", 1)])
    assert r.get("q", 2, 10) == ([], 2)
    r.unwant(["q"])  # its reader was promoted to the native plane
    assert told[-1] == (["q"], 0.0)  # the engine keeps its records no longer
    assert r.get("q", 2, 10) == ([], 2)  # still exact until the queue grows
    r.grew({"q": 3})  # grown by messages that came without their bodies
    assert r.get("q", 2, 10) is None  # not "nothing new": the store answers
    assert told[-1] == (["q"], recent.IDLE_S)  # that miss wants the next one
