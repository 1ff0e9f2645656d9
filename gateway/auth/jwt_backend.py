"""JWT authentication: the CONNECT password carries a token (PyJWT does the crypto).

HS256/384/512 verify with the shared secret (--auth-jwt-secret); RS*, PS*, ES* and
EdDSA with the public keys of a JWKS (--auth-jwt-jwks, a file or an http(s) URL),
re-read every --auth-jwt-jwks-refresh-s and, for a key id it does not know (a rotated
key), at most every few seconds. `exp` and `nbf` are checked when present.

Answers: a password that is not a token -> ignore (the next backend may know it); a
token that does not verify, or is malformed in any way -> deny. The identity is the
token's: its `username` claim, else its `sub`; a token naming neither is refused, and so
is a CONNECT username that differs from it (the username is then only a claim the token
must back, never an identity of its own). `clientid` binds the token to a client id;
`acl` ({pub, sub, all} lists, %c/%u with %u the token's identity) becomes the
connection's ACL; `exp` also ends the connection when it passes.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import httpx
import jwt
import trio

from store.api import Credentials, Decision, TopicAcl

log = logging.getLogger("lightgate.auth.jwt")

JWKS_FETCH_TIMEOUT_S = 10.0
UNKNOWN_KID_REFETCH_S = 5.0  # a token naming an unknown key re-reads the set at most this often
# The JWK key types each algorithm family verifies with.
_KTY = {"RS": "RSA", "PS": "RSA", "ES": "EC", "Ed": "OKP"}


def is_url(location: str) -> bool:
    return location.startswith(("http://", "https://"))


@dataclass(frozen=True)
class Jwk:
    kid: str | None
    kty: str
    alg: str | None  # pinned by the set, or None for any of its family
    key: Any  # a cryptography public key


def parse_jwks(data: str | bytes) -> list[Jwk]:
    """The public keys of a JWKS document; ValueError if it holds none we can use.
    Symmetric ("oct") keys are left out: a secret has no place in a published key set."""
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("keys"), list):
        raise ValueError('not a JWKS: no "keys" list')
    keys, unusable = [], []
    for item in doc["keys"]:
        if not isinstance(item, dict) or item.get("kty") in (None, "oct"):
            continue
        if item.get("use", "sig") != "sig":
            continue  # an encryption key
        try:
            key = jwt.PyJWK(item).key
        except (jwt.PyJWKError, jwt.InvalidKeyError, ValueError, TypeError) as exc:
            unusable.append(f"{item.get('kid')}: {exc}")
            continue
        keys.append(Jwk(item.get("kid"), item["kty"], item.get("alg"), key))
    if not keys:
        raise ValueError("the JWKS holds no usable public keys" + (
            f" ({'; '.join(unusable)})" if unusable else ""))
    for why in unusable:
        log.warning("JWKS key left out: %s", why)
    return keys


class JwksSource:
    """The current keys of a JWKS file or URL, refreshed lazily when they are asked for
    (no task of its own: an idle gateway fetches nothing)."""

    def __init__(self, location: str, refresh_s: float) -> None:
        self.location = location
        self.refresh_s = refresh_s
        self.keys: list[Jwk] = []
        self._attempted = -math.inf  # monotonic time of the last load attempt
        self._lock = trio.Lock()
        self._client: httpx.AsyncClient | None = None

    async def key_for(self, kid: str | None, alg: str) -> Any | None:
        """The verification key for a token's header, or None."""
        age = time.monotonic() - self._attempted
        if age >= self.refresh_s:
            await self._reload()
        key = self._find(kid, alg)
        if key is None and time.monotonic() - self._attempted >= UNKNOWN_KID_REFETCH_S:
            await self._reload()
            key = self._find(kid, alg)
        return key

    def _find(self, kid: str | None, alg: str) -> Any | None:
        kty = _KTY.get(alg[:2])
        for k in self.keys:
            if (kid is None or k.kid == kid) and k.kty == kty and k.alg in (None, alg):
                return k.key
        return None

    async def _reload(self) -> None:
        if self._lock.locked() and self.keys:
            return  # another connect is fetching: use the keys we have meanwhile
        async with self._lock:
            if time.monotonic() - self._attempted < 0.5:
                return  # the fetch we waited for is fresh
            self._attempted = time.monotonic()
            try:
                keys = parse_jwks(await self._read())
            except (OSError, httpx.HTTPError, ValueError) as exc:
                # Keep the keys we have: a JWKS endpoint that blips must not log everyone out.
                log.warning("JWKS %s did not load (%s); keeping %d known keys",
                            self.location, exc, len(self.keys))
                return
            if [k.kid for k in keys] != [k.kid for k in self.keys]:
                log.info("JWKS %s: keys %s", self.location, [k.kid for k in keys])
            self.keys = keys

    async def _read(self) -> bytes:
        if not is_url(self.location):
            return await trio.Path(self.location).read_bytes()
        if self._client is None:
            # trust_env off: an auth fetch must not wander through an ambient proxy.
            self._client = httpx.AsyncClient(timeout=JWKS_FETCH_TIMEOUT_S, trust_env=False)
        with trio.fail_after(JWKS_FETCH_TIMEOUT_S):
            resp = await self._client.get(self.location)
        resp.raise_for_status()
        return resp.content


