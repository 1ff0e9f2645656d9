"""Which light queues one message belongs to: the store indexes each message into every
one of them as it appends it, and readers of any of them find it there.

Queue names:
- exact topic queue: the MQTT topic itself, `home/bath/temp`;
- wildcard queue: the registered filter itself, `home/+/temp` (a topic name can never
  contain `+` or `#`, so the two kinds cannot collide);
- first-level partition queue: `home#2`, partition 2 of first-level topic `home` (`#`
  inside a level is invalid in both topic names and filters, so this cannot collide).
"""

from __future__ import annotations

import zlib

from lightqueue.topic import first_level, validate_topic_filter
from lightqueue.trie import TopicTrie

DEFAULT_PARTITIONS = 4
ROUTE_CACHE = 20_000  # topics whose routes are remembered (a few MB at most)
PARTITION_SEP = "#"


def partition_queue(topic: str, partition: int) -> str:
    return f"{topic}{PARTITION_SEP}{partition}"


def split_partition_queue(queue: str) -> tuple[str, int] | None:
    """('home', 2) for 'home#2'; None for exact-topic and wildcard queues."""
    head, sep, tail = queue.rpartition(PARTITION_SEP)
    if not sep or not tail.isdigit() or "/" in head or not head:
        return None
    return head, int(tail)


def validate_first_level(topic: str) -> str:
    if not topic or any(c in topic for c in "/+#\x00"):
        raise ValueError(f"first-level topic {topic!r} must be non-empty without / + # or NUL")
    return topic


def stable_hash(text: str) -> int:
    # Stable across processes and restarts (Python's hash() is salted per process),
    # so a topic always lands in the same partition.
    return zlib.crc32(text.encode())


class Router:
    """Maps an MQTT topic to its queues. Not thread-safe: used from one event loop."""

    def __init__(self, default_partitions: int = DEFAULT_PARTITIONS) -> None:
        self.default_partitions = default_partitions
        self._wildcards: TopicTrie[str] = TopicTrie()
        self._partitions: dict[str, int] = {}
        # Devices publish on the same topics again and again: remember their routes
        # until a wildcard or a partition count changes.
        self._routes: dict[str, tuple[str, ...]] = {}

    # wildcard queues ------------------------------------------------------------------
    def register_wildcard(self, topic_filter: str) -> bool:
        validate_topic_filter(topic_filter)
        added = self._wildcards.add(topic_filter, topic_filter)
        if added:
            self._routes.clear()
        return added

    def unregister_wildcard(self, topic_filter: str) -> bool:
        removed = self._wildcards.remove(topic_filter, topic_filter)
        if removed:
            self._routes.clear()
        return removed

    def wildcards(self) -> list[str]:
        return sorted(self._wildcards.filters())

    # first-level topics ---------------------------------------------------------------
    def set_partitions(self, topic: str, partitions: int) -> None:
        if partitions < 1:
            raise ValueError("a topic has at least one partition")
        self._partitions[validate_first_level(topic)] = partitions
        self._routes.clear()

    def partitions(self, topic: str) -> int:
        return self._partitions.get(topic, self.default_partitions)

    def partition_for(self, topic: str, key: str) -> str:
        return partition_queue(topic, stable_hash(key) % self.partitions(topic))

    # routing --------------------------------------------------------------------------
    def route(self, mqtt_topic: str) -> list[str]:
        """Exact queue, matching registered wildcard queues, one first-level partition."""
        cached = self._routes.get(mqtt_topic)
        if cached is None:
            queues = [mqtt_topic]
            queues.extend(sorted(self._wildcards.match_filters(mqtt_topic)))
            queues.append(self.partition_for(first_level(mqtt_topic), mqtt_topic))
            if len(self._routes) >= ROUTE_CACHE:
                self._routes.clear()  # many distinct topics: start over, stay bounded
            cached = self._routes[mqtt_topic] = tuple(queues)
        return list(cached)
