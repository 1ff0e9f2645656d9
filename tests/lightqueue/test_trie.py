from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightqueue.topic import TopicError, matches
from lightqueue.trie import TopicTrie

TABLE = [
    # '#': everything, including the parent level; never a leading wildcard for $-topics
    ("#", "a", True),
    ("#", "a/b/c", True),
    ("#", "/", True),
    ("#", "$SYS/x", False),
    ("#", "$SYS", False),
    ("a/#", "a", True),
    ("a/#", "a/", True),
    ("a/#", "a/b/c", True),
    ("a/#", "ab", False),
    ("a/#", "b/a", False),
    ("a/b/#", "a", False),
    ("+/#", "a", True),
    ("+/#", "$x/a", False),
    # '+': exactly one level, which may be empty
    ("+", "a", True),
    ("+", "", True),
    ("+", "/a", False),
    ("+", "a/b", False),
    ("+/+", "/a", True),
    ("+/+", "a/", True),
    ("+/+", "/", True),
    ("/+", "/a", True),
    ("a/+", "a", False),
    ("a/+", "a/", True),
    ("a/+", "a/b/c", False),
    ("sport/tennis/+", "sport/tennis/player1", True),
    ("sport/tennis/+", "sport/tennis/player1/ranking", False),
    ("sport/+", "sport", False),
    ("sport/+", "sport/", True),
    # $-topics: only filters whose first level is literal
    ("$SYS/#", "$SYS/x", True),
    ("$SYS/#", "$SYS", True),
    ("$SYS/+", "$SYS/x", True),
    ("$SYS/monitor/+", "$SYS/monitor/Clients", True),
    ("+/monitor/Clients", "$SYS/monitor/Clients", False),
    ("+/monitor/Clients", "SYS/monitor/Clients", True),
    ("a/$x", "a/$x", True),
    ("a/+", "a/$x", True),
    ("a/#", "a/$x", True),
    # empty levels are real levels
    ("a//b", "a//b", True),
    ("a//b", "a/b", False),
    ("a/+/b", "a//b", True),
    ("a/b", "a/b/c", False),
    ("a/b", "a/b/", False),
    ("a/b/", "a/b/", True),
    ("/", "/", True),
    ("//#", "//", True),
]


@pytest.mark.parametrize("topic_filter, topic, expected", TABLE)
def test_table(topic_filter: str, topic: str, expected: bool) -> None:
    assert matches(topic_filter, topic) is expected  # the table agrees with the reference
    trie: TopicTrie[str] = TopicTrie()
    trie.add(topic_filter, "v")
    assert trie.match(topic) == ({"v"} if expected else set())
    assert trie.match_filters(topic) == ({topic_filter} if expected else set())


def test_all_filters_of_the_table_at_once() -> None:
    trie: TopicTrie[int] = TopicTrie()
    for i, (topic_filter, _, _) in enumerate(TABLE):
        trie.add(topic_filter, i)
    for topic in {topic for _, topic, _ in TABLE}:
        want = {i for i, (f, _, _) in enumerate(TABLE) if matches(f, topic)}
        assert trie.match(topic) == want, topic
        assert trie.match_filters(topic) == {TABLE[i][0] for i in want}


def test_add_remove_has_len_and_pruning() -> None:
    trie: TopicTrie[int] = TopicTrie()
    assert trie.add("a/+/c", 1) and not trie.add("a/+/c", 1)
    assert trie.add("a/+/c", 2) and trie.add("a/#", 1) and trie.add("#", 3)
    assert len(trie) == 4
    assert trie.has("a/+/c", 2) and ("a/#", 1) in trie
    assert not trie.has("a/+/c", 3) and ("a/b", 1) not in trie and "a/#" not in trie
    assert sorted(trie.filters()) == ["#", "a/#", "a/+/c"]
    assert trie.values("a/+/c") == {1, 2} and trie.values("zz") == set()
    assert trie.match("a/b/c") == {1, 2, 3}
    assert trie.match_filters("a/b/c") == {"a/+/c", "a/#", "#"}
    assert trie.remove("a/+/c", 1) and not trie.remove("a/+/c", 1)
    assert not trie.remove("never/added", 1)
    assert trie.match("a/b/c") == {1, 2, 3}  # 1 still via a/#
    assert trie.remove("a/+/c", 2)
    assert trie.match_filters("a/b/c") == {"a/#", "#"}
    assert trie.remove("a/#", 1) and trie.remove("#", 3)
    assert len(trie) == 0 and list(trie.filters()) == []
    assert trie._root.empty(), "empty nodes must be pruned"


