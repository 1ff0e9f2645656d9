"""Authentication and authorisation of the HTTP admin API, and its user/ACL endpoints.

With --auth, every `/api/` path except login/whoami needs credentials: HTTP Basic (for
scripts) or the session cookie from `POST /api/v1/login` (for the dashboard). Reads need
Cluster GET, changes (kick, delete) Cluster UPDATE, users and policies a Super user.
`/healthz`, `/metrics` and the dashboard's static files stay open: they carry no data
beyond counters (scrapers rarely hold credentials).
"""

from __future__ import annotations

import base64
import secrets
import time
from collections import OrderedDict
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from serving.http import make_app
from store.auth import AuthError, AuthManager, Policy, Subject

COOKIE = "lg_session"
SESSION_TTL = 12 * 3600.0
MAX_SESSIONS = 10_000
MAX_JSON_BODY = 64 * 1024  # login, users and policies are all small
OPEN_PATHS = ("/api/v1/login", "/api/v1/logout", "/api/v1/whoami")
SUPER_PREFIXES = ("/api/v1/users", "/api/v1/acl")


class HttpSessions:
    """Login tokens in memory (a restart logs everyone out), bounded and expiring."""

    def __init__(self) -> None:
        self._tokens: OrderedDict[str, tuple[Subject, float]] = OrderedDict()

    def create(self, subject: Subject) -> str:
        token = secrets.token_urlsafe(32)
        self._tokens[token] = (subject, time.monotonic() + SESSION_TTL)
        while len(self._tokens) > MAX_SESSIONS:
            self._tokens.popitem(last=False)
        return token

    def get(self, token: str | None) -> Subject | None:
        entry = self._tokens.get(token or "")
        if entry is None:
            return None
        if entry[1] < time.monotonic():
            del self._tokens[token or ""]
            return None
        return entry[0]

    def drop(self, token: str | None) -> None:
        self._tokens.pop(token or "", None)


class AuthMiddleware:
    """Pure ASGI: decides before any handler runs; puts the subject in request.state."""

    def __init__(self, app: Any, auth: AuthManager, sessions: HttpSessions) -> None:
        self.app = app
        self.auth = auth
        self.sessions = sessions

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.auth.enabled:
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if not path.startswith("/api/") or path in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        subject = await self._subject(request)
        if subject is None:
            await _deny(scope, receive, send, 401, "authentication required")
            return
        problem = self._forbidden(subject, request.method, path)
        if problem:
            await _deny(scope, receive, send, 403, problem)
            return
        scope.setdefault("state", {})["subject"] = subject
        await self.app(scope, receive, send)

    async def _subject(self, request: Request) -> Subject | None:
        header = request.headers.get("authorization", "")
        if header.lower().startswith("basic "):
            try:
                name, _, password = base64.b64decode(header[6:]).decode().partition(":")
            except (ValueError, UnicodeDecodeError):
                return None
            ip = request.client.host if request.client else "?"
            try:
                return await self.auth.authenticate(name, password, ip, "http")
            except AuthError:
                return None
        subject = self.sessions.get(request.cookies.get(COOKIE))
        if subject is not None and not self.auth.still_valid(subject):
            return None
        return subject

    def _forbidden(self, subject: Subject, method: str, path: str) -> str:
        auth = self.auth
        if not auth.still_valid(subject):
            return "user disabled"
        if path.startswith(SUPER_PREFIXES):
            return "" if auth.is_super(subject) else "users and policies need a Super user"
        action = "GET" if method in ("GET", "HEAD") else "UPDATE"
        if auth.is_super(subject) or auth.authorize(subject, "Cluster", "", action):
            return ""
        return f"needs Cluster {action}"


async def _deny(scope: Any, receive: Any, send: Any, status: int, message: str) -> None:
    await JSONResponse({"error": message}, status_code=status)(scope, receive, send)


async def _json(request: Request) -> dict[str, Any]:
    """The JSON object in the body, read only up to MAX_JSON_BODY: login is open to
    anyone, so an unbounded body would let anyone fill the memory."""
    too_big = HTTPException(413, f"body larger than {MAX_JSON_BODY} bytes")
    try:
        if int(request.headers.get("content-length") or 0) > MAX_JSON_BODY:
            raise too_big
    except ValueError:
        raise HTTPException(400, "bad Content-Length") from None
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_JSON_BODY:
            raise too_big
    try:
        body = orjson.loads(raw)
    except ValueError:
        raise HTTPException(400, "body must be JSON") from None
    if not isinstance(body, dict):
        raise HTTPException(400, "body must be a JSON object")
    return body


