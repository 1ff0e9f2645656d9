"""Salted password hashes with scrypt (hashlib, OpenSSL): memory-hard, never plain text;
and the SCRAM-SHA-256 verifier (RFC 5802, RFC 7677) kept beside each hash, so that MQTT 5
clients can prove the password without sending it (gateway.auth.scram).

A verified password is remembered as an HMAC under a per-process key, so a fleet that
reconnects at once pays the scrypt cost once per device, not once per connect.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from collections import OrderedDict

import scramp

N, R, P = 1 << 14, 8, 1  # ~16 MiB and tens of ms per hash: costly to brute-force
MAX_VERIFIED = 10_000
SCRAM_METHOD = "SCRAM-SHA-256"
SCRAM_SCHEME = "scram-sha-256"
SCRAM_ITERATIONS = 4096  # RFC 7677's minimum: the device does the same PBKDF2 work per connect
_SCRAM = scramp.ScramMechanism(SCRAM_METHOD)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def hash_password(password: str) -> str:
    salt = os.urandom(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, n=N, r=R, p=P, dklen=32)
    return f"scrypt${N}${R}${P}${_b64(salt)}${_b64(digest)}"


def _check(password: str, encoded: str) -> bool:
    try:
        scheme, n, r, p, salt, digest = encoded.split("$")
        if scheme != "scrypt":
            return False
        got = hashlib.scrypt(password.encode(), salt=base64.b64decode(salt), n=int(n),
                             r=int(r), p=int(p), dklen=len(base64.b64decode(digest)),
                             maxmem=256 * 1024 * 1024)
    except (ValueError, TypeError):
        return False
    return hmac.compare_digest(got, base64.b64decode(digest))


class PasswordChecker:
    """`verify(password, encoded)`, remembering recent successes (bounded, LRU)."""

    def __init__(self) -> None:
        self._key = os.urandom(32)
        self._verified: OrderedDict[str, bytes] = OrderedDict()

    def _tag(self, password: str, encoded: str) -> bytes:
        return hmac.new(self._key, f"{encoded}\0{password}".encode(), "sha256").digest()

    def cached(self, password: str, encoded: str) -> bool:
        tag = self._verified.get(encoded)
        return tag is not None and hmac.compare_digest(tag, self._tag(password, encoded))

    def verify(self, password: str, encoded: str) -> bool:
        """Blocking (scrypt) unless cached: call from a worker thread."""
        if self.cached(password, encoded):
            return True
        if not _check(password, encoded):
            return False
        self._verified[encoded] = self._tag(password, encoded)
        self._verified.move_to_end(encoded)
        while len(self._verified) > MAX_VERIFIED:
            self._verified.popitem(last=False)
        return True


def make_verifier(password: str, iterations: int = SCRAM_ITERATIONS) -> str:
    """`scram-sha-256$I$SALT$STOREDKEY$SERVERKEY` (base64): what the user record keeps,
    never the password. Blocking (PBKDF2): call from a worker thread."""
    salt, stored_key, server_key, i = _SCRAM.make_auth_info(password, iterations)
    return f"{SCRAM_SCHEME}${i}${_b64(salt)}${_b64(stored_key)}${_b64(server_key)}"


def parse_verifier(encoded: str) -> tuple[bytes, bytes, bytes, int]:
    """(salt, stored_key, server_key, iterations), as scramp's auth_fn returns them."""
    scheme, i, salt, stored, server = encoded.split("$")
    if scheme != SCRAM_SCHEME:
        raise ValueError(f"not a {SCRAM_SCHEME} verifier")
    return (base64.b64decode(salt), base64.b64decode(stored), base64.b64decode(server),
            int(i))
