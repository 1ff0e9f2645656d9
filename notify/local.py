"""In-process notify bus: topic-name events merged per short window, broadcast to every
subscriber (DESIGN.md step 5)."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

import trio

RESYNC = "*"  # "events may have been lost: re-check every queue"


class _Subscriber:
    """Pending names of one subscriber. Names are idempotent hints ("queue X grew"), so
    a slow subscriber's backlog is a set union: bounded by distinct names, never lost."""

    def __init__(self) -> None:
        self.pending: set[str] = set()
        self.ready = trio.Event()

    def add(self, names: set[str]) -> None:
        self.pending |= names
        self.ready.set()

    async def __aiter__(self) -> AsyncIterator[set[str]]:
        while True:
            await self.ready.wait()
            names, self.pending = self.pending, set()
            self.ready = trio.Event()
            if names:
                yield names


class LocalBus:
    """`async with LocalBus() as bus`: publish from trio or any thread, subscribe in trio."""

    def __init__(self, window: float = 0.002) -> None:
        self.window = window
        self._subs: list[_Subscriber] = []
        self._lock = threading.Lock()
        self._incoming: set[str] = set()
        self._wake: trio.Event | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self.healthy = True
        self.published = 0
        self.delivered = 0
        self.merged = 0

    async def __aenter__(self) -> LocalBus:
        self._token = trio.lowlevel.current_trio_token()
        self._wake = trio.Event()
        self._cm = trio.open_nursery()
        self._nursery = await self._cm.__aenter__()
        self._nursery.start_soon(self._pump)
        return self

    async def __aexit__(self, *exc: object) -> bool | None:
        assert self._nursery is not None
        self._nursery.cancel_scope.cancel()
        return await self._cm.__aexit__(*exc)

    # -- publishing -------------------------------------------------------------------
    def _merge(self, names: Iterable[str]) -> bool:
        """Add to the pending set; True if it was empty (the pump must be woken)."""
        with self._lock:
            before = len(self._incoming)
            names = set(names)
            self._incoming |= names
            self.published += len(names)
            self.merged += before + len(names) - len(self._incoming)
            return before == 0

    def publish(self, names: Iterable[str]) -> None:
        """From the trio thread."""
        self._merge(names)
        if self._wake is not None:
            self._wake.set()

    def publish_from_thread(self, names: Iterable[str]) -> None:
        """From any other thread (the store's writer thread)."""
        if self._merge(names) and self._token is not None:
            try:
                self._token.run_sync_soon(self._set_wake)
            except trio.RunFinishedError:
                pass

    def _set_wake(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _pump(self) -> None:
        while True:
            assert self._wake is not None
            await self._wake.wait()
            self._wake = trio.Event()
            await trio.sleep(self.window)  # let events of the same burst merge
            with self._lock:
                names, self._incoming = self._incoming, set()
            if names:
                self.deliver(names)

    def deliver(self, names: set[str]) -> None:
        for sub in self._subs:
            sub.add(names)
        self.delivered += len(names)

    # -- subscribing ------------------------------------------------------------------
    @asynccontextmanager
    async def subscribe(self) -> AsyncIterator[_Subscriber]:
        sub = _Subscriber()
        self._subs.append(sub)
        try:
            yield sub
        finally:
            self._subs.remove(sub)


@asynccontextmanager
async def open_bus(url: str | None = None) -> AsyncIterator[Any]:
    """None or "local": in-process; "redis://host:port": across nodes via Redis."""
    if url in (None, "", "local"):
        async with LocalBus() as bus:
            yield bus
    elif url.startswith(("redis://", "rediss://", "unix://")):
        from notify.redis_transport import RedisBus

        async with RedisBus(url) as bus:
            yield bus
    else:
        raise ValueError(f"unknown notify transport {url!r}: use redis://HOST:PORT")
