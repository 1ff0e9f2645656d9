"""HTTP plumbing shared by every server (hypercorn on trio, starlette apps) and the
store's own endpoints."""

from __future__ import annotations

import logging
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

log = logging.getLogger("lightgate.http")


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


def make_app(routes: list[Any]) -> Starlette:
    """A starlette app with /healthz and JSON errors ({"error": ...}) for every failure."""
    return Starlette(
        routes=[Route("/healthz", healthz), *routes],
        exception_handlers={HTTPException: _json_error, Exception: _json_error},
    )


def store_routes(store: Any) -> list[Route]:
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

    return [Route("/api/v1/store/stats", stats), Route("/api/v1/queues", queues)]


async def serve_http(
    app: Starlette, addr: str, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve `app` on `addr` until cancelled; `task_status.started` gets 'host:port'."""
    host, port = split_hostport(addr, "127.0.0.1")
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("lightgate.http.server")

    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve, app, config))  # type: ignore[arg-type]
        task_status.started(binds[0].split("://", 1)[1])
