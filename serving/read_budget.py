"""A node-wide budget for the bytes of packets (MQTT, native frames) received only in part.

A client that announces a large packet and sends its body slowly makes the server hold
what has come so far. One such client is harmless; a thousand are gigabytes. Every
connection reports how much it holds after each read. While the node holds more than
the budget, a connection that holds at least its fair share (the budget divided among
the connections holding anything) stops reading until the node is back within the
budget, and is closed if that takes longer than the timeout. Connections that hold
little, which is every client sending packets smaller than a socket read, keep reading
meanwhile: a stalled attacker cannot stop them.

Where the native data plane carries connections (`lightgate serve` with the engine),
the count is the engine's (`share`): its reactors count their connections' partial
packets in it, and hand a connection that must wait back to this side, which holds it
back and closes it as its own. One budget for the node, whichever plane reads.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol

import trio

READ_SIZE = 65536  # one socket read while the budget has room
READ_WHILE_OVER = 4096
# While over budget the node may hold this much more per connection holding any, and no
# more (a quiet node used 4-5.3 KiB). Fair shares alone do not bound it: a share is the
# budget over the holders so far, so connections that read while holders were still
# arriving keep larger shares (about the budget times 1 + ln(holders at the end / at the
# start) in the worst order).
OVER_PER_HOLDER = READ_WHILE_OVER + 2048


class SharedCount(Protocol):
    """A count kept elsewhere (the native engine's): `partial_update(before, after)` is
    one connection's change, (0, 0) a look, and says (held, holders, peak) after it."""

    def set_partial_limit(self, limit: int) -> None: ...

    def partial_update(self, before: int, after: int) -> tuple[int, int, int]: ...


class ReadBudget:
    def __init__(self, limit: int, timeout: float) -> None:
        self.limit = limit  # 0: no budget
        self.timeout = timeout
        self.held = 0  # bytes of partial packets held by all connections
        self.holders = 0  # connections holding any
        self.peak = 0
        self.exceeded = False  # held > limit (an attribute: read before every socket read)
        self.paused = 0  # reads held back, over the node's life
        self.closed = 0  # connections closed for holding their share too long
        self._freed = trio.Event()
        self._shared: Callable[[int, int], tuple[int, int, int]] | None = None

    def share(self, count: SharedCount) -> None:
        """Count in `count` from now on (before any connection holds anything), with
        the connections the native plane reads: `refresh` whenever it says it freed
        some."""
        count.set_partial_limit(self.limit)
        self._shared = count.partial_update
        if self.held:  # (a group's new master: its Python connections hold some already)
            self._counted(*count.partial_update(0, self.held))
        else:
            self.refresh()

    def unshare(self) -> None:
        """Count alone again, from what the shared count holds now (its owner stops: a
        group's master stepping down, whose native connections are closed)."""
        self.refresh()
        self._shared = None

    def refresh(self) -> None:
        """What the shared count holds now: the native plane's connections change it
        without a word to this side (but when they bring it back within the budget)."""
        if self._shared is not None:
            self._counted(*self._shared(0, 0))

    def update(self, before: int, after: int) -> None:
        """One connection went from holding `before` bytes to `after`."""
        if before == after:
            return
        if self._shared is not None:
            self._counted(*self._shared(before, after))
            return
        self.held += after - before
        if not before:
            self.holders += 1
        elif not after:
            self.holders -= 1
        self._counted(self.held, self.holders, self.held)

    def _counted(self, held: int, holders: int, peak: int) -> None:
        self.held, self.holders = held, holders
        if peak > self.peak:
            self.peak = peak
        was = self.exceeded
        self.exceeded = bool(self.limit) and self.held > self.limit
        if was and not self.exceeded:
            # Waiters wake only when the budget has room again: waking all of them on
            # every freed byte would cost N wake-ups for each of N closing connections.
            self._freed.set()
            self._freed = trio.Event()

    def must_wait(self, holding: int) -> bool:
        """Whether a connection holding `holding` bytes should not read now: while over
        budget, one that holds its share, or any once the node holds the budget plus
        OVER_PER_HOLDER per holder. One that holds nothing always reads (a little: a
        CONNECT or a typical PUBLISH), and adds to that allowance by holding."""
        if not self.exceeded or not holding:
            return False
        holders = max(self.holders, 1)
        return (holding * holders >= self.limit
                or self._over_left(holders) < READ_WHILE_OVER)

    def read_size(self, holding: int, default: int) -> int:
        """How much a connection holding `holding` bytes may read: while the node is over
        budget, no more than what is left of its share or of the allowance over budget,
        and at least a small read, so that the node holds the budget plus a few KiB per
        connection."""
        if not self.exceeded:
            return default
        holders = max(self.holders, 1)
        share = self.limit // holders
        return max(READ_WHILE_OVER, min(default, share - holding, self._over_left(holders)))

    def _over_left(self, holders: int) -> int:
        return holders * OVER_PER_HOLDER - (self.held - self.limit)

    def stats(self) -> dict[str, int]:
        return {"held": self.held, "limit": self.limit, "peak": self.peak,
                "paused": self.paused, "closed": self.closed}

    async def wait(self, holding: int) -> bool:
        """Wait until a connection holding `holding` bytes may read again; False if the
        timeout passed first (the caller closes the connection)."""
        self.paused += 1
        with trio.move_on_after(self.timeout):
            while self.must_wait(holding):
                await self._freed.wait()
            return True
        self.closed += 1
        return False


async def read_fd(fd: int, budget: ReadBudget, holding: int) -> bytes:
    """One read of a non-blocking socket `fd` whose connection holds `holding` bytes, of
    at most what `budget` allows when the data is there (not when the wait began: the
    budget may have run out meanwhile). os.read on the fd, waiting for readiness only
    when nothing is there: trio's stream calls cost two scheduler passes even when data
    is waiting."""
    try:
        data = os.read(fd, budget.read_size(holding, READ_SIZE))
    except BlockingIOError:
        # Waiting inside the except block would keep the exception and its traceback
        # alive for as long as the device stays idle (~550 bytes per connection).
        data = None
    if data is None:
        while True:
            await trio.lowlevel.wait_readable(fd)
            try:
                return os.read(fd, budget.read_size(holding, READ_SIZE))
            except BlockingIOError:  # a spurious wake-up
                continue
    # Data was waiting: yield once anyway, so that a peer that always has more cannot
    # starve the other tasks (nor escape a cancellation). Meanwhile the bytes count
    # against the budget as held: the caller accounts for them only after this returns,
    # and a thousand connections reading in that window each saw the budget as it was
    # before the others' reads (1,000 attackers: 19.9 MiB held against a budget of 8).
    if budget.limit:
        budget.update(holding, holding + len(data))
        try:
            await trio.lowlevel.checkpoint()
        finally:
            budget.update(holding + len(data), holding)
    else:
        await trio.lowlevel.checkpoint()
    return data
