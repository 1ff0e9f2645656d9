"""Consumer.seek(time) against a real store: a member's queues start from the first
message stored at or after a time, back or forward, and the group keeps that position."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime, timedelta

import pytest
import trio

from lightgate import Consumer, Producer
from store.sdk import AsyncConsumer, epoch_ms
from tests.native.test_sdk import drain


def uid(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


def test_epoch_ms() -> None:
    assert epoch_ms(datetime(2025, 11, 25, 8, tzinfo=UTC)) == 1_764_057_600_000
    assert epoch_ms(1_764_057_600_000) == 1_764_057_600_000
    with pytest.raises(TypeError):
        epoch_ms("yesterday")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        epoch_ms(True)


def test_seek_back_and_forward(shared_server) -> None:
    topic, group = uid("sk"), uid("g")
    with Producer(shared_server.native) as producer:
        for i in range(20):
            producer.send(topic, b"old%d" % i, key=f"k{i}")
        time.sleep(0.05)
        middle = datetime.now(UTC)
        time.sleep(0.05)
        for i in range(10):
            producer.send(topic, b"new%d" % i, key=f"k{i}")
    c = Consumer(shared_server.native, group, topic, start="latest")
    try:
        assert c.poll(timeout=0.3) == []  # starts at the end: nothing
        moved = c.seek(middle)
        assert set(moved) == {f"{topic}#{p}" for p in range(4)}  # not the retry queue
        got = drain([c], 10, seconds=10)[0]
        assert sorted(m.body for m in got) == sorted(b"new%d" % i for i in range(10))
        assert all(m.store_time >= epoch_ms(middle) for m in got)
        c.seek(middle - timedelta(hours=1))  # back before everything
        again = drain([c], 30, seconds=10)[0]
        assert len(again) == 30
        c.seek(int(time.time() * 1000) + 60_000)  # forward past the end: nothing yet
        assert c.poll(timeout=0.3) == []
        c.seek(epoch_ms(middle))
    finally:
        c.close()
    # The position was committed: the group goes on from the seek, not from the end.
    back = Consumer(shared_server.native, group, topic)
    try:
        got = drain([back], 10, seconds=10)[0]
        assert sorted(m.body for m in got) == sorted(b"new%d" % i for i in range(10))
    finally:
        back.close()


def test_async_seek(shared_server) -> None:
    topic, group = uid("ska"), uid("g")
    with Producer(shared_server.native) as producer:
        producer.send_batch(topic, [b"a", b"b"], key="one")
        mark = int(time.time() * 1000) + 1
        time.sleep(0.01)
        producer.send_batch(topic, [b"c"], key="one")

    async def run() -> list[bytes]:
        async with AsyncConsumer(shared_server.native, group, topic) as c:
            await c.seek(mark)
            out: list[bytes] = []
            with trio.move_on_after(10):
                while not out:
                    out = [m.body for m in await c.poll(timeout=0.2)]
            return out

    assert trio.run(run) == [b"c"]
