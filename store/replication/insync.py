"""The in-sync set and the acknowledgements that wait on it (sans-IO: times and offsets
come in as arguments). RocketMQ's SyncStateSet: the replicas that hold everything the
master holds, give or take `max_lag_bytes` and `max_lag_s`. In sync mode an append is
acknowledged once `min_insync` nodes of the set (the master counts) hold its bytes."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any


@dataclass
class Replica:
    node: str
    addr: str
    offset: int
    seen: float  # monotonic time of its last fetch
    insync: bool = False
    meta: int = -1  # the master's metadata change it has applied (-1: another incarnation)
    meta_complete: bool = True  # False amid a snapshot copied in pages: it lacks some


class InSync:
    def __init__(self, min_insync: int, max_lag_bytes: int, max_lag_s: float) -> None:
        self.min_insync = min_insync
        self.max_lag_bytes = max_lag_bytes
        self.max_lag_s = max_lag_s
        self.replicas: dict[str, Replica] = {}
        self._pending: deque[tuple[int, float, Any]] = deque()  # (end, deadline, item)

    # -- membership -----------------------------------------------------------------
    def report(self, node: str, addr: str, offset: int, now: float, master_end: int,
               meta_complete: bool = True) -> bool:
        """A replica fetched from `offset` (it holds everything before). True if the set
        changed."""
        rep = self.replicas.get(node)
        if rep is None:
            rep = self.replicas[node] = Replica(node, addr, offset, now)
        rep.addr, rep.offset, rep.seen = addr, offset, now
        rep.meta_complete = meta_complete
        return self._judge(rep, now, master_end)

    def refresh(self, now: float, master_end: int) -> bool:
        changed = False
        for rep in self.replicas.values():
            changed |= self._judge(rep, now, master_end)
        return changed

    def _judge(self, rep: Replica, now: float, master_end: int) -> bool:
        ok = (now - rep.seen <= self.max_lag_s and master_end - rep.offset <= self.max_lag_bytes
              and rep.meta_complete)
        if ok == rep.insync:
            return False
        rep.insync = ok
        return True

    def members(self) -> list[str]:
        """The in-sync replicas (the master not included)."""
        return sorted(r.node for r in self.replicas.values() if r.insync)

    def fetching(self, now: float, within: float) -> int:
        """Replicas that fetched within `within` s (they take this node for master)."""
        return sum(1 for r in self.replicas.values() if now - r.seen <= within)

    def enough(self) -> bool:
        return 1 + len(self.members()) >= self.min_insync

    def meta_quorum(self, master_seq: int) -> int:
        """The metadata change up to which `min_insync` nodes of the set have applied
        every change (-1: the set is too small)."""
        seqs = sorted([master_seq, *(r.meta for r in self.replicas.values() if r.insync)],
                      reverse=True)
        return seqs[self.min_insync - 1] if len(seqs) >= self.min_insync else -1

    def quorum_offset(self, master_end: int) -> int:
        """The offset below which `min_insync` nodes of the set hold every byte (-1: the
        set is too small)."""
        offsets = sorted([master_end, *(r.offset for r in self.replicas.values() if r.insync)],
                         reverse=True)
        if len(offsets) < self.min_insync:
            return -1
        return offsets[self.min_insync - 1]

    # -- acknowledgements waiting for replicas ----------------------------------------
    def wait(self, end: int, deadline: float, item: Any) -> None:
        self._pending.append((end, deadline, item))

    def ready(self, master_end: int) -> list[Any]:
        """Items whose bytes `min_insync` nodes hold now, in order."""
        q = self.quorum_offset(master_end)
        out = []
        while self._pending and self._pending[0][0] <= q:
            out.append(self._pending.popleft()[2])
        return out

    def expired(self, now: float) -> list[Any]:
        """Items past their deadline (and every later one: acks stay in order)."""
        if not self._pending or self._pending[0][1] > now:
            return []
        out = [item for _, _, item in self._pending]
        self._pending.clear()
        return out

    def pending(self) -> int:
        return len(self._pending)
