"""Topic-filter trie: which filters (and their values) match a topic name.

Used twice on the data path: the store's router finds the registered wildcard queues a
topic belongs to (`match_filters`), and each gateway session finds its subscriptions
that match a notified queue (`match`).

Matching walks the topic's levels once, breadth-first: at each level every node of the
frontier follows at most its literal child and its `+` child, and contributes its `#`
values. A trie node is reached by one path only, so it enters the frontier at most once:
the cost is bounded by the trie nodes actually visited (levels x branches taken), never
exponential, whatever the filter set. Everything is iterative (no recursion limit for
1000-level topics) and uses no regular expressions. The MQTT rules themselves are those
of `lightqueue.topic.matches`, which the tests use as the reference.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

from lightqueue.topic import validate_topic_filter

V = TypeVar("V")


class _Node(Generic[V]):
    __slots__ = ("children", "plus", "exact", "exact_filter", "hash", "hash_filter")

    def __init__(self) -> None:
        self.children: dict[str, _Node[V]] = {}
        self.plus: _Node[V] | None = None
        # Values of the filter ending exactly here, and of the filter ending in '#' here.
        # The filter strings are kept so that `match_filters` needs no path bookkeeping.
        self.exact: set[V] | None = None
        self.exact_filter = ""
        self.hash: set[V] | None = None
        self.hash_filter = ""

    def empty(self) -> bool:
        return not self.children and self.plus is None and not self.exact and not self.hash


class TopicTrie(Generic[V]):
    """Maps MQTT topic filters to sets of values. Not thread-safe."""

    def __init__(self) -> None:
        self._root: _Node[V] = _Node()
        # filter -> the value set stored in its trie node (the same object): O(1) `has`.
        self._filters: dict[str, set[V]] = {}
        self._len = 0

    def __len__(self) -> int:
        """Number of (filter, value) pairs."""
        return self._len

    def __contains__(self, item: object) -> bool:
        """`(topic_filter, value) in trie`."""
        if not isinstance(item, tuple) or len(item) != 2:
            return False
        return self.has(*item)

    def has(self, topic_filter: str, value: V) -> bool:
        values = self._filters.get(topic_filter)
        return values is not None and value in values

    def filters(self) -> Iterator[str]:
        """The filters that have at least one value (a snapshot: safe to mutate during)."""
        return iter(list(self._filters))

    def values(self, topic_filter: str) -> set[V]:
        """A copy of the values stored under exactly `topic_filter`."""
        return set(self._filters.get(topic_filter, ()))

    def add(self, topic_filter: str, value: V) -> bool:
        """Add (filter, value); True if it was not there yet. Raises TopicError for an
        invalid filter (so '#' below can only be a whole last level)."""
        values = self._filters.get(topic_filter)
        if values is not None and value in values:
            return False
        levels = validate_topic_filter(topic_filter).split("/")
        hash_last = levels[-1] == "#"
        if hash_last:
            levels.pop()
        node = self._root
        for level in levels:
            if level == "+":
                if node.plus is None:
                    node.plus = _Node()
                node = node.plus
            else:
                child = node.children.get(level)
                if child is None:
                    child = node.children[level] = _Node()
                node = child
        if values is None:
            values = set()
            if hash_last:
                node.hash, node.hash_filter = values, topic_filter
            else:
                node.exact, node.exact_filter = values, topic_filter
            self._filters[topic_filter] = values
        values.add(value)
        self._len += 1
        return True

    def remove(self, topic_filter: str, value: V) -> bool:
        """Remove (filter, value), pruning nodes left empty; True if it was there."""
        values = self._filters.get(topic_filter)
        if values is None or value not in values:
            return False
        values.discard(value)
        self._len -= 1
        if values:
            return True
        del self._filters[topic_filter]
        levels = topic_filter.split("/")
        hash_last = levels[-1] == "#"
        if hash_last:
            levels.pop()
        path: list[_Node[V]] = [self._root]
        for level in levels:  # the filter is present, so every node on its path exists
            node = path[-1]
            nxt = node.plus if level == "+" else node.children[level]
            assert nxt is not None
            path.append(nxt)
        end = path[-1]
        if hash_last:
            end.hash, end.hash_filter = None, ""
        else:
            end.exact, end.exact_filter = None, ""
        for depth in range(len(levels), 0, -1):  # prune bottom-up, never the root
            child, parent, level = path[depth], path[depth - 1], levels[depth - 1]
            if not child.empty():
                break
            if level == "+":
                parent.plus = None
            else:
                del parent.children[level]
        return True

    def _walk(self, topic: str) -> Iterator[tuple[str, set[V]]]:
        """(filter, values) of every filter that matches the topic name `topic`."""
        levels = topic.split("/")
        # '+' and '#' as the FIRST level never match a $-topic (MQTT 4.7.2); deeper
        # wildcards do ('$SYS/#' matches '$SYS/x').
        wild = not topic.startswith("$")
        frontier: list[_Node[V]] = [self._root]
        for level in levels:
            nxt: list[_Node[V]] = []
            for node in frontier:
                if wild:
                    if node.hash:
                        yield node.hash_filter, node.hash
                    if node.plus is not None:
                        nxt.append(node.plus)
                child = node.children.get(level)
                if child is not None:
                    nxt.append(child)
            if not nxt:
                return
            frontier = nxt
            wild = True
        for node in frontier:
            if node.exact:
                yield node.exact_filter, node.exact
            if node.hash:  # 'a/#' also matches 'a' (the parent level)
                yield node.hash_filter, node.hash

    def match(self, topic: str) -> set[V]:
        """Values of every filter matching the topic name `topic`."""
        out: set[V] = set()
        for _, values in self._walk(topic):
            out |= values
        return out

    def match_filters(self, topic: str) -> set[str]:
        """The distinct filters (with at least one value) that match `topic`."""
        return {topic_filter for topic_filter, _ in self._walk(topic)}