class JwtBackend:
    name = "jwt"

    def __init__(self, secret: bytes | None, jwks: JwksSource | None,
                 algorithms: tuple[str, ...]) -> None:
        self.secret = secret
        self.jwks = jwks
        self.algorithms = algorithms

    async def authenticate(self, creds: Credentials) -> Decision:
        token = creds.password
        if not token or token.count(".") != 2:
            return Decision.ignore("jwt: the password is not a token")
        try:
            header = jwt.get_unverified_header(token)
        except jwt.DecodeError:
            return Decision.ignore("jwt: the password is not a token")
        except jwt.InvalidTokenError as exc:  # token-shaped, with a bad header (a kid that
            return Decision.deny(f"jwt: bad header: {exc}")  # is no string, a crit...)
        alg = header.get("alg")
        if alg not in self.algorithms:
            return Decision.deny(f"jwt: algorithm {alg!r} not accepted (--auth-jwt-algorithms)")
        if alg.startswith("HS"):
            key: Any = self.secret
        else:
            key = await self.jwks.key_for(header.get("kid"), alg) if self.jwks else None
        if key is None:
            return Decision.deny(f"jwt: no key for {alg} kid={header.get('kid')}")
        try:
            # Not aud: nothing here names an audience to expect. Not iat: it only says
            # when the token was made, and an issuer's clock a second ahead would fail it.
            claims = jwt.decode(token, key, algorithms=[alg],
                                options={"verify_aud": False, "verify_iat": False})
        except jwt.ExpiredSignatureError:
            return Decision.deny("jwt: token expired")
        except jwt.ImmatureSignatureError:
            return Decision.deny("jwt: token not valid yet (nbf)")
        except jwt.InvalidSignatureError:
            return Decision.deny("jwt: bad signature")
        except jwt.InvalidTokenError as exc:
            return Decision.deny(f"jwt: {exc}")
        except OverflowError:  # int(1e400) in PyJWT releases that do not catch it
            return Decision.deny("jwt: a time claim out of range")
        return self._admit(claims, creds)

    @staticmethod
    def _admit(claims: dict[str, Any], creds: Credentials) -> Decision:
        name = claims.get("username", claims.get("sub"))
        if not isinstance(name, str) or not name:
            return Decision.deny("jwt: the token names no user (a string sub or username "
                                 "claim)")
        if creds.username and creds.username != name:
            return Decision.deny("jwt: the token is for another username")
        bound_client = claims.get("clientid")
        if bound_client is not None and bound_client != creds.client_id:
            return Decision.deny("jwt: the token is for another client id")
        acl = None
        if "acl" in claims:
            try:
                acl = TopicAcl.parse(claims["acl"], creds.client_id, name)
            except ValueError as exc:
                return Decision.deny(f"jwt: bad acl claim: {exc}")
        exp = claims.get("exp")  # a number when present: PyJWT checked it
        try:
            expires = None if exp is None else float(exp)
        except OverflowError:  # an integer of hundreds of digits: no time at all
            return Decision.deny("jwt: exp out of range")
        return Decision.allow("jwt token", name=name, acl=acl, expires=expires)
