"""The gateway's cache of recent messages per queue (gateway.cache): its window follows
the queue's end, from reads of the store and from this gateway's own appends."""

from __future__ import annotations

import trio

from gateway.cache import QueueCache
from store.common import PullResult
from store.record import Message

QUEUE = "dev/+/t"


def _msgs(first: int, n: int) -> list[Message]:
    return [Message(topic=f"dev/{i}/t", body=b"%d" % i, queues=[(QUEUE, i)])
            for i in range(first, first + n)]


class _SlowStore:
    """A remote store whose next PULL answer waits until the test lets it go (a store
    answering later than the gateway's own appends are acknowledged)."""

    def __init__(self) -> None:
        self.go = trio.Event()
        self.answer: list[Message] = []

    async def pull(self, queue: str, offset: int, max_count: int = 32,
                   wait_ms: int = 0) -> PullResult:
        await self.go.wait()
        return PullResult(self.answer, offset + len(self.answer), 0, offset + len(self.answer))


async def test_an_answer_overtaken_by_the_gateways_appends_does_not_move_the_window_back(
        ) -> None:
    store = _SlowStore()
    cache = QueueCache(store)  # type: ignore[arg-type]
    store.answer, store.go = _msgs(0, 10), trio.Event()
    store.go.set()
    assert [m.body for m in (await cache.pull(QUEUE, 0))[0]] == [b"%d" % i for i in range(10)]
    # A subscriber reads on from 10 while the store's answer (10..14) is on its way,
    # and this gateway's appends 10..19 are acknowledged meanwhile.
    store.answer, store.go = _msgs(10, 5), trio.Event()
    got: list[Message] = []
    async with trio.open_nursery() as nursery:
        async def read() -> None:
            got.extend((await cache.pull(QUEUE, 10))[0])
        nursery.start_soon(read)
        await trio.sleep(0.01)
        cache.offer(_msgs(10, 10))
        store.go.set()
    assert [m.body for m in got][:5] == [b"%d" % i for i in range(10, 15)]
    # The window still ends at 20: the next appends continue it, and a subscriber at 15
    # is served from memory, not from the store.
    cache.offer(_msgs(20, 5))
    misses = cache.misses
    rest, start = cache.pull_now(QUEUE, 15, 64) or ([], -1)
    assert start == 15 and [m.body for m in rest] == [b"%d" % i for i in range(15, 25)]
    assert cache.misses == misses


async def test_an_empty_answer_anchors_the_window_for_the_gateways_appends() -> None:
    """A subscriber that caught up (the store answered nothing at its offset) is served
    this gateway's next appends from memory."""
    store = _SlowStore()
    cache = QueueCache(store)  # type: ignore[arg-type]
    store.go.set()
    assert await cache.pull(QUEUE, 7) == ([], 7)
    cache.offer(_msgs(8, 2))  # another's append took 7: not ours to start the window
    assert cache.pull_now(QUEUE, 7, 64) is None
    cache.offer(_msgs(7, 3))
    got, start = cache.pull_now(QUEUE, 7, 64) or ([], -1)
    assert start == 7 and [m.body for m in got] == [b"7", b"8", b"9"]
