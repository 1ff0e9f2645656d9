"""What changed between two copies of the users and policies, in words, one line per
user or policy: what a reload (SIGHUP) logs. Passwords are never said, only that one
changed."""

from __future__ import annotations

from typing import Any

from store.auth.policy import Policy

# A user's fields, and how a change of each is said (True/False: the flag's words).
_USER_FIELDS = {"password": None, "enabled": ("enabled", "disabled"),
                "super": ("made Super", "no longer Super"),
                "node": ("made a node", "no longer a node")}


def user_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """`before` and `after`: name -> User (store.auth.manager)."""
    out = [f"user {name!r} added" for name in sorted(after.keys() - before.keys())]
    out += [f"user {name!r} removed" for name in sorted(before.keys() - after.keys())]
    for name in sorted(before.keys() & after.keys()):
        old, new = before[name], after[name]
        said = []
        for field, words in _USER_FIELDS.items():
            if getattr(old, field) == getattr(new, field):
                continue
            said.append("password changed" if words is None else
                        words[0] if getattr(new, field) else words[1])
        if said:
            out.append(f"user {name!r} {', '.join(said)}")
    return out


def policy_changes(before: list[Policy], after: list[Policy]) -> list[str]:
    old = {p.key: p for p in before}
    new = {p.key: p for p in after}
    out = [f"policy added: {_said(new[k])}" for k in new.keys() - old.keys()]
    out += [f"policy removed: {_said(old[k])}" for k in old.keys() - new.keys()]
    out += [f"policy changed: {_said(new[k])} (was {','.join(old[k].actions)})"
            for k in old.keys() & new.keys() if old[k] != new[k]]
    return sorted(out)


def _said(p: Policy) -> str:
    """"allow 'bob' PUB,SUB on Topic:plant/# (any source)"."""
    decision = "deny" if p.deny else "allow"
    source = f"from {p.ip}" if p.ip else "any source"
    match = "" if p.match in ("literal", "any") else f", {p.match}"
    return f"{decision} {p.user!r} {','.join(p.actions)} on {p.resource} ({source}{match})"
