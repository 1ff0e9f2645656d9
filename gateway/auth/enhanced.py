"""MQTT 5 enhanced authentication (§4.12) as a sans-IO interface: authentication data
in, a step out. The connection carries the data in CONNECT/AUTH/CONNACK packets; the
AuthManager turns the last step into a subject (audit, brute-force backoff). A method
plugs in by adding a factory to `AuthManager.enhanced_methods`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

CONTINUE, SUCCESS, FAILURE = "continue", "success", "failure"


@dataclass(frozen=True)
class AuthStep:
    outcome: str  # continue | success | failure
    data: bytes | None = None  # authentication data for the client (AUTH or CONNACK)
    user: str | None = None  # the user it proved to be (on failure: claimed to be)
    reason: str = ""  # for the audit log, never for the client

    @classmethod
    def failure(cls, reason: str, user: str | None = None) -> AuthStep:
        return cls(FAILURE, user=user, reason=reason)


class Authenticator(Protocol):
    """One exchange (a CONNECT's, or a re-authentication's): `start` once, then `step`
    for each AUTH the client sends while the outcome is `continue`."""

    method: str

    def start(self, data: bytes | None) -> AuthStep: ...

    def step(self, data: bytes | None) -> AuthStep: ...
