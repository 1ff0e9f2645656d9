"""The in-sync set and the acknowledgements that wait on it (sans-IO: times and offsets
come in as arguments). RocketMQ's SyncStateSet, Kafka's ISR: the nodes that hold
everything the master acknowledged, so that any of them may be elected without losing
an acknowledged write.

- The set is the controller's: `committed` is what the controller holds (the master
  proposes changes and counts them only once committed, see store.replication.node).
- In sync mode an append is acknowledged once *every* member of the set holds it, and
  only while the set has at least `min_insync` members. A replica joining is waited for
  from the moment it is proposed (`proposed`), before the controller commits it; a
  replica leaving is waited for until its removal is committed. So every member of the
  committed set always holds every acknowledged byte.
- A replica may join only once it holds everything acknowledged so far; it leaves when
  it has not fetched for `max_lag_s`, falls `max_lag_bytes` behind, lacks metadata, or
  says it cannot write what it copies (a full disk: at once, not `max_lag_s` later)."""

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
    caught_up: bool = False  # fetching, near the end, metadata complete
    meta: int = -1  # the master's metadata change it has applied (-1: another incarnation)
    meta_complete: bool = True  # False amid a snapshot copied in pages: it lacks some
    failed: str | None = None  # why it cannot write what it copies (None: it can)


class InSync:
    def __init__(self, master: str, min_insync: int, max_lag_bytes: int,
                 max_lag_s: float) -> None:
        self.master = master
        self.min_insync = min_insync
        self.max_lag_bytes = max_lag_bytes
        self.max_lag_s = max_lag_s
        self.replicas: dict[str, Replica] = {}
        self.committed: set[str] = {master}  # the controller's set, master included
        self.proposed: set[str] | None = None  # a change on its way to the controller
        self.proposed_at = 0.0
        self._pending: deque[tuple[int, float, Any]] = deque()  # (end, deadline, item)

    # -- replicas and the set they make ------------------------------------------------
    def report(self, node: str, addr: str, offset: int, now: float, master_end: int,
               meta_complete: bool = True, failed: str | None = None) -> None:
        """A replica fetched from `offset` (it holds everything before); `failed`: why
        it could not write what it fetched last."""
        rep = self.replicas.get(node)
        if rep is None:
            rep = self.replicas[node] = Replica(node, addr, offset, now)
        rep.addr, rep.offset, rep.seen = addr, offset, now
        rep.meta_complete, rep.failed = meta_complete, failed
        self._judge(rep, now, master_end)

    def refresh(self, now: float, master_end: int) -> None:
        for rep in self.replicas.values():
            self._judge(rep, now, master_end)

    def _judge(self, rep: Replica, now: float, master_end: int) -> None:
        rep.caught_up = (now - rep.seen <= self.max_lag_s and rep.meta_complete
                         and rep.failed is None
                         and master_end - rep.offset <= self.max_lag_bytes)

    def desired(self, acked: int) -> set[str]:
        """The set the master wants: itself and the caught-up replicas; one not in the
        committed set joins only once it holds everything acknowledged (`acked`)."""
        out = {self.master}
        for rep in self.replicas.values():
            if rep.caught_up and (rep.node in self.committed or rep.offset >= acked):
                out.add(rep.node)
        return out

    def members(self) -> list[str]:
        """The committed set's replicas (the master not included)."""
        return sorted(self.committed - {self.master})

    def required(self) -> set[str]:
        """The replicas an acknowledgement waits for: the committed set's and those
        proposed to join it."""
        return (self.committed | (self.proposed or set())) - {self.master}

    def enough(self) -> bool:
        return len(self.committed) >= self.min_insync

    def why_out(self) -> str:
        """Why the replicas outside the set cannot be in it, as far as they said: a
        write that failed (a full disk), for each that reported one ("" if none did)."""
        return "; ".join(f"{r.node} cannot write ({r.failed})"
                         for r in sorted(self.replicas.values(), key=lambda r: r.node)
                         if r.failed and r.node not in self.committed)

    def _offset_of(self, node: str) -> int:
        rep = self.replicas.get(node)
        return rep.offset if rep is not None else 0

    def ack_offset(self, master_end: int) -> int:
        """The offset below which every required node holds every byte (-1: the
        committed set is smaller than min_insync)."""
        if not self.enough():
            return -1
        return min([master_end, *(self._offset_of(n) for n in self.required())])

    def meta_quorum(self, master_seq: int) -> int:
        """The metadata change up to which every required node has applied every
        change (-1: the committed set is too small)."""
        if not self.enough():
            return -1
        seqs = [self.replicas[n].meta if n in self.replicas else -1 for n in self.required()]
        return min([master_seq, *seqs])

    def fetching(self, now: float, within: float) -> int:
        """Replicas that fetched within `within` s (they take this node for master)."""
        return sum(1 for r in self.replicas.values() if now - r.seen <= within)

    # -- acknowledgements waiting for replicas ----------------------------------------
    def wait(self, end: int, deadline: float, item: Any) -> None:
        self._pending.append((end, deadline, item))

    def ready(self, upto: int) -> list[Any]:
        """Items whose bytes all end at or before `upto`, in order."""
        out = []
        while self._pending and self._pending[0][0] <= upto:
            out.append(self._pending.popleft()[2])
        return out

    def expired(self, now: float) -> list[Any]:
        """Items past their deadline (and every later one: acks stay in order)."""
        if not self._pending or self._pending[0][1] > now:
            return []
        return self.drain()

    def drain(self) -> list[Any]:
        out = [item for _, _, item in self._pending]
        self._pending.clear()
        return out

    def pending(self) -> int:
        return len(self._pending)
