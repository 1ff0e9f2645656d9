"""HTTP plumbing shared by every server (hypercorn on trio, starlette apps) and the
store's own endpoints."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from lightqueue.routing import partition_queue, split_partition_queue
from store.startup import listening

log = logging.getLogger("lightgate.http")


HTTP_MAX_BODY = 1024 * 1024  # a policy, a user, a Spark rule file: all far smaller
HTTP_READ_TIMEOUT_S = 30.0


def split_hostport(addr: str, default_host: str = "0.0.0.0") -> tuple[str, int]:
    """'127.0.0.1:1883' -> ('127.0.0.1', 1883); ':1883' and '1883' use `default_host`."""
    host, sep, port = addr.rpartition(":")
    if not sep:
        host, port = "", addr
    host = host.strip("[]") or default_host
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"bad address {addr!r}: expected HOST:PORT") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"bad port in {addr!r}")
    return host, number


async def healthz(_: Request) -> JSONResponse:
    return JSONResponse({"status": "ok"})


async def _json_error(_: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, HTTPException):
        return JSONResponse({"error": exc.detail}, status_code=exc.status_code)
    log.exception("HTTP handler failed", exc_info=exc)
    return JSONResponse({"error": "internal error"}, status_code=500)


def make_app(routes: list[Any], auth: Any = None, manage_auth: bool = True) -> Starlette:
    """A starlette app with /healthz and JSON errors ({"error": ...}) for every failure;
    with an AuthManager, the API checks credentials and serves login and users/ACL."""
    from starlette.middleware import Middleware

    from store.http_auth import AuthMiddleware, HttpSessions, auth_routes

    middleware = []
    if auth is not None:
        sessions = HttpSessions()
        routes = [*auth_routes(auth, sessions, manage_auth), *routes]
        middleware.append(Middleware(AuthMiddleware, auth=auth, sessions=sessions))
    return Starlette(
        routes=[Route("/healthz", healthz), *routes], middleware=middleware,
        exception_handlers={HTTPException: _json_error, Exception: _json_error},
    )


def paginate(request: Request, rows: list[dict[str, Any]], *keys: str) -> JSONResponse:
    """Filter by `?q=` (substring of any of `keys`), then `?offset=`/`?limit=` (default 100,
    at most 1000): `{"items", "total", "limit", "offset"}`, total counted after the filter."""
    try:
        limit = min(int(request.query_params.get("limit", "100")), 1000)
        offset = int(request.query_params.get("offset", "0"))
    except ValueError:
        raise HTTPException(400, "limit and offset must be integers") from None
    if limit < 0 or offset < 0:
        raise HTTPException(400, "limit and offset must not be negative")
    q = request.query_params.get("q")
    if q:
        rows = [r for r in rows if any(q in str(r.get(k) or "") for k in keys)]
    return JSONResponse({"items": rows[offset : offset + limit], "total": len(rows),
                         "limit": limit, "offset": offset})


async def topic_rows(store: Any, seen: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """First-level topics with their partition queues, each queue's end and every consumer
    group's committed offset and lag on it. Uses only the async store interface (embedded
    or remote); `seen` adds topics found in the index (topic -> partitions)."""
    parts = {t: int(info.get("partitions", 1)) for t, info in await store.meta_items("topics")}
    explicit = set(parts)
    committed: dict[str, dict[str, int]] = defaultdict(dict)  # queue -> group -> offset
    for key, off in await store.meta_items("offsets", "group\x00"):
        _, group, queue = key.split("\x00", 2)
        committed[queue][group] = int(off)
        if (tp := split_partition_queue(queue)) is not None:
            parts[tp[0]] = max(parts.get(tp[0], 0), tp[1] + 1)
    for topic, n in (seen or {}).items():
        parts[topic] = max(parts.get(topic, 0), n)
    queues = [partition_queue(t, i) for t, n in parts.items() for i in range(n)]
    ends = await store.queue_ends(queues) if queues else {}
    return [_topic_row(t, n, t in explicit, ends, committed) for t, n in sorted(parts.items())]


def _topic_row(topic: str, n: int, explicit: bool, ends: dict[str, int],
               committed: dict[str, dict[str, int]]) -> dict[str, Any]:
    queues, lag = [], defaultdict(int)
    for i in range(n):
        q = partition_queue(topic, i)
        end = ends.get(q, 0)
        groups = [{"group": g, "offset": off, "lag": max(0, end - off)}
                  for g, off in sorted(committed.get(q, {}).items())]
        for g in groups:
            lag[g["group"]] += g["lag"]
        queues.append({"queue": q, "end": end, "groups": groups})
    return {"topic": topic, "partitions": n, "explicit": explicit,
            "messages": sum(q["end"] for q in queues), "queues": queues,
            "groups": [{"group": g, "lag": v} for g, v in sorted(lag.items())]}


def _partition_queues(names: Iterable[str]) -> dict[str, int]:
    """topic -> partitions, from queue names (partition i implies at least i + 1)."""
    out: dict[str, int] = {}
    for name in names:
        if (tp := split_partition_queue(name)) is not None:
            out[tp[0]] = max(out.get(tp[0], 0), tp[1] + 1)
    return out


# First-level topics that devices created by publishing exist only as index entries: a
# bounded walk over queue names finds them (one seek per queue; cheap below this).
TOPIC_SCAN_LIMIT = 50_000


TOPIC_SCAN_EVERY_S = 5.0  # the dashboard polls every few seconds: reuse one walk


def store_routes(store: Any) -> list[Route]:
    scanned: dict[str, Any] = {"at": -TOPIC_SCAN_EVERY_S, "topics": {}}

    async def topics(request: Request) -> JSONResponse:
        if trio.current_time() - scanned["at"] >= TOPIC_SCAN_EVERY_S:
            names = await trio.to_thread.run_sync(
                lambda: list(store.index.queues("", TOPIC_SCAN_LIMIT)))
            scanned["topics"], scanned["at"] = _partition_queues(names), trio.current_time()
        seen = {t: max(n, len(store.topic_queues(t))) for t, n in scanned["topics"].items()}
        return paginate(request, await topic_rows(store, seen), "topic")

    async def stats(_: Request) -> JSONResponse:
        return JSONResponse(store.stats())

    async def queues(request: Request) -> JSONResponse:
        prefix = request.query_params.get("prefix", "")
        try:
            limit = min(int(request.query_params.get("limit", "100")), 10_000)
        except ValueError:
            raise HTTPException(400, "limit must be an integer") from None
        rows = await trio.to_thread.run_sync(store.list_queues, prefix, limit)
        return JSONResponse(
            {
                "queues": [
                    {
                        "name": q.name,
                        "min_offset": q.min_offset,
                        "max_offset": q.max_offset,
                        **q.extra,
                    }
                    for q in rows
                ]
            }
        )

    return [Route("/api/v1/store/stats", stats), Route("/api/v1/queues", queues),
            Route("/api/v1/topics", topics)]


class BodyLimit:
    """ASGI middleware: a request body larger than `max_body` gets 413, whether it says
    its length up front or streams it (chunked), before a handler buffers it."""

    def __init__(self, app: Any, max_body: int) -> None:
        self.app = app
        self.max_body = max_body
        self.refused = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.max_body:
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_body:
                await self._refuse(send)
                return
        seen, too_large, started = 0, False, False

        async def limited() -> Any:
            # Past the limit the app is told the client went away, and whatever it
            # answers to that is dropped for our 413.
            nonlocal seen, too_large
            if too_large:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    too_large = True
                    return {"type": "http.disconnect"}
            return message

        async def guarded(message: Any) -> None:
            nonlocal started
            if too_large:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited, guarded)
        except Exception:
            if not too_large:
                raise
        if too_large and not started:
            await self._refuse(send)

    async def _refuse(self, send: Any) -> None:
        self.refused += 1
        body = b'{"error": "request body too large: larger than --http-max-body"}'
        await send({"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


async def serve_http(
    app: Starlette, addr: str, *, max_body: int = HTTP_MAX_BODY,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve `app` on `addr` until cancelled; `task_status.started` gets 'host:port'."""
    with listening("HTTP (dashboard, admin API, metrics)", "--http", addr):
        host, port = split_hostport(addr, "127.0.0.1")
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("lightgate.http.server")
    # Bounds for slow or greedy HTTP clients: headers (h11's 16 KiB), bodies (above), a
    # request that does not arrive in time, and concurrent streams of one HTTP/2 client.
    config.read_timeout = HTTP_READ_TIMEOUT_S
    config.h2_max_concurrent_streams = 16
    app = BodyLimit(app, max_body)  # type: ignore[assignment]

    async with trio.open_nursery() as nursery:
        with listening("HTTP (dashboard, admin API, metrics)", "--http", addr):
            binds = await nursery.start(partial(serve, app, config))  # type: ignore[arg-type]
        task_status.started(binds[0].split("://", 1)[1])
