"""Authorisation policies (ACL 2.0): subject x resource x actions x source IP x decision.

Priority when several policies match a request (documented in docs/security.md, "Policies"):
1. the most specific resource wins: LITERAL name (3) > PREFIXED or an MQTT-wildcard
   pattern (2, the longer literal part first) > ANY (1);
2. on a tie, Deny wins over Allow.
No matching policy means deny for a Normal user; a Super user is always allowed.

Topic resources may hold MQTT wildcards (`home/+/temp`, `devices/#`). A SUB request on
a topic filter matches a policy only if every topic the filter can match is covered
by the policy's pattern, so `devices/#` is not allowed by a grant on `devices/1/#`.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

from lightqueue.topic import is_wildcard, matches

ACTIONS = ("PUB", "SUB", "CREATE", "UPDATE", "DELETE", "LIST", "GET")
RESOURCE_TYPES = ("Topic", "Group", "Cluster")
MATCHES = ("literal", "prefixed", "any")
EVERYONE = "*"  # a policy subject meaning every user, anonymous included


def parse_resource(text: str) -> tuple[str, str]:
    """'Topic:home/#' -> ('Topic', 'home/#'); 'Cluster' -> ('Cluster', '')."""
    rtype, _, name = text.partition(":")
    canonical = {t.lower(): t for t in RESOURCE_TYPES}.get(rtype.lower())
    if canonical is None:
        raise ValueError(f"resource type must be one of {', '.join(RESOURCE_TYPES)}: {text!r}")
    if canonical != "Cluster" and not name:
        raise ValueError(f"{canonical} resource needs a name, e.g. {canonical}:NAME")
    return canonical, name


def parse_actions(text: str | list[str]) -> tuple[str, ...]:
    items = text.split(",") if isinstance(text, str) else text
    out = tuple(dict.fromkeys(a.strip().upper() for a in items if a.strip()))
    if not out:
        raise ValueError("at least one action is needed")
    bad = [a for a in out if a not in ACTIONS and a != "ALL"]
    if bad:
        raise ValueError(f"unknown action(s) {bad}: use {', '.join(ACTIONS)} or ALL")
    return ACTIONS if "ALL" in out else out


@dataclass(frozen=True)
class Policy:
    user: str  # a user name, or "*" for everyone
    rtype: str  # Topic | Group | Cluster
    pattern: str  # name, prefix or MQTT filter; "" for Cluster and ANY
    match: str  # literal | prefixed | any
    actions: tuple[str, ...]
    ip: str = ""  # CIDR; "" = from anywhere
    deny: bool = False
    _net: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def create(cls, user: str, resource: str, actions: str | list[str], *,
               match: str = "literal", ip: str = "", deny: bool = False) -> Policy:
        rtype, pattern = parse_resource(resource)
        match = match.lower()
        if match not in MATCHES:
            raise ValueError(f"match must be one of {', '.join(MATCHES)}")
        if rtype == "Cluster" or match == "any":
            pattern = "" if match == "any" or rtype == "Cluster" else pattern
        net = ipaddress.ip_network(ip, strict=False) if ip else None
        return cls(user, rtype, pattern, match if rtype != "Cluster" else "any",
                   parse_actions(actions), str(net) if net else "", deny, net)

    @property
    def key(self) -> str:
        """Metadata key: one policy per subject, resource, match, source and decision."""
        return "\0".join((self.user, self.rtype, self.pattern, self.match, self.ip,
                          "deny" if self.deny else "allow"))

    def to_dict(self) -> dict[str, Any]:
        return {"user": self.user, "resource": self.resource, "match": self.match,
                "actions": list(self.actions), "ip": self.ip,
                "decision": "deny" if self.deny else "allow"}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Policy:
        return cls.create(d["user"], d["resource"], d["actions"], match=d.get("match", "literal"),
                          ip=d.get("ip", ""), deny=d.get("decision") == "deny")

    @property
    def resource(self) -> str:
        return self.rtype if self.rtype == "Cluster" else f"{self.rtype}:{self.pattern or '*'}"

    def specificity(self) -> tuple[int, int]:
        if self.match == "any" or self.rtype == "Cluster":
            return (1, 0)
        if self.match == "prefixed" or is_wildcard(self.pattern):
            return (2, len(self.pattern.replace("+", "").replace("#", "")))
        return (3, len(self.pattern))

    def applies(self, user: str, rtype: str, name: str, action: str, ip: str,
                is_filter: bool) -> bool:
        if self.user not in (user, EVERYONE) or action not in self.actions:
            return False
        if self.rtype != rtype:
            return False
        if self._net is not None and not _in_net(ip, self._net):
            return False
        return self.matches_name(name, is_filter)

    def matches_name(self, name: str, is_filter: bool) -> bool:
        if self.match == "any" or self.rtype == "Cluster":
            return True
        if self.match == "prefixed":
            return name.startswith(self.pattern)
        if self.rtype == "Topic" and is_wildcard(self.pattern):
            return covers(self.pattern, name) if is_filter else matches(self.pattern, name)
        return name == self.pattern


def covers(pattern: str, topic_filter: str) -> bool:
    """Whether every topic matched by `topic_filter` is also matched by `pattern`."""
    if topic_filter.startswith("$") != pattern.startswith("$") and pattern[:1] in "+#":
        return False
    p_levels = pattern.split("/")
    f_levels = topic_filter.split("/")
    for i, f in enumerate(f_levels):
        if i >= len(p_levels):
            return False
        p = p_levels[i]
        if p == "#":
            return True
        if f == "#" or (f == "+" and p != "+"):
            return False
        if p != "+" and p != f:
            return False
    return len(p_levels) == len(f_levels) or (
        len(p_levels) == len(f_levels) + 1 and p_levels[-1] == "#")


def _in_net(ip: str, net: Any) -> bool:
    try:
        return ipaddress.ip_address(ip) in net
    except ValueError:
        return False


def decide(policies: list[Policy], user: str, rtype: str, name: str, action: str, ip: str,
           is_filter: bool = False) -> tuple[bool, Policy | None]:
    """(allowed, deciding policy) for a Normal user; no matching policy = deny."""
    best: Policy | None = None
    best_key: tuple[int, int, int] = (0, 0, 0)
    for pol in policies:
        if not pol.applies(user, rtype, name, action, ip, is_filter):
            continue
        key = (*pol.specificity(), 1 if pol.deny else 0)
        if best is None or key > best_key:
            best, best_key = pol, key
    return (best is not None and not best.deny), best
