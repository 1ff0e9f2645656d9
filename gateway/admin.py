"""The gateway's admin HTTP API (JSON under /api/v1)."""

from __future__ import annotations

import os
from typing import Any

import trio
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.broker import Broker


def _client_row(s: Any) -> dict[str, Any]:
    conn = s.connection
    return {
        "client_id": s.client_id,
        "connected": conn is not None,
        "peer": conn.peer if conn is not None else None,
        "protocol": s.version,
        "persistent": s.persistent,
        "subscriptions": len(s.subscriptions),
        "inflight": len(s.outgoing),
    }


def _count_tasks(task: Any) -> int:
    n = 1
    for nursery in task.child_nurseries:
        for child in nursery.child_tasks:
            n += _count_tasks(child)
    return n


def gateway_routes(broker: Broker) -> list[Route]:
    async def clients(request: Request) -> JSONResponse:
        rows = [_client_row(s) for s in broker.sessions.values()]
        return JSONResponse({"clients": rows, "total": len(rows)})

    async def kick(request: Request) -> JSONResponse:
        s = broker.sessions.get(request.path_params["client_id"])
        if s is None or s.connection is None:
            raise HTTPException(404, "no such connected client")
        s.connection.kick()
        return JSONResponse({"kicked": s.client_id})

    async def runtime(request: Request) -> JSONResponse:
        """Live tasks and open file descriptors: what a leak would show first."""
        return JSONResponse({
            "tasks": _count_tasks(trio.lowlevel.current_root_task()),
            "open_fds": len(os.listdir("/proc/self/fd")),
            "sessions": len(broker.sessions),
            "connections": broker.stats.connections,
        })

    return [
        Route("/api/v1/runtime", runtime),
        Route("/api/v1/clients", clients),
        Route("/api/v1/clients/{client_id:path}/kick", kick, methods=["POST"]),
    ]
