"""The group on the store's HTTP: `GET /api/v1/cluster` (role, epoch, log end, the
replicated offset, each replica's lag, the controller's view) and `GET /metrics`
(Prometheus: lightgate_role, lightgate_replication_lag_bytes, lightgate_epoch ...)."""

from __future__ import annotations

import os
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

ROLES = {"master": 1, "replica": 0, "fenced": 2}


def metrics_text(repl: Any) -> str:
    st = repl.status()
    node = st["node"]
    lines = [
        "# HELP lightgate_role This store node's role: 1 master, 0 replica, 2 fenced master",
        "# TYPE lightgate_role gauge",
        f'lightgate_role{{node="{node}",role="{st["role"]}"}} {ROLES.get(st["role"], 0)}',
        "# HELP lightgate_epoch The epoch of the node's last mastership record",
        "# TYPE lightgate_epoch gauge",
        f'lightgate_epoch{{node="{node}"}} {st["epoch"]}',
        "# HELP lightgate_commitlog_end_bytes The node's CommitLog end offset",
        "# TYPE lightgate_commitlog_end_bytes gauge",
        f'lightgate_commitlog_end_bytes{{node="{node}"}} {st["log_end"]}',
        "# HELP lightgate_replication_lag_bytes Bytes a replica is behind its master (on a "
        "master: per replica)",
        "# TYPE lightgate_replication_lag_bytes gauge",
    ]
    if "replicas" in st:
        for r in st["replicas"]:
            lines.append(f'lightgate_replication_lag_bytes{{node="{node}",replica="{r["node"]}"}} '
                         f'{r["lag_bytes"]}')
        lines += ["# HELP lightgate_insync_nodes Nodes of the in-sync set, master included",
                  "# TYPE lightgate_insync_nodes gauge",
                  f'lightgate_insync_nodes{{node="{node}"}} {len(st["insync"])}']
    else:
        lines.append(f'lightgate_replication_lag_bytes{{node="{node}",replica="{node}"}} '
                     f'{st["lag_bytes"]}')
    return "\n".join(lines) + "\n"


def cluster_routes(repl: Any) -> list[Route]:
    async def cluster(_: Request) -> JSONResponse:
        return JSONResponse(repl.status())

    async def metrics(_: Request) -> PlainTextResponse:
        return PlainTextResponse(metrics_text(repl), media_type="text/plain; version=0.0.4")

    routes = [Route("/api/v1/cluster", cluster), Route("/metrics", metrics)]
    if os.environ.get("LIGHTGATE_FAULT_INJECTION") == "1":  # the HA tests only
        async def isolate(_: Request) -> JSONResponse:
            repl.isolate()
            return JSONResponse({"isolated": True})

        routes.append(Route("/api/v1/cluster/isolate", isolate, methods=["POST"]))
    return routes
