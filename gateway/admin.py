"""The gateway's admin HTTP API (JSON under /api/v1) and `/metrics`.

Lists take `?limit=` (default 100, at most 1000), `?offset=` and `?q=` (substring
filter); they answer `{"items": [...], "total": n, "limit", "offset"}`.
"""

from __future__ import annotations

import base64
import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import trio
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from gateway.broker import Broker
from gateway.metrics import metrics_route
from gateway.session import NUL, Session
from lightqueue.routing import split_partition_queue

DASHBOARD = Path(__file__).with_name("dashboard")  # served locally: no CDN


def _page(request: Request, rows: list[dict[str, Any]], key: str) -> JSONResponse:
    """Filter by ?q= on `key`, then paginate."""
    try:
        limit = min(int(request.query_params.get("limit", "100")), 1000)
        offset = int(request.query_params.get("offset", "0"))
    except ValueError:
        raise HTTPException(400, "limit and offset must be integers") from None
    if limit < 0 or offset < 0:
        raise HTTPException(400, "limit and offset must not be negative")
    q = request.query_params.get("q")
    if q:
        rows = [r for r in rows if q in str(r.get(key, ""))]
    return JSONResponse({"items": rows[offset : offset + limit], "total": len(rows),
                         "limit": limit, "offset": offset})


def _client_row(s: Session) -> dict[str, Any]:
    conn = s.connection
    return {
        "client_id": s.client_id,
        "connected": conn is not None,
        "peer": conn.peer if conn is not None else None,
        "protocol": s.version,
        "persistent": s.persistent,
        "subscriptions": len(s.subscriptions),
        "inflight": len(s.outgoing),
        "connected_since": getattr(conn, "connected_at", None),
    }


def _body_json(body: bytes) -> dict[str, Any]:
    try:
        return {"body": body.decode("utf-8"), "body_base64": False}
    except UnicodeDecodeError:
        return {"body": base64.b64encode(body).decode(), "body_base64": True}


def _props_json(props: dict[str, Any]) -> dict[str, Any]:
    return {k: (base64.b64encode(v).decode() if isinstance(v, bytes) else v)
            for k, v in props.items()}


def _count_tasks(task: Any) -> int:
    n = 1
    for nursery in task.child_nurseries:
        for child in nursery.child_tasks:
            n += _count_tasks(child)
    return n


def _config_json(cfg: Any) -> Any:
    return {k: str(v) if not isinstance(v, int | float | str | bool | type(None)) else v
            for k, v in dataclasses.asdict(cfg).items()}


