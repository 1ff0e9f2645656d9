from __future__ import annotations

import pytest

from lightqueue.routing import Router, partition_queue, split_partition_queue
from lightqueue.topic import TopicError


def test_route_exact_wildcards_and_partition() -> None:
    r = Router(default_partitions=4)
    for f in ("home/+/temp", "home/#", "#", "+/bath/+", "garden/#"):
        r.register_wildcard(f)
    queues = r.route("home/bath/temp")
    assert queues[0] == "home/bath/temp"
    assert sorted(queues[1:-1]) == sorted(["home/+/temp", "home/#", "#", "+/bath/+"])
    assert split_partition_queue(queues[-1])[0] == "home"


def test_partition_is_stable_and_spreads() -> None:
    r = Router(default_partitions=8)
    assert r.route("car/42/gps")[-1] == Router(default_partitions=8).route("car/42/gps")[-1]
    used = {r.route(f"car/{i}/gps")[-1] for i in range(200)}
    assert used == {partition_queue("car", p) for p in range(8)}
    r.set_partitions("car", 2)
    assert {r.route(f"car/{i}/gps")[-1] for i in range(50)} == {"car#0", "car#1"}


def test_dollar_topics_skip_leading_wildcards() -> None:
    r = Router()
    for f in ("#", "+/broker/uptime", "$SYS/#"):
        r.register_wildcard(f)
    queues = r.route("$SYS/broker/uptime")
    assert "#" not in queues and "+/broker/uptime" not in queues
    assert "$SYS/#" in queues


def test_queue_names_cannot_collide() -> None:
    assert split_partition_queue("home#3") == ("home", 3)
    for not_partition in ("home/bath", "home/#", "#", "a/b#1", "x#y"):
        assert split_partition_queue(not_partition) is None


def test_register_and_unregister() -> None:
    r = Router()
    assert r.register_wildcard("a/+")
    assert not r.register_wildcard("a/+")
    assert r.wildcards() == ["a/+"]
    assert r.unregister_wildcard("a/+")
    assert r.route("a/b") == ["a/b", r.partition_for("a", "a/b")]
    for bad in ("a/#/b", "a+", ""):
        with pytest.raises(TopicError):
            r.register_wildcard(bad)


def test_remembered_routes_follow_wildcard_and_partition_changes() -> None:
    r = Router(default_partitions=1)
    assert r.route("a/b") == ["a/b", "a#0"]
    r.register_wildcard("a/#")
    assert r.route("a/b") == ["a/b", "a/#", "a#0"]
    r.set_partitions("a", 1000)
    assert r.route("a/b")[-1] == r.partition_for("a", "a/b")
    r.unregister_wildcard("a/#")
    assert r.route("a/b")[:1] == ["a/b"] and "a/#" not in r.route("a/b")
    routed = r.route("a/b")
    routed.append("mutated")  # callers get their own list
    assert "mutated" not in r.route("a/b")
