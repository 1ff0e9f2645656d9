"""A persistent session's QoS 1/2 sends kept in batches (gateway.kept_sends): nothing
reaches the outbox before its record is written, and a write that fails takes nothing
away: the sends are undone and the drain resumes at the first of them."""

from __future__ import annotations

import pytest
import trio

from gateway.kept_sends import KeptSends
from gateway.mqtt.events import Outgoing
from gateway.session import Session
from store.api import StoreError


def _session_with(sends: list[Outgoing]) -> Session:
    s = Session("dev-1", persistent=True)
    for o in sends:
        s.outgoing[o.packet_id] = o
    s.cursors["q"] = 13  # the drain went past them
    return s


def _sends() -> list[Outgoing]:
    return [Outgoing(packet_id=i, queue="q", offset=10 + i, data=b"p%d" % i, qos=1)
            for i in (1, 2, 3)]


def test_the_records_go_in_one_write_before_any_publish() -> None:
    sends, written, outbox = _sends(), [], []

    async def persist(batch: list[Outgoing]) -> None:
        assert not outbox, "a PUBLISH went out before its record"
        written.append([o.packet_id for o in batch])

    kept = KeptSends(persist, outbox.append)
    for o in sends:
        kept.add(o, o.data, o.offset)
    trio.run(kept.keep)
    assert written == [[1, 2, 3]] and outbox == [b"p1", b"p2", b"p3"]
    s = _session_with(sends)
    kept.drop(s, "q")  # nothing waits: nothing undone
    assert list(s.outgoing) == [1, 2, 3] and s.cursors["q"] == 13


def test_a_failed_write_sends_nothing_and_the_drain_resumes_at_the_first() -> None:
    sends, outbox = _sends(), []

    async def persist(batch: list[Outgoing]) -> None:
        raise StoreError("no space left on the store's disk")

    kept = KeptSends(persist, outbox.append)
    for o in sends:
        kept.add(o, o.data, o.offset)
    s = _session_with(sends)
    with pytest.raises(StoreError):
        trio.run(kept.keep)
    kept.drop(s, "q")
    assert outbox == [] and not s.outgoing  # window slots and packet ids free again
    assert s.cursors["q"] == 11 and "q" in s.offsets_dirty
