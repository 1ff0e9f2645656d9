"""The native topic-filter trie against lightqueue.trie, the reference: the same matches
and the same filters for any sequence of adds and removes, and the same refusals."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightqueue.topic import TopicError
from lightqueue.trie import TopicTrie
from serving import plane

if plane.NATIVE is None:
    if os.environ.get("LIGHTGATE_NATIVE") == "1":
        pytest.fail("LIGHTGATE_NATIVE=1 but the native extension is not installed")
    pytest.skip("the native extension is not installed", allow_module_level=True)

LEVELS = ["a", "b", "", "$SYS", "é", "+", "#", "a+", "#b"]
level = st.sampled_from(LEVELS)
name_level = st.sampled_from([x for x in LEVELS if "+" not in x and "#" not in x])
filters = st.lists(level, min_size=1, max_size=4).map("/".join)
topics = st.lists(name_level, min_size=1, max_size=5).map("/".join)
ops = st.lists(st.tuples(st.booleans(), filters, st.integers(0, 5)), max_size=30)


@settings(max_examples=400, deadline=None)
@given(ops=ops, probes=st.lists(topics, min_size=1, max_size=10))
def test_same_matches_as_python(ops: list[tuple[bool, str, int]], probes: list[str]) -> None:
    native, python = plane.NATIVE.TopicTrie(), TopicTrie()
    for add, topic_filter, value in ops:
        if add:
            try:
                want = python.add(topic_filter, value)
            except TopicError:
                with pytest.raises(ValueError):
                    native.add(topic_filter, value)
                continue
            assert native.add(topic_filter, value) == want
        else:
            assert native.remove(topic_filter, value) == python.remove(topic_filter, value)
        assert len(native) == len(python)
    for topic in probes:
        assert sorted(native.matching(topic)) == sorted(python.match(topic)), topic
        assert set(native.matching_filters(topic)) == python.match_filters(topic), topic


route_ops = st.lists(st.one_of(
    st.tuples(st.just("wild"), filters), st.tuples(st.just("unwild"), filters),
    st.tuples(st.just("parts"), st.sampled_from(["a", "b", "é", "$SYS"]), st.integers(1, 9))),
    max_size=15)


@settings(max_examples=300, deadline=None)
@given(ops=route_ops, probes=st.lists(topics, min_size=1, max_size=10),
       default=st.integers(1, 8))
def test_same_routes_as_python(ops: list[tuple], probes: list[str], default: int) -> None:
    """A message is indexed into the same queues, in the same order, whichever plane
    appends it."""
    from lightqueue.routing import Router

    native, python = plane.NATIVE.Routes(default), Router(default)
    for op in ops:
        if op[0] == "wild":
            try:
                want = python.register_wildcard(op[1])
            except TopicError:
                with pytest.raises(ValueError):
                    native.register_wildcard(op[1])
                continue
            assert native.register_wildcard(op[1]) == want
        elif op[0] == "unwild":
            assert native.unregister_wildcard(op[1]) == python.unregister_wildcard(op[1])
        else:
            python.set_partitions(op[1], op[2])
            native.set_partitions(op[1], op[2])
    for topic in probes:
        assert native.route(topic) == python.route(topic), topic
