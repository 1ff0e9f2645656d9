"""The HTTP auth hook: an operator's service decides CONNECTs (and, with --auth-http-acl,
each PUBLISH and SUBSCRIBE of the clients it let in).

Request: `POST --auth-http-url` with a JSON body (field names as EMQX's placeholders):
  {"action": "connect", "clientid", "username", "password", "peerhost",
   "cert_common_name", "protocol": "mqtt"}
  {"action": "publish" | "subscribe", "clientid", "username", "peerhost", "topic"}
Answer:
  200 or 204 with an empty body      -> allow
  200 with a JSON object             -> its "result": allow | deny | ignore (ask the next
                                        backend); on connect also "is_superuser", "acl"
                                        ({pub, sub, all} lists with %c/%u) and
                                        "expire_at" (epoch seconds, as EMQX's: the
                                        connection is closed then, and a new CONNECT
                                        asks again)
  401 or 403                         -> deny
  anything else, a timeout, no answer -> --auth-http-on-error: deny (default) | allow | next
Definite answers are cached for --auth-http-cache-s (keyed by a hash of the whole
request; never past their expire_at), so a fleet reconnecting at once asks the service
once per device.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections import OrderedDict
from typing import Any

import httpx
import orjson
import trio

from store.api import ALLOW, DENY, IGNORE, Credentials, Decision, TopicAcl

log = logging.getLogger("lightgate.auth.http")

ON_ERROR = ("deny", "allow", "next")
CACHE_MAX = 10_000
_ACTIONS = {"PUB": "publish", "SUB": "subscribe"}


class TtlCache:
    """At most CACHE_MAX answers, each for `ttl` seconds, oldest out first."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._items: OrderedDict[bytes, tuple[float, Any]] = OrderedDict()

    def get(self, key: bytes) -> Any | None:
        item = self._items.get(key)
        if item is None:
            return None
        if time.monotonic() >= item[0]:
            del self._items[key]
            return None
        return item[1]

    def put(self, key: bytes, value: Any, until: float | None = None) -> None:
        """Remember `value` for the ttl, or until the epoch time `until` if sooner."""
        ttl = self.ttl if until is None else min(self.ttl, until - time.time())
        if ttl <= 0:
            return
        self._items.pop(key, None)
        self._items[key] = (time.monotonic() + ttl, value)
        while len(self._items) > CACHE_MAX:
            self._items.popitem(last=False)


class HttpHook:
    name = "http"

    def __init__(self, url: str, *, timeout_s: float = 5.0, cache_s: float = 30.0,
                 on_error: str = "deny", acl: bool = False) -> None:
        if on_error not in ON_ERROR:
            raise ValueError(f"--auth-http-on-error must be one of {', '.join(ON_ERROR)}")
        self.url = url
        self.timeout_s = timeout_s
        self.on_error = on_error
        self.acl = acl  # also decide PUBLISH/SUBSCRIBE of the clients it let in
        self.cache = TtlCache(cache_s)
        self.calls = 0  # requests actually sent (not answered from the cache)
        self._client: httpx.AsyncClient | None = None
        self._failing = False  # log the service going away and coming back, not every call

    async def authenticate(self, creds: Credentials) -> Decision:
        body = {"action": "connect", "clientid": creds.client_id,
                "username": creds.username or "", "password": creds.password or "",
                "peerhost": creds.ip, "cert_common_name": creds.cert_cn or "",
                "protocol": "mqtt"}
        return await self._ask(body, creds.client_id, creds.username or "")

    async def authorize(self, client_id: str, username: str, ip: str, action: str,
                        topic: str) -> Decision:
        body = {"action": _ACTIONS[action], "clientid": client_id, "username": username,
                "peerhost": ip, "topic": topic}
        return await self._ask(body, client_id, username)

    async def _ask(self, body: dict[str, Any], client_id: str, username: str) -> Decision:
        payload = orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
        key = hashlib.sha256(payload).digest()  # no password kept in the clear as a key
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        if self._client is None:
            # trust_env off: the hook is the operator's service, not something to reach
            # through whatever proxy the environment names.
            self._client = httpx.AsyncClient(timeout=self.timeout_s, trust_env=False)
        self.calls += 1
        try:
            with trio.fail_after(self.timeout_s):  # httpx times each phase; this, the whole
                resp = await self._client.post(
                    self.url, content=payload, headers={"content-type": "application/json"})
        except (trio.TooSlowError, httpx.TimeoutException):
            return self._failed(f"no answer within {self.timeout_s:g} s")
        except httpx.HTTPError as exc:
            return self._failed(f"{type(exc).__name__}: {exc}")
        try:
            decision = self._read(resp, body["action"], client_id, username)
        except ValueError as exc:
            return self._failed(str(exc))
        if self._failing:
            self._failing = False
            log.warning("auth hook %s answers again", self.url)
        self.cache.put(key, decision, decision.expires)
        return decision

    @staticmethod
    def _read(resp: httpx.Response, action: str, client_id: str, username: str) -> Decision:
        status = resp.status_code
        if status in (401, 403):
            return Decision.deny(f"http: {status}")
        if status not in (200, 204):
            raise ValueError(f"answered {status}")
        if status == 204 or not resp.content.strip():
            return Decision.allow("http: allow")
        try:
            answer = orjson.loads(resp.content)
        except orjson.JSONDecodeError:
            raise ValueError("answered 200 with a body that is not JSON") from None
        result = answer.get("result") if isinstance(answer, dict) else None
        if result not in (ALLOW, DENY, IGNORE):
            raise ValueError(f"answered result={result!r} (expected allow, deny or ignore)")
        reason = f"http: {result}"
        if result == DENY:
            return Decision.deny(reason)
        if result == IGNORE:
            return Decision.ignore(reason)
        if action != "connect":
            return Decision.allow(reason)
        acl = None
        if answer.get("acl") is not None:
            try:
                acl = TopicAcl.parse(answer["acl"], client_id, username)
            except ValueError as exc:
                raise ValueError(f"answered a bad acl: {exc}") from None
        return Decision.allow(reason, acl=acl, super_user=answer.get("is_superuser") is True,
                              expires=_expire_at(answer.get("expire_at")))

    def _failed(self, why: str) -> Decision:
        """The service is away or confused: --auth-http-on-error says what that means."""
        if not self._failing:
            self._failing = True
            log.warning("auth hook %s failed (%s): %s until it answers", self.url, why,
                        {"deny": "denying", "allow": "allowing",
                         "next": "asking the next backend"}[self.on_error])
        reason = f"http: {why} (--auth-http-on-error {self.on_error})"
        if self.on_error == "allow":
            return Decision.allow(reason)
        if self.on_error == "next":
            return Decision.ignore(reason)
        return Decision.deny(reason)


def _expire_at(value: Any) -> float | None:
    """The answer's expire_at (epoch seconds), or None; ValueError if it is no time."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"answered expire_at={value!r} (expected epoch seconds)")
    return float(value)