def gateway_routes(broker: Broker, store_config: Any = None) -> list[Route | Mount]:
    store = broker.store

    def session_or_404(request: Request) -> Session:
        s = broker.sessions.get(request.path_params["client_id"])
        if s is None:
            raise HTTPException(404, "no such client on this gateway")
        return s

    async def clients(request: Request) -> JSONResponse:
        rows = [_client_row(s) for s in broker.sessions.values() if s.connection is not None]
        return _page(request, rows, "client_id")

    async def client(request: Request) -> JSONResponse:
        s = session_or_404(request)
        row = _client_row(s)
        row["subscriptions"] = [
            {"filter": sub.topic_filter, "qos": sub.options.qos, "queue": sub.queue,
             "shared": sub.shared is not None, "cursor": s.cursors.get(sub.queue)}
            for sub in s.subscriptions.values()]
        row["inflight"] = [{"packet_id": o.packet_id, "queue": o.queue, "offset": o.offset,
                            "qos": o.qos, "state": o.state} for o in s.outgoing.values()]
        return JSONResponse(row)

    async def kick(request: Request) -> JSONResponse:
        s = session_or_404(request)
        if s.connection is None:
            raise HTTPException(409, "client is not connected")
        s.connection.kick()
        return JSONResponse({"kicked": s.client_id})

    async def sessions(request: Request) -> JSONResponse:
        rows = []
        for cid, info in await store.meta_items("sessions"):
            live = broker.sessions.get(cid)
            rows.append({"client_id": cid, "connected": bool(live and live.connection),
                         "expiry": info.get("expiry"),
                         "disconnected_at": info.get("disconnected_at")})
        known = {r["client_id"] for r in rows}
        rows += [{"client_id": s.client_id, "connected": s.connection is not None,
                  "expiry": s.expiry, "disconnected_at": s.disconnected_at}
                 for s in broker.sessions.values() if s.client_id not in known]
        return _page(request, rows, "client_id")

    async def subscriptions(request: Request) -> JSONResponse:
        rows = [{"client_id": s.client_id, "filter": sub.topic_filter, "qos": sub.options.qos,
                 "queue": sub.queue, "shared": sub.shared is not None}
                for s in broker.sessions.values() for sub in s.subscriptions.values()]
        return _page(request, rows, "filter")

    async def topics(request: Request) -> JSONResponse:
        rows = [{"topic": t, "partitions": info.get("partitions")}
                for t, info in await store.meta_items("topics")]
        return _page(request, rows, "topic")

    async def lag(request: Request) -> JSONResponse:
        """Consumer lag per queue: MQTT sessions (end - cursor) and consumer groups."""
        readers: list[tuple[str, str, int]] = []
        for s in broker.sessions.values():
            for sub in s.subscriptions.values():
                if sub.shared is None and sub.queue in s.cursors:
                    readers.append((f"mqtt:{s.client_id}", sub.queue, s.cursors[sub.queue]))
        for g in broker.groups.values():
            readers.append((f"share:{g.group}", g.queue, g.cursor))
        for key, pos in await store.meta_items("offsets", f"group{NUL}"):
            _, group, queue = key.split(NUL)
            readers.append((f"group:{group}", queue, int(pos)))
        ends = await store.queue_ends(sorted({q for _, q, _ in readers})) if readers else {}
        rows = [{"reader": who, "queue": q, "offset": off, "end": ends.get(q, off),
                 "lag": max(0, ends.get(q, off) - off),
                 "kind": "partition" if split_partition_queue(q) else "mqtt"}
                for who, q, off in readers]
        return _page(request, rows, "queue")

    async def retained(request: Request) -> JSONResponse:
        rows = [{"topic": t, "qos": d["qos"], "ts": d.get("ts"), "client_id": d.get("client_id"),
                 **_body_json(d["body"])} for t, d in await store.meta_items("retained")]
        return _page(request, rows, "topic")

    async def retained_delete(request: Request) -> JSONResponse:
        topic = request.path_params["topic"]
        if await store.meta_get("retained", topic) is None:
            raise HTTPException(404, "no retained message on that topic")
        await store.meta_delete("retained", topic)
        return JSONResponse({"deleted": topic})

    async def message(request: Request) -> JSONResponse:
        """One message by id, with where it went: stored when, in which queues, and which
        sessions on this gateway have been past it (delivered) or not yet."""
        msg_id = request.path_params["msg_id"]
        try:
            msg = await store.get_message(msg_id)
        except (KeyError, ValueError) as exc:
            raise HTTPException(404, f"no message {msg_id}: {exc}") from None
        delivered, pending = [], []
        for s in broker.sessions.values():
            for queue, off in msg.queues:
                cursor = s.cursors.get(queue)
                if cursor is None:
                    continue
                (delivered if cursor > off else pending).append(
                    {"client_id": s.client_id, "queue": queue, "offset": off})
        return JSONResponse({
            "msg_id": msg.msg_id, "topic": msg.topic, "qos": msg.qos, "retain": msg.retain,
            "client_id": msg.client_id, "store_time": msg.store_ts, "born_time": msg.born_ts,
            "key": msg.key, "properties": _props_json(msg.properties),
            "queues": [{"queue": q, "offset": o} for q, o in msg.queues],
            "delivered_to": delivered, "not_yet_delivered_to": pending, **_body_json(msg.body),
        })

    async def config(request: Request) -> JSONResponse:
        out = {"gateway": _config_json(broker.config)}
        if store_config is not None:
            out["store"] = _config_json(store_config)
        return JSONResponse(out)

    async def runtime(request: Request) -> JSONResponse:
        """Live tasks and open file descriptors: what a leak would show first."""
        return JSONResponse({
            "tasks": _count_tasks(trio.lowlevel.current_root_task()),
            "open_fds": len(os.listdir("/proc/self/fd")),
            "sessions": len(broker.sessions),
            "connections": broker.stats.connections,
        })

    async def overview(request: Request) -> JSONResponse:
        """Counters for the dashboard; it turns them into rates itself."""
        st = broker.stats
        try:
            log = (await store.get_stats())["commitlog"]
            ckpt = (await store.get_stats())["index_checkpoint"]
            store_row = {"bytes": log["bytes"], "segments": log["segments"],
                         "dispatch_lag": max(0, log["max_offset"] - ckpt)}
        except Exception:  # the store is away: say so, keep the gateway figures
            store_row = {"bytes": None, "segments": None, "dispatch_lag": None}
        return JSONResponse({
            "time": time.time(), "connections": st.connections,
            "sessions": len(broker.sessions), "messages_in": st.messages_in,
            "messages_out": st.messages_out, "bytes_in": st.bytes_in,
            "bytes_out": st.bytes_out, "dropped": st.dropped, "store": store_row,
        })

    alerts_ready: list[bool] = []

    async def alerts(request: Request) -> JSONResponse:
        """The latest messages on alerts/# (the wildcard queue, registered on first use)."""
        if not alerts_ready:
            await store.add_wildcard("alerts/#")
            alerts_ready.append(True)
        end = await store.queue_end("alerts/#")
        res = await store.pull("alerts/#", max(0, end - 50), 50)
        rows = [{"topic": m.topic, "store_time": m.store_ts, "client_id": m.client_id,
                 **_body_json(m.body)} for m in reversed(res.messages)]
        return JSONResponse({"items": rows})

    async def index(request: Request) -> FileResponse:
        return FileResponse(DASHBOARD / "index.html")

    return [
        Route("/", index),
        Mount("/static", StaticFiles(directory=DASHBOARD), name="static"),
        Route("/api/v1/overview", overview),
        Route("/api/v1/alerts", alerts),
        metrics_route(broker),
        Route("/api/v1/runtime", runtime),
        Route("/api/v1/config", config),
        Route("/api/v1/clients", clients),
        Route("/api/v1/clients/{client_id:path}/kick", kick, methods=["POST"]),
        Route("/api/v1/clients/{client_id:path}", client),
        Route("/api/v1/sessions", sessions),
        Route("/api/v1/subscriptions", subscriptions),
        Route("/api/v1/topics", topics),
        Route("/api/v1/lag", lag),
        Route("/api/v1/retained", retained),
        Route("/api/v1/retained/{topic:path}", retained_delete, methods=["DELETE"]),
        Route("/api/v1/messages/{msg_id}", message),
    ]
