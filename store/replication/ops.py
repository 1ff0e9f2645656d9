"""The group on the store's HTTP: `GET /api/v1/cluster` (role, epoch, log end, the
replicated offset, each replica's lag, the controller's view) and `GET /metrics`
(Prometheus: lightgate_role, lightgate_replication_lag_bytes, lightgate_epoch ..., and
the process's own process_* figures)."""

from __future__ import annotations

from typing import Any

from prometheus_client import ProcessCollector, generate_latest
from prometheus_client.registry import CollectorRegistry
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

ROLES = {"master": 1, "replica": 0, "fenced": 2}
# CPU seconds, resident memory, open descriptors ... of this process, from /proc at
# scrape time (prometheus_client's; it says nothing where there is no /proc).
PROCESS = CollectorRegistry(auto_describe=False)
ProcessCollector(registry=PROCESS)


def cluster_view(store: Any) -> dict[str, Any]:
    """What `GET /api/v1/cluster` and the native CLUSTER answer: the node's status
    (Replication.status) and `nodes`, one row per store node of the group as this node
    sees it. A store in no group (`lightgate serve`) is one master row."""
    repl = getattr(store, "replication", None)
    if repl is None:
        end = store.commitlog.max_offset
        addr = getattr(store, "native_addr", None) or "embedded"
        row = {"node": addr, "addr": addr, "role": "master", "epoch": 0, "offset": end,
               "replicated_offset": end, "lag_bytes": 0, "insync": True}
        return {"node": addr, "role": "master", "epoch": 0, "master": addr, "mode": "none",
                "min_insync": 1, "log_end": end, "truncated_bytes": 0,
                "restarted_bytes": 0, "nodes": [row]}
    st = repl.status()
    st["nodes"] = group_rows(st)
    return st


def group_rows(st: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of the group's nodes from one node's status: the master knows its replicas'
    offsets from their fetches; a node the controller knows of but that is not fetching
    from this master is "absent" (down, or following nobody yet)."""
    ctl = st.get("controller") or {}
    known = ctl.get("nodes", {})
    ctl_insync = set(ctl.get("insync", []))
    end = st["log_end"]

    def epoch_of(node: str) -> int:
        return int(known.get(node, {}).get("last_epoch", 0))

    rows: list[dict[str, Any]] = []
    if st["role"] in ("master", "fenced"):
        rows.append({"node": st["node"], "addr": st["master"], "role": st["role"],
                     "epoch": st["epoch"], "offset": end,
                     "replicated_offset": st.get("replicated_offset", end), "lag_bytes": 0,
                     "insync": True})
        for r in st.get("replicas", []):
            rows.append({"node": r["node"], "addr": r["addr"], "role": "replica",
                         "epoch": epoch_of(r["node"]) or st["epoch"], "offset": r["offset"],
                         "replicated_offset": r["offset"], "lag_bytes": r["lag_bytes"],
                         "insync": bool(r["insync"])})
    else:  # a replica: itself, and the others as the controller last heard of them
        rows.append({"node": st["node"], "addr": known.get(st["node"], {}).get("native"),
                     "role": st["role"], "epoch": st["epoch"], "offset": end,
                     "replicated_offset": end, "lag_bytes": st.get("lag_bytes", 0),
                     "insync": st["node"] in ctl_insync})
    seen = {r["node"] for r in rows}
    for node, info in sorted(known.items()):
        if node in seen:
            continue
        role = "master" if node == ctl.get("master") else "absent"
        offset = int(info.get("offset", 0))
        rows.append({"node": node, "addr": info.get("native"), "role": role,
                     "epoch": epoch_of(node), "offset": offset, "replicated_offset": offset,
                     "lag_bytes": max(0, end - offset) if role != "master" else 0,
                     "insync": node in ctl_insync})
    return rows


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
    return "\n".join(lines) + "\n" + generate_latest(PROCESS).decode()


def cluster_routes(repl: Any) -> list[Route]:
    async def cluster(_: Request) -> JSONResponse:
        return JSONResponse(cluster_view(repl.store))

    async def metrics(_: Request) -> PlainTextResponse:
        return PlainTextResponse(metrics_text(repl), media_type="text/plain; version=0.0.4")

    return [Route("/api/v1/cluster", cluster), Route("/metrics", metrics)]
