"""The master's metadata change log: every metadata write (sessions, offsets,
subscriptions, retained, wildcards, users, policies, consumer groups) as ops with a
sequence number, kept in memory for replicas to copy. A replica that is too far behind,
or that copied another incarnation (another master, or this one before a restart),
gets a snapshot of every column family instead."""

from __future__ import annotations

import threading
import uuid
from collections import deque
from collections.abc import Callable
from itertools import islice

from store.metadata import MetaOp
from store.record import dumps_json

MAX_OPS = 100_000
MAX_BYTES = 8 << 20  # of ops in one answer (a frame holds 64 MiB)


class MetaLog:
    def __init__(self, on_record: Callable[[], None] | None = None,
                 max_ops: int = MAX_OPS) -> None:
        self.incarnation = uuid.uuid4().hex
        self.seq = 0
        self._ops: deque[tuple[int, MetaOp]] = deque(maxlen=max_ops)
        self._lock = threading.Lock()
        self.on_record = on_record
        # Told of each change as recorded, in order (under the lock): the first op's
        # seq and the ops as `since` answers encode them (a group master's native
        # server answers replicas a few changes behind with them).
        self.tap: Callable[[int, list[bytes]], None] | None = None

    def record(self, ops: list[MetaOp]) -> None:
        with self._lock:
            first = self.seq + 1
            for op in ops:
                self.seq += 1
                self._ops.append((self.seq, op))
            if self.tap is not None and ops:
                self.tap(first, [dumps_json(op) for op in ops])
        if self.on_record is not None:
            self.on_record()

    def since(self, incarnation: str, seq: int, limit: int = 10_000,
              max_bytes: int = MAX_BYTES) -> tuple[list[MetaOp], int] | None:
        """The ops after `seq` (at most `limit`, and about `max_bytes` of keys and values
        encoded: they travel in one frame) and the seq they reach; None when the replica
        needs a snapshot (another incarnation, or ops it missed are gone)."""
        with self._lock:
            if incarnation != self.incarnation or seq > self.seq:
                return None
            if seq == self.seq:
                return [], seq
            first = self._ops[0][0] if self._ops else self.seq + 1
            if seq + 1 < first:
                return None
            skip = seq + 1 - first
            ops = list(islice(self._ops, skip, skip + limit))
        out: list[MetaOp] = []
        size = 0
        for _, op in ops:
            out.append(op)
            size += len(op[2]) + len(dumps_json(op[3]))
            if size >= max_bytes:
                break
        return out, seq + len(out)
