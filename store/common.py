"""What the store interface's callers see of both implementations, embedded and remote:
the error family, `PullResult`, and `await_future` for the futures `publish_start`
returns. Nothing of the engine (CommitLog, RocksDB) is imported here, so the remote
client and the gateway need not load it to name these."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from store.record import Message


class StoreError(Exception):
    """The store could not take the message; nothing of it was kept."""


DISK_FULL = "no space left on the store's disk"  # what a client is told (both planes)


class StoreFullError(StoreError):
    """No space left on the store's disk."""

    def __init__(self, message: str = DISK_FULL) -> None:
        super().__init__(message)


class StoreClosedError(StoreError):
    """The CommitLog is closed or has failed."""


class StoreUnavailable(StoreError):
    """No connection to the store right now (it is reconnecting)."""


class AnswerLost(StoreUnavailable):
    """The request went to the store and its answer never came (the connection was lost,
    or stayed silent past the timeout): unlike the other StoreUnavailable, the store may
    have carried it out."""


@dataclass
class PullResult:
    messages: list[Message]
    next_offset: int  # where the next pull should start
    min_offset: int
    max_offset: int  # one past the last entry in the queue


@dataclass
class RawPull:
    """A PULL answered with records as the log holds them (see EmbeddedStore.pull_raw):
    `runs` of [log offset, bytes, first queue offset, records] whose bytes are `data`,
    one run after the other."""

    runs: list[list[int]]
    data: bytes
    next_offset: int
    min_offset: int
    max_offset: int


@dataclass
class HistoryBatch:
    """One batch of a topic filter's history (see store.history for what it holds)."""

    messages: list[Message]
    ends: dict[str, int]  # topic -> offset in its exact-topic queue after the last one here
    cursor: str | None  # continue with it; None when the history is done
    cut: bool  # older messages than the start asked for existed and retention removed them
    end: int  # the log position the history stops at (fixed by the first batch)

    @property
    def done(self) -> bool:
        return self.cursor is None


@dataclass
class QueueSeek:
    """Where a queue's messages stored at or after a time begin."""

    offset: int  # the first offset stored at or after the time (max_offset: none was)
    min_offset: int  # the first offset the queue keeps
    max_offset: int  # its end
    cut: bool  # the time lies before what retention kept of this queue


class FutureLike(Protocol):
    """What `await_future` uses of a future: a concurrent.futures.Future (the remote
    store, the CommitLog writer thread) or the CommitLog's InlineFuture."""

    def done(self) -> bool: ...

    def result(self, timeout: float | None = None) -> Any: ...

    def add_done_callback(self, fn: Callable[[Any], object]) -> None: ...


async def await_future(fut: FutureLike) -> Any:
    """Wait for a concurrent future without blocking trio (no thread per call). Settled
    from another thread (the CommitLog writer), it wakes the loop through its token; from
    this one (the native client's reader task), it sets the event directly: no wake-up
    through the loop's socket pair and no extra pass of the loop."""
    if not fut.done():
        token = trio.lowlevel.current_trio_token()
        loop_thread = threading.get_ident()
        done = trio.Event()

        def wake(_: object) -> None:
            if threading.get_ident() == loop_thread:
                done.set()
            else:
                token.run_sync_soon(done.set)

        fut.add_done_callback(wake)
        await done.wait()
    return fut.result()
