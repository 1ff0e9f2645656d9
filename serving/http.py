"""HTTP plumbing every server shares (hypercorn on trio, starlette apps): the app with
/healthz and JSON errors, pagination of lists, the body limit and the server itself.
The store's endpoints live in store/http.py, the gateway's in gateway/admin.py."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import run as hypercorn_run
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from serving.accepting import quiet_trio_accept_errors
from serving.fd_budget import over_budget
from serving.host_check import HostCheck, allowed_names
from serving.startup import HTTP_LISTENER, listening
from serving.values import HTTP_MAX_BODY, split_hostport

log = logging.getLogger("lightgate.http")


HTTP_READ_TIMEOUT_S = 30.0


async def healthz(_: Request) -> JSONResponse:
    return JSONResponse({"status": "ok"})


async def _json_error(_: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, HTTPException):
        return JSONResponse({"error": exc.detail}, status_code=exc.status_code)
    log.exception("HTTP handler failed", exc_info=exc)
    return JSONResponse({"error": "internal error"}, status_code=500)


def make_app(routes: list[Any], middleware: list[Middleware] | None = None) -> Starlette:
    """A starlette app with /healthz and JSON errors ({"error": ...}) for every failure.
    Credentials on the API are the store's business: store.api.auth_app adds them."""
    return Starlette(
        routes=[Route("/healthz", healthz), *routes], middleware=middleware or [],
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


class _BudgetedTCPServer(hypercorn_run.TCPServer):
    """hypercorn's connection handler, refusing a connection whose descriptor is in the
    node's reserve (serving.fd_budget) before it reads a byte. hypercorn makes its own
    listeners (trio's, which rest 0.1 s on EMFILE and the like), so the budget is checked
    here; trio's closing of the stream follows our return."""

    async def run(self) -> None:
        stream = self.stream
        sock = stream.socket if isinstance(stream, trio.SocketStream) else None
        if sock is not None and over_budget(sock.fileno(), "HTTP"):
            return
        await super().run()


def _budget_http_connections() -> None:
    hypercorn_run.TCPServer = _BudgetedTCPServer  # type: ignore[misc]
    quiet_trio_accept_errors()


async def serve_http(
    app: Starlette, addr: str, *, max_body: int = HTTP_MAX_BODY,
    allowed_hosts: Iterable[str] = (),
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve `app` on `addr` until cancelled; `task_status.started` gets 'host:port'.
    `allowed_hosts`: Host names answered beside loopback's, IP addresses and `addr`'s
    (serving.host_check)."""
    with listening(*HTTP_LISTENER, addr):
        host, port = split_hostport(addr, "127.0.0.1")
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("lightgate.http.server")
    # Bounds for slow or greedy HTTP clients: headers (h11's 16 KiB), bodies (above), a
    # request that does not arrive in time, and concurrent streams of one HTTP/2 client.
    config.read_timeout = HTTP_READ_TIMEOUT_S
    config.h2_max_concurrent_streams = 16
    guarded = HostCheck(app, allowed_names(host, allowed_hosts))
    app = BodyLimit(guarded, max_body)  # type: ignore[assignment]
    _budget_http_connections()

    async with trio.open_nursery() as nursery:
        with listening(*HTTP_LISTENER, addr):
            binds = await nursery.start(partial(serve, app, config))  # type: ignore[arg-type]
        task_status.started(binds[0].split("://", 1)[1])
