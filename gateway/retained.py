"""Retained messages: their records in the store, those on their way there, and the
budgets over them (how many, and how many bytes, in total and per client).

A retained message outlives its publisher, so a client publishing retained messages to
ever new topics fills the store for good. The budget keeps, per topic, who set it and
its size as stored (topic, properties and payload: a 1-byte payload may carry hundreds
of kB of MQTT 5 user properties), not the message itself, loaded from the store when the
gateway starts and kept current by this gateway's own writes. In separated mode other
gateways' writes are seen on the next start: each gateway enforces the budget over what
it knows, so a cluster may hold up to the budget per gateway.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from gateway.reserved import is_broker_statistic
from lightqueue.topic import is_wildcard, matches
from store.api import Message, Store, StoreError, encode_properties

log = logging.getLogger("lightgate.gateway")


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


@dataclass
class RetainedMessage:
    topic: str
    body: bytes
    qos: int
    properties: dict[str, Any]
    client_id: str
    ts: int
    phys_offset: int = -1  # where it is in the CommitLog (while retention keeps it)

    def to_meta(self) -> dict[str, Any]:
        return {"body": self.body, "qos": self.qos, "props": self.properties,
                "client_id": self.client_id, "ts": self.ts, "phys": self.phys_offset}

    @classmethod
    def from_meta(cls, topic: str, d: dict[str, Any]) -> RetainedMessage:
        return cls(topic, d["body"], d["qos"], d.get("props") or {}, d.get("client_id", ""),
                   d.get("ts", 0), d.get("phys", -1))

    @classmethod
    def of(cls, msg: Message) -> RetainedMessage:
        return cls(msg.topic, msg.body, msg.qos, msg.properties, msg.client_id,
                   msg.store_ts, msg.phys_offset)

    def to_message(self) -> Message:
        return Message(self.topic, self.body, self.qos, True, self.client_id, self.properties,
                       store_ts=self.ts, phys_offset=self.phys_offset)


class Retained:
    """The retained messages as subscribers find them: the store's `retained` records,
    plus those stored whose record is still to be written (`retaining`), plus the
    broker's own statistics, which live here only (`statistic`)."""

    def __init__(self, store: Store, limits: RetainedLimits) -> None:
        self.store = store
        self.budget = RetainedBudget(limits)
        self._retaining: dict[str, Message] = {}  # stored, their retained record to come
        # $SYS/broker/...: the current value of each, never stored (housekeeping)
        self.statistics: dict[str, RetainedMessage] = {}

    def statistic(self, msg: Message) -> None:
        """The broker's statistic `msg` is its topic's current value: what a new
        subscription finds, from memory (a fixed set of topics, said every round)."""
        self.statistics[msg.topic] = RetainedMessage.of(msg)

    async def publish(self, msg: Message) -> Message:
        """Store one message the gateway makes (a will) and keep it retained if flagged."""
        [stored] = await self.store.publish([msg])
        if msg.retain:
            await self.set(stored)
        return stored

    def retaining(self, msg: Message) -> None:
        """A retained publish is stored; its retained record follows (`set`). Meanwhile a
        new subscription finds it here: it came too late for the live delivery and too
        early for the record."""
        self._retaining[msg.topic] = msg

    async def set(self, msg: Message) -> None:
        try:
            await self._set(msg)
        finally:
            if self._retaining.get(msg.topic) is msg:
                del self._retaining[msg.topic]

    async def _set(self, msg: Message) -> None:
        if msg.body:
            await self.store.meta_put("retained", msg.topic, RetainedMessage.of(msg).to_meta())
            self.budget.set(msg.topic, msg.client_id,
                            stored_size(msg.topic, msg.body, msg.properties))
        else:  # an empty retained payload clears the topic's retained message
            await self.delete(msg.topic)

    async def delete(self, topic: str) -> None:
        await self.store.meta_delete("retained", topic)
        self.budget.remove(topic)

    async def load_budget(self) -> None:
        """The retained messages the store already holds count from the start. The
        broker's statistics an older version kept there are dropped: they live here."""
        try:
            for topic, d in await self.store.meta_items("retained"):
                if is_broker_statistic(topic, d.get("client_id", "")):
                    await self.store.meta_delete("retained", topic)
                    continue
                size = stored_size(topic, d["body"], d.get("props") or {})
                self.budget.set(topic, d.get("client_id", ""), size)
        except StoreError as exc:  # separated mode, store away
            log.warning("retained messages not counted: %s", exc)

    async def matching(self, topic_filter: str) -> list[RetainedMessage]:
        found = await self._stored(topic_filter)
        if topic_filter.startswith("$"):
            found += [r for topic, r in self.statistics.items()
                      if matches(topic_filter, topic)]
        if not self._retaining:
            return found
        by_topic = {r.topic: r for r in found}
        for topic, msg in list(self._retaining.items()):
            if matches(topic_filter, topic):  # newer than what the store holds
                if msg.body:
                    by_topic[topic] = RetainedMessage.of(msg)
                else:
                    by_topic.pop(topic, None)
        return list(by_topic.values())

    async def _stored(self, topic_filter: str) -> list[RetainedMessage]:
        if not is_wildcard(topic_filter):
            d = await self.store.meta_get("retained", topic_filter)
            return [RetainedMessage.from_meta(topic_filter, d)] if d else []
        # Scan only the literal prefix before the first wildcard level.
        literal = []
        for level in topic_filter.split("/"):
            if level in ("+", "#"):
                break
            literal.append(level)
        prefix = "/".join(literal)  # 'a/#' matches 'a' itself: no trailing slash
        return [RetainedMessage.from_meta(topic, d)
                for topic, d in await self.store.meta_items("retained", prefix)
                if matches(topic_filter, topic)]
