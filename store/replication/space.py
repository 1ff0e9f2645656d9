"""Whether a store node of a group has room on its disk to take writes (sans-IO: the
errors and the free bytes come in as arguments).

A node is full from the first write that failed for want of space, or once its disk has
less than FULL_BELOW_BYTES free, until ROOM_AGAIN_BYTES are free: the gap keeps a node
that frees a little from flapping between taking writes and refusing them. While full a
node writes nothing of its own accord (a master steps down, a replica stops copying), so
that RocksDB, whose writes on a full disk fail or stall, is left alone until there is
room again."""

from __future__ import annotations

import errno

from store.common import StoreFullError

FULL_BELOW_BYTES = 1 << 20
ROOM_AGAIN_BYTES = 16 << 20


def no_space(exc: BaseException) -> bool:
    """Whether `exc` says the disk is full: ENOSPC, the CommitLog's StoreFullError, or
    RocksDB's message (its errors are plain Exceptions)."""
    if isinstance(exc, StoreFullError):
        return True
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return "No space left on device" in str(exc)


class Space:
    def __init__(self, full_below: int = FULL_BELOW_BYTES,
                 room_again: int = ROOM_AGAIN_BYTES) -> None:
        self.full_below = full_below
        self.room_again = room_again
        self.full: str | None = None  # why this node is full (None: it has room)

    def failed(self, exc: BaseException) -> bool:
        """A write failed; True if that makes the node full (it was not)."""
        if not no_space(exc) or self.full is not None:
            return False
        self.full = str(exc) or "no space left on device"
        return True

    def measured(self, free: int) -> bool | None:
        """The disk has `free` bytes: True if the node is now full, False if it has
        room again, None if nothing changed."""
        if self.full is None and free < self.full_below:
            self.full = f"{free} bytes free on the disk"
            return True
        if self.full is not None and free >= self.room_again:
            self.full = None
            return False
        return None