def auth_app(routes: list[Any], auth: AuthManager, manage_auth: bool = True) -> Starlette:
    """serving.http.make_app with the store's users and policies on the API: login and
    whoami, users/ACL management (unless `manage_auth` is off: a gateway on a remote
    store, which holds only a replica), and credentials checked on every `/api/` path."""
    sessions = HttpSessions()
    return make_app([*auth_routes(auth, sessions, manage_auth), *routes],
                    [Middleware(AuthMiddleware, auth=auth, sessions=sessions)])


def auth_routes(auth: AuthManager, sessions: HttpSessions, manage: bool = True) -> list[Route]:
    """Login/logout/whoami; with `manage`, also users and ACL (where the data lives)."""

    async def login(request: Request) -> JSONResponse:
        body = await _json(request)
        ip = request.client.host if request.client else "?"
        try:
            subject = await auth.authenticate(str(body.get("username") or ""),
                                              str(body.get("password") or ""), ip, "http")
        except AuthError:
            raise HTTPException(401, "bad user name or password") from None
        response = JSONResponse(_whoami(auth, subject))
        response.set_cookie(COOKIE, sessions.create(subject), max_age=int(SESSION_TTL),
                            httponly=True, samesite="strict")
        return response

    async def logout(request: Request) -> JSONResponse:
        sessions.drop(request.cookies.get(COOKIE))
        response = JSONResponse({"ok": True})
        response.delete_cookie(COOKIE)
        return response

    async def whoami(request: Request) -> JSONResponse:
        subject = sessions.get(request.cookies.get(COOKIE))
        if subject is not None and not auth.still_valid(subject):
            subject = None
        return JSONResponse(_whoami(auth, subject))

    routes = [Route("/api/v1/login", login, methods=["POST"]),
              Route("/api/v1/logout", logout, methods=["POST"]),
              Route("/api/v1/whoami", whoami)]
    if manage:
        routes += _management_routes(auth)
    return routes


def _whoami(auth: AuthManager, subject: Subject | None) -> dict[str, Any]:
    return {"auth": auth.enabled, "user": subject.name if subject else None,
            "super": bool(subject) and auth.is_super(subject) if auth.enabled else True}


def _management_routes(auth: AuthManager) -> list[Route]:
    async def users(request: Request) -> JSONResponse:
        if request.method == "GET":
            return JSONResponse({"items": [u.public() for u in auth.users.values()]})
        body = await _json(request)
        try:
            user = await auth.add_user(str(body.get("name", "")), str(body.get("password", "")),
                                       super_user=bool(body.get("super")),
                                       node=bool(body.get("node")))
        except ValueError as exc:
            raise HTTPException(409 if "exists" in str(exc) else 400, str(exc)) from None
        return JSONResponse(user.public(), status_code=201)

    async def user(request: Request) -> JSONResponse:
        name = request.path_params["name"]
        try:
            if request.method == "DELETE":
                await auth.delete_user(name)
                return JSONResponse({"deleted": name})
            body = await _json(request)
            updated = await auth.update_user(name, password=body.get("password"),
                                             enabled=body.get("enabled"),
                                             super_user=body.get("super"),
                                             node=body.get("node"))
        except KeyError as exc:
            raise HTTPException(404, str(exc.args[0])) from None
        return JSONResponse(updated.public())

    async def acl(request: Request) -> JSONResponse:
        q = request.query_params
        if request.method == "GET":
            return JSONResponse({"items": auth.list_policies(q.get("user"))})
        if request.method == "DELETE":
            if not q.get("user"):
                raise HTTPException(400, "?user= is required")
            n = await auth.delete_policies(q["user"], q.get("resource"), q.get("match"))
            return JSONResponse({"deleted": n})
        body = await _json(request)
        try:
            policy = Policy.create(str(body.get("user", "")), str(body.get("resource", "")),
                                   body.get("actions") or "", match=str(body.get("match",
                                                                             "literal")),
                                   ip=str(body.get("ip", "")),
                                   deny=body.get("decision") == "deny")
            await auth.add_policy(policy)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        except KeyError as exc:
            raise HTTPException(404, str(exc.args[0])) from None
        return JSONResponse(policy.to_dict(), status_code=201)

    return [Route("/api/v1/users", users, methods=["GET", "POST"]),
            Route("/api/v1/users/{name}", user, methods=["PATCH", "PUT", "DELETE"]),
            Route("/api/v1/acl", acl, methods=["GET", "POST", "DELETE"])]
