"""Topic-filter trie: which filters (and their values) match a topic name.

Matching walks the topic's levels once, following at most the literal child and the `+`
child at each node and collecting `#` values on the way. It is iterative (no recursion
limit for 1000-level topics) and uses no regular expressions, so its cost is bounded by
levels x branches actually present, never exponential.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

V = TypeVar("V")


class _Node(Generic[V]):
    __slots__ = ("children", "plus", "hash_values", "values")

    def __init__(self) -> None:
        self.children: dict[str, _Node[V]] = {}
        self.plus: _Node[V] | None = None
        self.hash_values: dict[V, None] = {}  # values of filters ending in '#' here
        self.values: dict[V, None] = {}  # values of filters ending exactly here

    def empty(self) -> bool:
        return not (self.children or self.plus or self.hash_values or self.values)


class TopicTrie(Generic[V]):
    """Maps topic filters to sets of values."""

    def __init__(self) -> None:
        self._root: _Node[V] = _Node()
        self._filters: dict[str, dict[V, None]] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def filters(self) -> Iterator[str]:
        return iter(list(self._filters))

    def has(self, topic_filter: str, value: V) -> bool:
        return value in self._filters.get(topic_filter, {})

    def add(self, topic_filter: str, value: V) -> bool:
        """Add (filter, value); True if it was not there yet."""
        if self.has(topic_filter, value):
            return False
        node = self._root
        levels = topic_filter.split("/")
        for i, level in enumerate(levels):
            if level == "#" and i == len(levels) - 1:
                node.hash_values[value] = None
                break
            if level == "+":
                if node.plus is None:
                    node.plus = _Node()
                node = node.plus
            else:
                child = node.children.get(level)
                if child is None:
                    child = node.children[level] = _Node()
                node = child
        else:
            node.values[value] = None
        self._filters.setdefault(topic_filter, {})[value] = None
        self._len += 1
        return True

    def remove(self, topic_filter: str, value: V) -> bool:
        """Remove (filter, value), pruning nodes left empty; True if it was there."""
        if not self.has(topic_filter, value):
            return False
        path: list[tuple[_Node[V], str]] = []
        node = self._root
        levels = topic_filter.split("/")
        for i, level in enumerate(levels):
            if level == "#" and i == len(levels) - 1:
                del node.hash_values[value]
                break
            path.append((node, level))
            node = node.plus if level == "+" else node.children[level]  # type: ignore[assignment]
        else:
            del node.values[value]
        for parent, level in reversed(path):  # prune empty nodes bottom-up
            child = parent.plus if level == "+" else parent.children[level]
            if child is None or not child.empty():
                break
            if level == "+":
                parent.plus = None
            else:
                del parent.children[level]
        values = self._filters[topic_filter]
        del values[value]
        if not values:
            del self._filters[topic_filter]
        self._len -= 1
        return True

    def _walk(self, topic: str) -> Iterator[tuple[dict[V, None], tuple[str, ...]]]:
        """(values, filter levels) of every filter that matches `topic`."""
        levels = topic.split("/")
        dollar = topic.startswith("$")
        frontier: list[tuple[_Node[V], tuple[str, ...]]] = [(self._root, ())]
        for depth, level in enumerate(levels):
            # '#' and '+' at the first level never match a $-topic (MQTT 4.7.2).
            wild_ok = not (dollar and depth == 0)
            nxt: list[tuple[_Node[V], tuple[str, ...]]] = []
            for node, path in frontier:
                if node.hash_values and wild_ok:
                    yield node.hash_values, (*path, "#")
                child = node.children.get(level)
                if child is not None:
                    nxt.append((child, (*path, level)))
                if node.plus is not None and wild_ok:
                    nxt.append((node.plus, (*path, "+")))
            if not nxt:
                return
            frontier = nxt
        for node, path in frontier:
            if node.values:
                yield node.values, path
            if node.hash_values:  # 'a/#' also matches 'a'
                yield node.hash_values, (*path, "#")

    def match(self, topic: str) -> set[V]:
        """Values of every filter matching `topic`."""
        out: set[V] = set()
        for values, _ in self._walk(topic):
            out.update(values)
        return out

    def match_filters(self, topic: str) -> set[str]:
        """The distinct filters that match `topic`."""
        return {"/".join(path) for _, path in self._walk(topic)}
