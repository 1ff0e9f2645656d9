from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightqueue.topic import matches
from lightqueue.trie import TopicTrie

TABLE = [
    ("#", "a/b/c", True),
    ("#", "$SYS/x", False),
    ("$SYS/#", "$SYS/x", True),
    ("$SYS/#", "$SYS", True),
    ("+/monitor/Clients", "$SYS/monitor/Clients", False),
    ("$SYS/monitor/+", "$SYS/monitor/Clients", True),
    ("a/#", "a", True),
    ("a/#", "a/b/c", True),
    ("a/#", "ab", False),
    ("a/+", "a", False),
    ("a/+", "a/", True),
    ("+/+", "/a", True),
    ("+", "/a", False),
    ("/+", "/a", True),
    ("a//b", "a//b", True),
    ("a/+/b", "a//b", True),
    ("a/b", "a/b/c", False),
    ("+/#", "a", True),
    ("sport/tennis/+", "sport/tennis/player1", True),
    ("sport/tennis/+", "sport/tennis/player1/ranking", False),
    ("sport/+", "sport", False),
]


@pytest.mark.parametrize("topic_filter, topic, expected", TABLE)
def test_table(topic_filter: str, topic: str, expected: bool) -> None:
    trie: TopicTrie[str] = TopicTrie()
    trie.add(topic_filter, "v")
    assert (trie.match(topic) == {"v"}) is expected
    assert (trie.match_filters(topic) == {topic_filter}) is expected
    assert matches(topic_filter, topic) is expected


def test_add_remove_prunes_and_counts() -> None:
    trie: TopicTrie[int] = TopicTrie()
    assert trie.add("a/+/c", 1) and not trie.add("a/+/c", 1)
    assert trie.add("a/+/c", 2) and trie.add("a/#", 1)
    assert len(trie) == 3 and trie.match("a/b/c") == {1, 2}
    assert trie.remove("a/+/c", 1) and not trie.remove("a/+/c", 1)
    assert trie.match("a/b/c") == {1, 2}  # 2 via a/+/c, 1 via a/#
    assert trie.remove("a/+/c", 2) and trie.remove("a/#", 1)
    assert len(trie) == 0 and trie._root.empty()


LEVELS = st.sampled_from(["a", "b", "", "$x", "+", "#"])


@st.composite
def filters(draw: st.DrawFn) -> str:
    levels = draw(st.lists(LEVELS, min_size=1, max_size=5))
    # '#' only as the last level, as validation guarantees
    levels = [lv for lv in levels[:-1] if lv != "#"] + [levels[-1]]
    return "/".join(levels)


TOPIC_LEVELS = st.sampled_from(["a", "b", "", "$x"])


@settings(max_examples=400, deadline=None)
@given(st.lists(filters(), min_size=1, max_size=8),
       st.lists(TOPIC_LEVELS, min_size=1, max_size=6))
def test_trie_agrees_with_the_reference_matcher(fs: list[str], levels: list[str]) -> None:
    topic = "/".join(levels)
    trie: TopicTrie[str] = TopicTrie()
    for f in fs:
        trie.add(f, f)
    assert trie.match(topic) == {f for f in fs if matches(f, topic)}


def test_pathological_filters_match_in_linear_time() -> None:
    trie: TopicTrie[int] = TopicTrie()
    n = 0
    for depth in range(1, 41):
        for tail in ("#", "+", "x"):
            for i in range(17):
                levels = ["+"] * depth
                levels[i % depth] = f"l{i}"
                trie.add("/".join([*levels, tail]), n)
                n += 1
    topic = "/".join(["l1"] * 200)
    long_topic = "/".join(["+x"] * 1000).replace("+", "p")
    t0 = time.perf_counter()
    for _ in range(20):
        trie.match(topic)
        trie.match(long_topic)
    assert time.perf_counter() - t0 < 1.0, "matching is not linear"
