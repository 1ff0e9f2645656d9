"""Budgets for retained messages: how many, and how many bytes, in total and per client.

A retained message outlives its publisher, so a client publishing retained messages to
ever new topics fills the store for good. The budget keeps, per topic, who set it and
its size as stored (topic, properties and payload: a 1-byte payload may carry hundreds
of kB of MQTT 5 user properties), not the message itself, loaded from the store when the
gateway starts and kept current by this gateway's own writes. In separated mode other
gateways' writes are seen on the next start: each gateway enforces the budget over what
it knows, so a cluster may hold up to the budget per gateway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.reserved import is_broker_statistic
from store.api import encode_properties


@dataclass
class RetainedLimits:
    max_count: int = 0  # 0: no limit
    max_bytes: int = 0
    per_client_count: int = 0
    per_client_bytes: int = 0


def stored_size(topic: str, body: bytes, properties: dict[str, Any]) -> int:
    """What a retained message takes in the store: its topic, its properties (encoded as
    the store keeps them) and its payload."""
    return len(topic.encode()) + len(encode_properties(properties)) + len(body)


class RetainedBudget:
    def __init__(self, limits: RetainedLimits) -> None:
        self.limits = limits
        self.topics: dict[str, tuple[str, int]] = {}  # topic -> (client id, stored size)
        self.count = 0
        self.bytes = 0
        self.per_client: dict[str, list[int]] = {}  # client id -> [count, bytes]
        self.refused = 0

    def admit(self, topic: str, client_id: str, size: int) -> str | None:
        """Why setting `topic`'s retained message (`size` bytes, see stored_size) by
        `client_id` would exceed a budget, or None (then it is counted at once, so that
        publishes still on their way to the store count too)."""
        lim = self.limits
        old = self.topics.get(topic)
        d_count = 0 if old else 1
        d_bytes = size - (old[1] if old else 0)
        mine = self.per_client.get(client_id, (0, 0))
        mine_count = mine[0] + (0 if old and old[0] == client_id else 1)
        mine_bytes = mine[1] + size - (old[1] if old and old[0] == client_id else 0)
        why = None
        if lim.max_count and self.count + d_count > lim.max_count:
            why = f"retained message limit of {lim.max_count} reached (--max-retained)"
        elif lim.max_bytes and self.bytes + d_bytes > lim.max_bytes:
            why = f"retained bytes limit of {lim.max_bytes} reached (--max-retained-bytes)"
        elif lim.per_client_count and mine_count > lim.per_client_count:
            why = (f"this client's retained message limit of {lim.per_client_count} "
                   "reached (--max-retained-per-client)")
        elif lim.per_client_bytes and mine_bytes > lim.per_client_bytes:
            why = (f"this client's retained bytes limit of {lim.per_client_bytes} "
                   "reached (--max-retained-bytes-per-client)")
        if why is not None:
            self.refused += 1
            return why
        self.set(topic, client_id, size)
        return None

    def set(self, topic: str, client_id: str, size: int) -> None:
        """`topic` now retains `size` bytes set by `client_id` (whatever the budget)."""
        self.remove(topic)
        if is_broker_statistic(topic, client_id):
            return  # a fixed set; a client's $ topic (a bridge's state) counts as any other
        self.topics[topic] = (client_id, size)
        self.count += 1
        self.bytes += size
        mine = self.per_client.setdefault(client_id, [0, 0])
        mine[0] += 1
        mine[1] += size

    def remove(self, topic: str) -> None:
        old = self.topics.pop(topic, None)
        if old is None:
            return
        client_id, size = old
        self.count -= 1
        self.bytes -= size
        mine = self.per_client[client_id]
        mine[0] -= 1
        mine[1] -= size
        if not mine[0]:
            del self.per_client[client_id]
