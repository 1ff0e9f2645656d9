"""In-process notify bus: topic-name events ("queue X has new data") merged per short
window and broadcast to every subscriber of this process (a gateway in the store's process).

    async with LocalBus() as bus:
        bus.publish_from_thread({"home/bath/temp"})   # the store's writer thread
        async with bus.subscribe() as events:
            async for names in events: ...            # set[str] batches
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Iterator, Set
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager

import trio

from notify.bus import DEFAULT_BUFFER, DEFAULT_WINDOW, RESYNC, Counters, Subscription, grown

__all__ = ["RESYNC", "LocalBus"]

log = logging.getLogger("lightgate.notify")


class LocalBus(Counters):
    """Publishers add names to one pending set (a lock makes that safe from any thread);
    a pump task wakes on the first name, sleeps `window` so that the burst merges, then
    hands the set to every subscription. Memory is bounded by the distinct names.

    With `window=0` nothing waits: a publish from the trio thread is delivered at once
    (the store appends a whole read's worth of messages at a time, so there is little
    left to merge, and at low rates the window was pure latency and two wake-ups per
    message). Listeners (`listen`) are called synchronously on delivery, with no task
    between the store and the sessions it wakes."""

    def __init__(
        self,
        window: float = DEFAULT_WINDOW,
        buffer: int = DEFAULT_BUFFER,
        counters: Counters | None = None,
    ) -> None:
        """`buffer`: batches a subscriber may have waiting before they merge. `counters`:
        where subscriptions count deliveries and merges (a transport that wraps this bus
        for its fan-out passes itself); this bus by default."""
        super().__init__()
        self._sub_counters = self if counters is None else counters
        self.window = window
        self.buffer = buffer
        self._subs: list[Subscription] = []
        self._listeners: list[Callable[[set[str]], None]] = []
        # Per listener (`listen`): the names it wants of a batch, None if it does not say.
        self._wants: list[Callable[[Set[str]], Collection[str]] | None] = []
        self._lock = threading.Lock()
        self._incoming: set[str] = set()
        self._wake = trio.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._trio_thread = threading.get_ident()
        self._stack: AsyncExitStack | None = None
        self._running = False

    @property
    def healthy(self) -> bool:
        return True  # nothing in-process can be unreachable

    async def __aenter__(self) -> LocalBus:
        self._token = trio.lowlevel.current_trio_token()
        self._trio_thread = threading.get_ident()
        async with AsyncExitStack() as stack:
            stack.callback(self._close)  # last: after the pump is gone
            nursery = await stack.enter_async_context(trio.open_nursery())
            stack.callback(nursery.cancel_scope.cancel)  # first: stop the pump
            nursery.start_soon(self._pump)
            self._running = True
            self._wake.set()  # names published before entering
            self._stack = stack.pop_all()
        return self

    async def __aexit__(self, *exc: object) -> bool | None:
        assert self._stack is not None
        stack, self._stack = self._stack, None
        try:
            return await stack.__aexit__(*exc)
        except BaseExceptionGroup as group:
            # The body of `async with bus:` runs inside our nursery, which wraps whatever
            # it raises; a lone exception of the body's own goes through unwrapped.
            if len(group.exceptions) == 1 and group.exceptions[0] is exc[1]:
                return False
            raise

    def _close(self) -> None:
        self._running = False
        self._token = None
        with self._lock:
            names, self._incoming = self._incoming, set()
        if names:  # published just before exit: still tell whoever is listening
            self.deliver(names)
        for sub in self._subs:
            sub.close()

    # -- publishing -------------------------------------------------------------------
    def _add(self, names: Iterable[str]) -> bool:
        """Merge into the pending set; True if it was empty (the pump must be woken)."""
        new = set(names)
        with self._lock:
            before = len(self._incoming)
            self._incoming |= new
            after = len(self._incoming)
        self.count(published=len(new), merged=before + len(new) - after)
        return before == 0 and bool(new)

    def publish(self, names: Iterable[str]) -> None:
        """Non-blocking; meant for the trio thread (from another one it falls back to
        `publish_from_thread`, as a trio.Event must not be set from outside)."""
        if threading.get_ident() != self._trio_thread:
            self._publish_from_other_thread(names)
        elif self.window <= 0 and self._running:
            batch = names if isinstance(names, set | frozenset) else grown(names)
            self.count(published=len(batch))
            self.deliver(batch)
        elif self._add(names):
            self._wake.set()

    def publish_from_thread(self, names: Iterable[str]) -> bool:
        """Non-blocking; from any thread (the store's writer thread after each append
        batch, or the trio thread itself when the store appends inline). Only the first
        name of a window costs a wake-up of the trio loop. False when no listener wanted
        any of the names (see `listen`)."""
        if threading.get_ident() == self._trio_thread:
            self.publish(names)
            return True
        return self._publish_from_other_thread(names)

    def _publish_from_other_thread(self, names: Iterable[str]) -> bool:
        names = self._wanted(names)
        if self._add(names) and self._token is not None:
            try:
                self._token.run_sync_soon(self._wake_pump)
            except trio.RunFinishedError:
                pass  # the loop is gone: nobody is left to notify
        return bool(names)

    def _wake_pump(self) -> None:
        self._wake.set()

    async def _pump(self) -> None:
        while True:
            await self._wake.wait()
            if self.window > 0:
                await trio.sleep(self.window)  # let the rest of the burst arrive
            with self._lock:
                names, self._incoming = self._incoming, set()
                # Reset under the lock: a thread that finds the set empty from here on
                # schedules a wake-up that lands on this new event.
                self._wake = trio.Event()
            if names:
                self.deliver(names)

    def deliver(self, names: Iterable[str]) -> None:
        """Hand a batch to every subscriber now, skipping the window (trio thread only;
        the Redis transport uses it for batches that were merged before sending)."""
        batch = names if isinstance(names, set | frozenset) else grown(names)
        if not batch:
            return
        for sub in self._subs:
            sub.push(batch)
        for fn in self._listeners:
            try:
                fn(batch)
            except Exception:  # one listener's bug must not stop the store's append
                log.exception("notify listener failed")

    @contextmanager
    def listen(self, fn: Callable[[set[str]], None],
               wants: Callable[[str], bool] | None = None,
               among: Callable[[Set[str]], Collection[str]] | None = None) -> Iterator[None]:
        """Call `fn(names)` in the trio thread on every delivery, synchronously: it must
        not block (e.g. set events). Counted as a delivery like a subscription's.
        `wants(name)`, from any thread: whether `fn` cares for a name; or `among(names)`:
        the names of a batch it cares for (a listener that picks them out of a large
        batch without a call per name: the native engine's dispatch publishes a name per
        queue that grew). While every listener says which and no subscription listens,
        names published from another thread that none of them wants do not wake the
        event loop."""
        def counted(batch: set[str]) -> None:
            self.count(delivered=len(batch))
            fn(batch)

        if among is None and wants is not None:
            among = _one_by_one(wants)
        self._listeners.append(counted)
        self._wants.append(among)
        try:
            yield
        finally:
            self._listeners.remove(counted)
            self._wants.remove(among)

    def _wanted(self, names: Iterable[str]) -> Iterable[str]:
        """The names some listener wants (all of them, unless every listener says)."""
        wants = tuple(self._wants)  # a copy: the trio thread may change the list
        if self._subs or not wants or None in wants:
            return names
        batch = names if isinstance(names, Set) else set(names)
        if len(wants) == 1:
            return wants[0](batch)  # type: ignore[misc]
        return set().union(*(w(batch) for w in wants))  # type: ignore[misc]

    # -- subscribing ------------------------------------------------------------------
    @asynccontextmanager
    async def subscribe(self, buffer: int | None = None) -> AsyncIterator[Subscription]:
        """A subscription receiving every batch from now on (broadcast)."""
        if not self._running:
            raise RuntimeError("subscribe inside `async with LocalBus() as bus`")
        sub = Subscription(self._sub_counters, self.buffer if buffer is None else buffer)
        self._subs.append(sub)
        try:
            yield sub
        finally:
            sub.close()
            self._subs.remove(sub)


def _one_by_one(wants: Callable[[str], bool]) -> Callable[[Set[str]], Collection[str]]:
    """`among` of a listener that says per name."""
    return lambda names: [n for n in names if wants(n)]
