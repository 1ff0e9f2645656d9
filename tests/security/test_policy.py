"""Policy matching and priority (ACL 2.0 rules, documented in store/auth/policy.py)."""

from __future__ import annotations

import pytest

from store.auth.policy import Policy, covers, decide, parse_actions, parse_resource


def pol(resource: str, actions: str = "PUB,SUB", **kw) -> Policy:
    return Policy.create(kw.pop("user", "alice"), resource, actions, **kw)


def allowed(policies: list[Policy], name: str, action: str = "PUB", *, ip: str = "10.0.0.5",
            user: str = "alice", is_filter: bool = False, rtype: str = "Topic") -> bool:
    return decide(policies, user, rtype, name, action, ip, is_filter)[0]


def test_default_deny() -> None:
    assert not allowed([], "home/x")


def test_literal_matches_only_the_name() -> None:
    ps = [pol("Topic:home/x")]
    assert allowed(ps, "home/x")
    assert not allowed(ps, "home/xy")
    assert not allowed(ps, "home")


def test_prefixed_matches_names_and_filters_with_the_prefix() -> None:
    ps = [pol("Topic:home/", match="prefixed")]
    assert allowed(ps, "home/bath/temp")
    assert not allowed(ps, "garden/x")
    assert allowed(ps, "home/#", "SUB", is_filter=True)
    assert not allowed(ps, "#", "SUB", is_filter=True)


def test_any_matches_every_resource_of_its_type() -> None:
    ps = [pol("Topic:*", match="any")]
    assert allowed(ps, "anything/at/all")
    assert not allowed(ps, "g1", rtype="Group")


def test_mqtt_wildcard_pattern_matches_topics_and_covered_filters() -> None:
    ps = [pol("Topic:devices/+/telemetry")]
    assert allowed(ps, "devices/7/telemetry")
    assert not allowed(ps, "devices/7/cmd")
    assert allowed(ps, "devices/+/telemetry", "SUB", is_filter=True)
    assert not allowed(ps, "devices/#", "SUB", is_filter=True)  # wider than the grant


def test_actions_are_separate() -> None:
    ps = [pol("Topic:home/x", "SUB")]
    assert allowed(ps, "home/x", "SUB")
    assert not allowed(ps, "home/x", "PUB")


def test_more_specific_resource_wins() -> None:
    ps = [pol("Topic:*", match="any"), pol("Topic:secret/x", deny=True)]
    assert not allowed(ps, "secret/x")
    assert allowed(ps, "public/x")
    # ... in both directions: a literal allow inside a denied prefix
    ps = [pol("Topic:secret/", match="prefixed", deny=True), pol("Topic:secret/ok")]
    assert allowed(ps, "secret/ok")
    assert not allowed(ps, "secret/other")


def test_longer_prefix_is_more_specific() -> None:
    ps = [pol("Topic:a/", match="prefixed", deny=True), pol("Topic:a/b/", match="prefixed")]
    assert allowed(ps, "a/b/c")
    assert not allowed(ps, "a/c")


def test_deny_wins_a_tie() -> None:
    ps = [pol("Topic:home/x"), pol("Topic:home/x", deny=True)]
    assert not allowed(ps, "home/x")
    ps = [pol("Topic:home/", match="prefixed"), pol("Topic:home/#", deny=True)]
    assert not allowed(ps, "home/y")  # same rank, same literal length: deny


def test_source_ip_restricts_a_policy() -> None:
    ps = [pol("Topic:home/x", ip="10.0.0.0/24")]
    assert allowed(ps, "home/x", ip="10.0.0.9")
    assert not allowed(ps, "home/x", ip="192.168.1.1")
    assert not allowed(ps, "home/x", ip="not-an-ip")


def test_everyone_and_other_users() -> None:
    ps = [pol("Topic:x", user="*"), pol("Topic:y", user="bob")]
    assert allowed(ps, "x", user="carol")
    assert not allowed(ps, "y", user="carol")
    assert allowed(ps, "y", user="bob")


def test_group_and_cluster_resources() -> None:
    ps = [pol("Group:billing", "SUB"), pol("Cluster", "GET")]
    assert allowed(ps, "billing", "SUB", rtype="Group")
    assert not allowed(ps, "billing2", "SUB", rtype="Group")
    assert allowed(ps, "", "GET", rtype="Cluster")
    assert not allowed(ps, "", "UPDATE", rtype="Cluster")


@pytest.mark.parametrize(("pattern", "flt", "expected"), [
    ("#", "a/b", True), ("#", "#", True), ("a/#", "a", True), ("a/#", "a/+/c", True),
    ("a/+", "a/#", False), ("a/+", "a/+", True), ("a/+", "a/b/c", False), ("+", "#", False),
    ("a/b", "a/b", True), ("a/+/c", "a/+/+", False), ("#", "$SYS/#", False),
])
def test_covers(pattern: str, flt: str, expected: bool) -> None:
    assert covers(pattern, flt) is expected


def test_parse_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="resource type"):
        parse_resource("Queue:x")
    with pytest.raises(ValueError, match="needs a name"):
        parse_resource("Topic")
    with pytest.raises(ValueError, match="unknown action"):
        parse_actions("PUB,FLY")
    assert parse_actions("all") == ("PUB", "SUB", "CREATE", "UPDATE", "DELETE", "LIST", "GET")
    assert Policy.from_dict(pol("Topic:a/#", ip="10.1.2.3/8").to_dict()) == pol(
        "Topic:a/#", ip="10.0.0.0/8")
