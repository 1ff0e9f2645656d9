"""SCRAM-SHA-256 (RFC 5802, RFC 7677) as an MQTT 5 enhanced authentication method, on
the `scramp` library (the message grammar, SASLprep and the proof check).

The store keeps a verifier per user, never the password: salt, iteration count,
StoredKey and ServerKey, made when the password is set (store.auth.passwords). No
channel binding (gs2 header "n,,"): MQTT carries no TLS binding data in AUTH.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable
from typing import Any

import scramp

from gateway.auth.enhanced import CONTINUE, SUCCESS, AuthStep
from store.api import SCRAM_ITERATIONS, SCRAM_METHOD, parse_scram_verifier

METHOD = SCRAM_METHOD
_MECH = scramp.ScramMechanism(METHOD)


class ScramSha256:
    """One server-side exchange: client-first -> server-first (continue), client-final
    -> server-final (success) or failure. `lookup(name)` gives the user's verifier
    (None: unknown user, or one whose password was set before verifiers existed)."""

    method = METHOD

    def __init__(self, lookup: Callable[[str], str | None], secret: bytes) -> None:
        self._lookup = lookup
        self._secret = secret  # per process: fake salts for names without a verifier
        self._server: Any = None
        self._user = ""
        self._known = False
        self._missing = "bad username or password"  # the audit reason if the proof fails
        self._done = False

    def _auth_fn(self, escaped: str) -> tuple[bytes, bytes, bytes, int]:
        self._user = escaped.replace("=2C", ",").replace("=3D", "=")
        encoded = self._lookup(self._user)
        if encoded == "":
            self._missing = "user has no SCRAM verifier (password set before SCRAM support: " \
                            "set it again)"
        if encoded:
            try:
                verifier = parse_scram_verifier(encoded)
                self._known = True
                return verifier
            except ValueError:
                pass
        # Unknown names go through the same exchange and fail at the proof, so a client
        # cannot tell them from wrong passwords; the salt is stable per name for the same
        # reason. Random keys: no proof can match them.
        salt = hmac.new(self._secret, self._user.encode(), hashlib.sha256).digest()[:16]
        return salt, os.urandom(32), os.urandom(32), SCRAM_ITERATIONS

    def start(self, data: bytes | None) -> AuthStep:
        if self._server is not None:
            return AuthStep.failure("SCRAM exchange started twice")
        self._server = _MECH.make_server(self._auth_fn)
        try:
            self._server.set_client_first((data or b"").decode())
            return AuthStep(CONTINUE, self._server.get_server_first().encode())
        except (scramp.ScramException, UnicodeDecodeError) as exc:
            self._done = True
            return AuthStep.failure(f"{METHOD}: bad client-first-message: {exc}")

    def step(self, data: bytes | None) -> AuthStep:
        if self._server is None or self._done:
            return AuthStep.failure(f"{METHOD}: unexpected AUTH")
        self._done = True
        try:
            self._server.set_client_final((data or b"").decode())
            final = self._server.get_server_final().encode()
        except (scramp.ScramException, UnicodeDecodeError) as exc:
            why = f"bad username or password ({exc})" if self._known else self._missing
            return AuthStep.failure(f"{METHOD}: {why}", self._user)
        if not self._known:  # unreachable in practice: random keys
            return AuthStep.failure(f"{METHOD}: bad username or password", self._user)
        return AuthStep(SUCCESS, final, user=self._user)