def test_remove_keeps_nodes_still_in_use() -> None:
    trie: TopicTrie[str] = TopicTrie()
    trie.add("a/b/c", "x")
    trie.add("a/b", "y")
    trie.add("a/b/#", "z")
    assert trie.remove("a/b/c", "x")
    assert trie.match("a/b") == {"y", "z"}
    assert trie.remove("a/b", "y")
    assert trie.match("a/b/q") == {"z"}
    assert trie.remove("a/b/#", "z")
    assert trie._root.empty()


@pytest.mark.parametrize("bad", ["", "a/#/b", "a#", "a/b+", "+a", "a\x00b"])
def test_invalid_filters_are_rejected(bad: str) -> None:
    trie: TopicTrie[int] = TopicTrie()
    with pytest.raises(TopicError):
        trie.add(bad, 1)
    assert len(trie) == 0


def test_deep_topics_and_filters_need_no_recursion() -> None:
    trie: TopicTrie[int] = TopicTrie()
    deep = "/".join(["x"] * 5000)
    trie.add(deep, 1)
    trie.add(deep + "/#", 2)
    trie.add("/".join(["+"] * 5000), 3)
    assert trie.match(deep) == {1, 2, 3}
    assert trie.remove(deep, 1) and trie.remove(deep + "/#", 2)
    assert trie.remove("/".join(["+"] * 5000), 3) and trie._root.empty()


# -- property test against the reference matcher ------------------------------------------

LEVELS = st.sampled_from(["a", "b", "", "$x", "+", "#"])
TOPIC_LEVELS = st.sampled_from(["a", "b", "", "$x"])


@st.composite
def filters(draw: st.DrawFn) -> str:
    levels = draw(st.lists(LEVELS, min_size=1, max_size=5))
    # '#' only as a whole last level, as validation requires
    levels = [lv for lv in levels[:-1] if lv != "#"] + [levels[-1]]
    topic_filter = "/".join(levels)
    return topic_filter or "a"  # a filter is at least one character long


topics = st.lists(TOPIC_LEVELS, min_size=1, max_size=6).map("/".join).filter(bool)


@settings(max_examples=300, deadline=None)
@given(st.lists(filters(), min_size=1, max_size=10), st.lists(topics, min_size=1, max_size=5),
       st.data())
def test_trie_agrees_with_the_reference_matcher(
    fs: list[str], ts: list[str], data: st.DataObject
) -> None:
    trie: TopicTrie[int] = TopicTrie()
    pairs = {(f, i % 3) for i, f in enumerate(fs)}
    for f, v in pairs:
        trie.add(f, v)
    # remove a random part, so that pruning is checked against the reference too
    removed = data.draw(st.sets(st.sampled_from(sorted(pairs))))
    for f, v in removed:
        assert trie.remove(f, v)
    live = pairs - removed
    assert len(trie) == len(live)
    for topic in ts:
        assert trie.match(topic) == {v for f, v in live if matches(f, topic)}
        assert trie.match_filters(topic) == {f for f, _ in live if matches(f, topic)}


# -- cost ---------------------------------------------------------------------------------

def _pathological_filters() -> list[str]:
    """2,000+ filters of mixed '+', '#' and literal shapes that all match long runs of 'a':
    a backtracking matcher tries every combination; the trie visits each node once."""
    out = []
    for depth in range(1, 201):
        for shape in range(10):
            levels = ["+" if (shape >> (i % 4)) & 1 else "a" for i in range(depth)]
            tail = ("#", "+", "a", "b")[shape % 4]
            out.append("/".join([*levels, tail]))
    return out


def test_pathological_filters_match_in_linear_time() -> None:
    fs = _pathological_filters()
    assert len(fs) >= 2000
    trie: TopicTrie[int] = TopicTrie()
    for i, f in enumerate(fs):
        trie.add(f, i)
    topic = "/".join(["a"] * 200)
    want = {i for i, f in enumerate(fs) if matches(f, topic)}
    assert want  # the set is not trivially empty
    long_topic = "/".join(["a"] * 1000)
    t0 = time.perf_counter()
    assert trie.match(topic) == want
    assert trie.match_filters(topic) == {fs[i] for i in want}
    trie.match(long_topic)
    elapsed = time.perf_counter() - t0
    assert elapsed < 1.0, f"matching took {elapsed:.2f}s: not linear"


def test_many_plus_chains_of_one_shape_stay_cheap() -> None:
    # '+/+/.../#' at every depth: each topic level adds one node to the frontier at most
    trie: TopicTrie[int] = TopicTrie()
    for depth in range(1000):
        trie.add("/".join(["+"] * depth + ["#"]), depth)
    topic = "/".join(["x"] * 1000)
    t0 = time.perf_counter()
    for _ in range(10):
        assert len(trie.match(topic)) == 1000
    assert time.perf_counter() - t0 < 1.0
