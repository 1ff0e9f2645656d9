"""What an authentication backend is: credentials in, a decision out.

The manager asks its backends in the configured order (`--auth-order`); the first
definite answer (allow or deny) wins, "ignore" asks the next one. A backend knows
nothing of users, policies or the audit log: the manager keeps those.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from store.auth.topic_acl import TopicAcl

ALLOW, DENY, IGNORE = "allow", "deny", "ignore"


@dataclass(frozen=True)
class Credentials:
    client_id: str
    username: str | None
    password: str | None
    ip: str
    cert_cn: str | None  # the verified client certificate's name (--tls-username-from)


@dataclass(frozen=True)
class Decision:
    outcome: str  # allow | deny | ignore
    reason: str = ""  # for the audit log, never for the client
    name: str | None = None  # the identity vouched for, if not the CONNECT username
    acl: TopicAcl | None = None  # the identity's own ACL, instead of the policies
    super_user: bool = False
    disabled: bool = False  # a known user that is switched off (CONNACK Not authorized)
    expires: float | None = None  # epoch seconds the allow lapses (a token's exp); None: never

    @classmethod
    def allow(cls, reason: str, *, name: str | None = None, acl: TopicAcl | None = None,
              super_user: bool = False, expires: float | None = None) -> Decision:
        return cls(ALLOW, reason, name, acl, super_user, expires=expires)

    @classmethod
    def deny(cls, reason: str, disabled: bool = False) -> Decision:
        return cls(DENY, reason, disabled=disabled)

    @classmethod
    def ignore(cls, reason: str) -> Decision:
        return cls(IGNORE, reason)


class Backend(Protocol):
    name: str  # builtin | jwt | http: the --auth-order word and the subject's origin

    async def authenticate(self, creds: Credentials) -> Decision: ...
