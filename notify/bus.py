"""What every notify bus shares: the RESYNC sentinel, subscriptions with a bounded,
merging buffer, the counters, and the `Bus` protocol the transports implement.

This module imports no transport (they import it); `notify.open_bus` picks one.

An event is only a hint, "queue X has new data": delivering a name twice or late costs a
pull that finds nothing, so batches of names can always be merged by set union. That is
what keeps memory bounded without ever dropping a name.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Protocol

import trio

# In a batch: "events may have been lost (e.g. Redis reconnected): re-check every queue".
# '*' may also be a real MQTT topic; treating it as RESYNC then only costs a re-check.
RESYNC = "*"

DEFAULT_WINDOW = 0.002  # seconds during which published names merge into one batch
DEFAULT_BUFFER = 16  # batches a subscriber may have pending before they merge


class Grown(set[str]):
    """A batch of names that also says where some of those queues end: `ends[name]` is
    the offset the queue's next message gets, as the store said once it appended (a
    name without one grew to an end nobody said). A reader already at a queue's end
    need not pull it: the store's notify of a gateway's own publishes, which that
    gateway delivered from the store's answers, then costs no pull. A plain set works
    wherever a batch does: every name is then "grew, end unknown"."""

    __slots__ = ("ends",)

    def __init__(self, names: Iterable[str] = (), ends: dict[str, int] | None = None) -> None:
        super().__init__(names)
        self.ends: dict[str, int] = {} if ends is None else ends

    def merge(self, names: Iterable[str]) -> None:
        """Add a batch's names: an end said twice is the larger; a name added again
        without one loses it (it may have grown past it)."""
        merge_ends(self, self.ends, names, ends_of(names))
        self.update(names)


def merge_ends(names: set[str], ends: dict[str, int], more: Iterable[str],
               more_ends: dict[str, int]) -> None:
    """The ends of `names` once `more` (with `more_ends`) join them (call before they
    do): the larger of two ends; none when either said none."""
    for name in more:
        end = more_ends.get(name)
        if end is None:
            ends.pop(name, None)
        elif name in ends or name not in names:
            ends[name] = max(end, ends.get(name, end))


def ends_of(names: Iterable[str]) -> dict[str, int]:
    """The ends a batch says (a `Grown`, or a mapping of name to end); none of a plain
    collection of names."""
    if isinstance(names, Grown):
        return names.ends
    if isinstance(names, Mapping):
        return {n: e for n, e in names.items() if isinstance(e, int)}
    return {}


def grown(names: Iterable[str]) -> Grown:
    """A batch of its own of these names, with the ends they say."""
    return Grown(names, dict(ends_of(names)))


class Counters:
    """Counters for metrics. `published`: names given to publish (after dedup within a
    call); `delivered`: names handed to subscribers, summed over subscribers; `merged`:
    names that vanished into a set already holding them (within a window, or in a full
    subscriber buffer); `errors`: transport failures (lost connections, failed sends,
    malformed payloads).
    Updated from several threads, hence `count` under a lock."""

    def __init__(self) -> None:
        self._counters_lock = threading.Lock()
        self.published = 0
        self.delivered = 0
        self.merged = 0
        self.errors = 0

    def count(self, published: int = 0, delivered: int = 0, merged: int = 0,
              errors: int = 0) -> None:
        with self._counters_lock:
            self.published += published
            self.delivered += delivered
            self.merged += merged
            self.errors += errors

    def counters(self) -> dict[str, int]:
        return {"published": self.published, "delivered": self.delivered,
                "merged": self.merged, "errors": self.errors}


class Subscription:
    """`async for names in subscription`: batches (`set[str]`) in arrival order.

    At most `buffer` batches wait here; when a new batch finds the buffer full it is
    merged (set union) into the last waiting batch. So a slow subscriber never stalls the
    bus nor grows without bound: its backlog is at most `buffer - 1` batches plus one set
    of distinct names. Iteration ends once the subscription or the bus is closed and the
    waiting batches are consumed. Used from the trio thread only.
    """

    def __init__(self, counters: Counters, buffer: int = DEFAULT_BUFFER) -> None:
        if buffer < 1:
            raise ValueError("a subscription buffers at least one batch")
        self._counters = counters
        self._buffer = buffer
        self._batches: deque[Grown] = deque()
        self._wakeup = trio.Event()
        self.closed = False

    def pending(self) -> int:
        """Batches waiting to be received."""
        return len(self._batches)

    def push(self, names: Iterable[str]) -> None:
        """Queue a batch (copied: batches are shared between subscribers), with the ends
        it says (`Grown`)."""
        if self.closed:
            return
        if len(self._batches) < self._buffer:
            batch = grown(names)
            if not batch:
                return
            self._batches.append(batch)
        else:
            last = self._batches[-1]
            before = len(last)
            n = len(names) if isinstance(names, set | frozenset | Mapping) else None
            if n is None:
                names = list(names)
                n = len(names)
            last.merge(names)
            self._counters.count(merged=before + n - len(last))
        self._wakeup.set()

    def close(self) -> None:
        self.closed = True
        self._wakeup.set()

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Grown:
        while not self._batches:
            if self.closed:
                raise StopAsyncIteration
            self._wakeup = trio.Event()
            await self._wakeup.wait()
        # A checkpoint even when a batch is ready, so that a busy `async for` still lets
        # other tasks run (and can be cancelled).
        await trio.lowlevel.checkpoint()
        if not self._batches:  # closed and drained while we yielded
            raise StopAsyncIteration
        batch = self._batches.popleft()
        self._counters.count(delivered=len(batch))
        return batch

    async def receive(self) -> Grown:
        """The next batch; raises trio.EndOfChannel once closed and drained."""
        try:
            return await self.__anext__()
        except StopAsyncIteration:
            raise trio.EndOfChannel from None


class Bus(Protocol):
    """What the gateway and the store need from a bus (LocalBus and RedisBus)."""

    @property
    def healthy(self) -> bool: ...

    def publish(self, names: Iterable[str]) -> None: ...

    def publish_from_thread(self, names: Iterable[str]) -> bool | None:
        """From any thread. False: nobody in this process wanted any of the names (the
        store's writer may take its time with the next ones); True or None: someone
        did, or may have."""

    def subscribe(self) -> AbstractAsyncContextManager[Subscription]: ...

    def counters(self) -> dict[str, int]: ...
