"""Consumer groups of server applications: membership by heartbeat, queue assignment,
committed offsets, redelivery with backoff and a dead-letter queue.

A first-level topic has partitions `topic#0..n-1`; a group's members split them between
themselves. Every member computes nothing: the store assigns, so all members agree.
A failed message is appended again to the group's retry queue `{group}#retry` with its
attempt count and a not-before time; after `max_attempts` it goes to `{group}#dlq`.
"""

from __future__ import annotations

import bisect
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

NUL = "\x00"
MEMBER_TIMEOUT_S = 10.0
MAX_ATTEMPTS = 5
BACKOFF_S = (1, 2, 5, 10, 30, 60)


def retry_queue(group: str) -> str:
    return f"{group}#retry"


def dlq_queue(group: str) -> str:
    return f"{group}#dlq"


def offset_key(group: str, queue: str) -> str:
    return f"group{NUL}{group}{NUL}{queue}"


def assign_average(members: list[str], queues: list[str]) -> dict[str, list[str]]:
    """Contiguous, as even as possible: the first `len(queues) % n` members get one more."""
    members, queues = sorted(members), sorted(queues)
    out: dict[str, list[str]] = {m: [] for m in members}
    if not members:
        return out
    per, extra = divmod(len(queues), len(members))
    pos = 0
    for i, m in enumerate(members):
        n = per + (1 if i < extra else 0)
        out[m] = queues[pos : pos + n]
        pos += n
    return out


def assign_consistent_hash(
    members: list[str], queues: list[str], vnodes: int = 64
) -> dict[str, list[str]]:
    """Each queue goes to the next member on a hash ring: a member leaving moves only its
    own queues."""
    out: dict[str, list[str]] = {m: [] for m in members}
    if not members:
        return out
    ring = sorted((zlib.crc32(f"{m}#{v}".encode()), m) for m in members for v in range(vnodes))
    points = [p for p, _ in ring]
    for q in sorted(queues):
        i = bisect.bisect(points, zlib.crc32(q.encode())) % len(ring)
        out[ring[i][1]].append(q)
    return out


STRATEGIES = {"average": assign_average, "consistent-hash": assign_consistent_hash}


@dataclass
class Group:
    name: str
    topic: str
    strategy: str = "average"
    members: dict[str, float] = field(default_factory=dict)  # member id -> last heartbeat
    generation: int = 0

    def heartbeat(self, member: str, now: float) -> bool:
        """Record a heartbeat; True if membership changed (a rebalance)."""
        changed = member not in self.members
        self.members[member] = now
        return self._expire(now) or changed

    def leave(self, member: str) -> bool:
        return self.members.pop(member, None) is not None

    def _expire(self, now: float) -> bool:
        dead = [m for m, t in self.members.items() if now - t > MEMBER_TIMEOUT_S]
        for m in dead:
            del self.members[m]
        return bool(dead)

    def assignment(self, queues: list[str]) -> dict[str, list[str]]:
        return STRATEGIES[self.strategy](list(self.members), queues)


class GroupRegistry:
    def __init__(self) -> None:
        self.groups: dict[str, Group] = {}

    def heartbeat(
        self, group: str, topic: str, member: str, strategy: str, queues: list[str]
    ) -> dict[str, Any]:
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; one of {sorted(STRATEGIES)}")
        g = self.groups.get(group)
        if g is None or g.topic != topic:
            g = self.groups[group] = Group(group, topic, strategy)
        g.strategy = strategy
        if g.heartbeat(member, time.monotonic()):
            g.generation += 1
        # The retry queue belongs to the group as a whole: one member reads it.
        mine = g.assignment([*queues, retry_queue(group)]).get(member, [])
        return {"generation": g.generation, "queues": mine, "members": sorted(g.members)}

    def leave(self, group: str, member: str) -> None:
        g = self.groups.get(group)
        if g is not None and g.leave(member):
            g.generation += 1


def backoff(attempt: int) -> float:
    return BACKOFF_S[min(attempt - 1, len(BACKOFF_S) - 1)]
