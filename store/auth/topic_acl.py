"""An ACL that comes with the identity: a JWT's `acl` claim or the HTTP hook's answer.

Format, as EMQX's JWT ACL: `{"pub": [FILTER, ...], "sub": [FILTER, ...], "all": [...]}`;
each entry is an MQTT topic filter that may hold `%c` (client id) and `%u` (username).
PUB on a topic is allowed when a pub/all entry matches it; SUB on a filter when a sub/all
entry covers every topic the filter can match (as for policies). Anything else: deny.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightqueue.topic import TopicError, matches, validate_topic_filter
from store.auth.policy import covers

# A client id or username holding one of these must not fill a placeholder: "+" as a
# client id would turn `devices/%c/#` into every device's topics.
_UNSAFE = ("/", "+", "#", "\0")


def _expand(entry: str, client_id: str, username: str) -> str | None:
    """`entry` with its placeholders filled in; None if a value would widen it."""
    out = entry
    for placeholder, value in (("%c", client_id), ("%u", username)):
        if placeholder in out:
            if not value or any(c in value for c in _UNSAFE):
                return None
            out = out.replace(placeholder, value)
    return out


@dataclass(frozen=True)
class TopicAcl:
    pub: tuple[str, ...] = ()
    sub: tuple[str, ...] = ()

    @classmethod
    def parse(cls, value: Any, client_id: str, username: str) -> TopicAcl:
        """From the claim or answer; ValueError if it is not of the form above."""
        if not isinstance(value, dict):
            raise ValueError("acl must be an object with pub, sub and/or all lists")
        unknown = set(value) - {"pub", "sub", "all"}
        if unknown:
            raise ValueError(f"acl has unknown keys {sorted(unknown)} (use pub, sub, all)")

        def entries(key: str) -> tuple[str, ...]:
            items = value.get(key, [])
            if isinstance(items, str):
                items = [items]
            if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
                raise ValueError(f"acl.{key} must be a list of topic filters")
            out = []
            for item in items:
                try:
                    validate_topic_filter(item)
                except TopicError as exc:
                    raise ValueError(f"acl.{key}: {exc}") from None
                expanded = _expand(item, client_id, username)
                if expanded is not None:
                    out.append(expanded)
            return tuple(out)

        every = entries("all")
        return cls(entries("pub") + every, entries("sub") + every)

    def decide(self, action: str, name: str, is_filter: bool) -> tuple[bool, str]:
        """(allowed, reason) for PUB/SUB on a topic (or, for SUB, a filter)."""
        entries = self.pub if action == "PUB" else self.sub if action == "SUB" else ()
        for entry in entries:
            if covers(entry, name) if is_filter else matches(entry, name):
                return True, f"acl {action.lower()} {entry}"
        return False, f"no acl {action.lower()} entry matches"
