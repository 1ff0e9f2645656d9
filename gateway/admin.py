"""The gateway's admin HTTP API (JSON under /api/v1), `/metrics` and the dashboard.

Lists take `?limit=` (default 100, at most 1000), `?offset=` and `?q=` (substring of the
client id and/or topic); they answer `{"items": [...], "total": n, "limit", "offset"}`.
Errors are `{"error": "..."}` (serving.http.make_app maps every exception to that).
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import unquote_plus

import trio
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from gateway.broker import Broker
from gateway.metrics import STORE_STATS_TIMEOUT_S, metrics_route
from gateway.session import NUL, Session
from gateway.sessions import stored_sessions
from lightqueue.routing import split_partition_queue
from lightqueue.since import parse_since, parse_time
from lightqueue.topic import validate_topic_filter
from serving.fd_budget import open_fds
from serving.http import paginate
from store.api import AuthManager, DecisionCache, Message, Store, StoreError, Subject, topic_rows

DASHBOARD = Path(__file__).with_name("dashboard")  # served from the package: no CDN
MSG_ID = re.compile(r"[0-9A-Fa-f]{16}")
ALERTS = "alerts/#"
ALERTS_SHOWN = 50
HISTORY_LIMIT = 100  # messages a page of GET /api/v1/messages holds by default
HISTORY_MAX_LIMIT = 1000
PROTOCOLS = {3: "3.1", 4: "3.1.1", 5: "5.0"}
Handler = Callable[[Request], Awaitable[Any]]


def _client_row(s: Session) -> dict[str, Any]:
    conn = s.connection
    return {
        "client_id": s.client_id,
        "connected": conn is not None,
        "peer": conn.peer if conn is not None else None,
        "protocol": s.version,
        "protocol_name": PROTOCOLS.get(s.version, str(s.version)),
        # Which plane carries it: the native engine (gateway.handover) or Python.
        "plane": "native" if getattr(conn, "native", None) is not None else
                 "python" if conn is not None else None,
        "persistent": s.persistent,
        "expiry": s.expiry,
        "subscriptions": len(s.subscriptions),
        "inflight": s.in_flight(),
        "keepalive": conn.keepalive if conn is not None else None,
        "connected_since": conn.connected_at if conn is not None else None,
        "disconnected_at": s.disconnected_at,
    }


def _client_detail(s: Session) -> dict[str, Any]:
    row = _client_row(s)
    row["subscriptions"] = [
        {"filter": sub.topic_filter, "qos": sub.options.qos, "queue": sub.queue,
         "shared": sub.shared is not None, "cursor": s.cursors.get(sub.queue)}
        for sub in s.subscriptions.values()]
    row["inflight"] = [{"packet_id": o.packet_id, "queue": o.queue, "offset": o.offset,
                        "qos": o.qos, "state": o.state} for o in s.outgoing.values()]
    return row


def _body_json(body: bytes) -> dict[str, Any]:
    """UTF-8 bodies as text; anything else as base64, flagged."""
    try:
        return {"body": body.decode("utf-8"), "body_base64": False}
    except UnicodeDecodeError:
        return {"body": base64.b64encode(body).decode(), "body_base64": True}


def _props_json(props: dict[str, Any]) -> dict[str, Any]:
    return {k: (base64.b64encode(v).decode() if isinstance(v, bytes) else v)
            for k, v in props.items()}


def _history_row(m: Message) -> dict[str, Any]:
    """One message of GET /api/v1/messages. `offset` is its offset in its topic's queue
    (a history message carries that queue alone)."""
    try:
        payload, b64 = m.body.decode("utf-8"), False
    except UnicodeDecodeError:
        payload, b64 = base64.b64encode(m.body).decode(), True
    return {"topic": m.topic, "payload": payload, "payload_base64": b64, "qos": m.qos,
            "retain": m.retain, "time": m.store_ts,
            "offset": m.queues[0][1] if m.queues else None, "client_id": m.client_id,
            "properties": _props_json(m.properties), "msg_id": m.msg_id}


# A filter typed into a URL as it is written loses its `#` (the fragment starts there and
# is never sent) and turns its `+` into a space: it would match nothing, and answer 200.
URL_ENCODING = ("in a URL percent-encode # as %23 and + as %2B (filter=plant%2F%23, "
                "filter=plant%2F%2B%2Ftemp): a bare # starts the URL's fragment, which is "
                "never sent, and a bare + is a space")


def _raw_param(request: Request, name: str) -> str | None:
    """A query parameter as it was sent, before percent-decoding."""
    for part in request.scope.get("query_string", b"").decode("latin-1").split("&"):
        key, _, value = part.partition("=")
        if unquote_plus(key) == name:
            return value
    return None


def _url_filter(request: Request) -> str:
    """The `filter` parameter, refused where it is what a bare # or + in a URL leaves:
    nothing, an empty last level (plant/# sent as plant/) or a + (a space). A topic that
    does end in / is asked for with that / percent-encoded (%2F)."""
    topic_filter = request.query_params.get("filter", "")
    raw = _raw_param(request, "filter") or ""
    if not topic_filter:
        raise HTTPException(400, f"filter is empty: {URL_ENCODING}")
    if "+" in raw:
        raise HTTPException(400, f"filter {topic_filter!r} holds a space where a + was "
                                 f"sent: {URL_ENCODING}")
    if topic_filter.endswith("/") and not raw.upper().endswith("%2F"):
        raise HTTPException(400, f"filter {topic_filter!r} ends in an empty level, as "
                                 f"plant/# does once the # is cut off: {URL_ENCODING} (a "
                                 "topic that ends in / is asked for with that / as %2F)")
    try:
        validate_topic_filter(topic_filter)
    except ValueError as exc:
        raise HTTPException(400, f"filter: {exc} (a topic, or a filter with + and #)") from None
    return topic_filter


def _history_args(request: Request) -> tuple[str, str, str | None, int, str | None]:
    """(filter, since, until, limit, cursor) of GET /api/v1/messages, checked here so a
    mistake gets a 400 that names it (the store checks them again, on its own clock)."""
    q = request.query_params
    topic_filter = _url_filter(request)
    try:
        limit = int(q.get("limit", HISTORY_LIMIT))
    except ValueError:
        raise HTTPException(400, "limit must be an integer") from None
    if not 1 <= limit <= HISTORY_MAX_LIMIT:
        raise HTTPException(400, f"limit must be between 1 and {HISTORY_MAX_LIMIT}")
    since, until, cursor = q.get("since", "earliest"), q.get("until") or None, q.get("cursor")
    if cursor is None:
        try:
            parse_since(since)
        except ValueError as exc:
            raise HTTPException(400, f"since: {exc}") from None
    if until is not None:
        try:
            parse_time(until)
        except ValueError as exc:
            raise HTTPException(400, f"until: {exc}") from None
    return topic_filter, since, until, limit, cursor


def _may_read(auth: AuthManager, subject: Subject | None, topic: str, *,
              is_filter: bool = False, cache: DecisionCache | None = None) -> bool:
    """SUB (or GET) on a topic or a whole filter, as the store's HISTORY asks of native
    readers; a disabled auth, or a Super user, may read everything."""
    if not auth.enabled or subject is None or auth.is_super(subject):
        return True
    return any(auth.authorize(subject, "Topic", topic, action, is_filter=is_filter,
                              cache=cache) for action in ("SUB", "GET"))


def _count_tasks(task: trio.lowlevel.Task) -> int:
    n = 1
    for nursery in task.child_nurseries:
        for child in nursery.child_tasks:
            n += _count_tasks(child)
    return n


def _config_json(cfg: object) -> dict[str, Any]:
    """A settings dataclass as JSON: numbers, strings and flags as they are, the rest
    (paths) as text."""
    assert dataclasses.is_dataclass(cfg) and not isinstance(cfg, type)
    return {k: v if isinstance(v, int | float | str | bool | type(None)) else str(v)
            for k, v in dataclasses.asdict(cfg).items()}


def _store_summary(stats: dict[str, Any] | None) -> dict[str, Any]:
    if not stats:  # the store is away: say so, keep the gateway figures
        return {"up": False, "bytes": None, "segments": None, "dispatch_lag": None,
                "messages": None}
    log = stats["commitlog"]
    return {"up": True, "bytes": log["bytes"], "segments": log["segments"],
            "messages": log.get("messages"),
            "dispatch_lag": max(0, log["max_offset"] - stats["index_checkpoint"])}


async def _store_stats(store: Store) -> dict[str, Any] | None:
    """The store's figures, or None when it is away or does not answer within
    STORE_STATS_TIMEOUT_S (the dashboard polls; the gateway's own figures still come)."""
    try:
        with trio.move_on_after(STORE_STATS_TIMEOUT_S):
            return await store.get_stats()
    except Exception:  # noqa: BLE001 - shown as the store being down
        pass
    return None


def _store_away_is_503(handler: Handler) -> Handler:
    """A request that needs the store while it is away (a failover, a hung master) is
    answered 503 with the reason, not 500 with a traceback in the log."""

    @functools.wraps(handler)
    async def run(request: Request) -> Any:
        try:
            return await handler(request)
        except StoreError as exc:
            raise HTTPException(503, f"the store is unavailable: {exc}") from None

    return run


async def _readers(broker: Broker) -> list[tuple[str, str, int]]:
    """(reader, queue, next offset) for every MQTT session, shared group and consumer
    group: what lag is measured against."""
    out: list[tuple[str, str, int]] = []
    for s in broker.sessions.values():
        for sub in s.subscriptions.values():
            if sub.shared is None and sub.queue in s.cursors:
                out.append((f"mqtt:{s.client_id}", sub.queue, s.cursors[sub.queue]))
    for g in broker.groups.values():
        out.append((f"share:{g.group}", g.queue, g.cursor))
    for key, pos in await broker.store.meta_items("offsets", f"group{NUL}"):
        _, group, queue = key.split(NUL, 2)
        out.append((f"group:{group}", queue, int(pos)))
    return out


def _queue_kind(queue: str) -> str:
    """partition, retry, dlq (server apps' groups), wildcard or topic (MQTT)."""
    if split_partition_queue(queue):
        return "partition"
    tail = queue.rpartition("#")[2]
    if tail in ("retry", "dlq") and "/" not in queue:
        return tail
    return "wildcard" if "+" in queue or "#" in queue else "topic"


def gateway_routes(broker: Broker, store_config: object | None = None) -> list[Route | Mount]:
    """The dashboard, /metrics and the admin API of `broker`; `store_config`: the
    in-process store's settings, shown beside the gateway's."""
    return GatewayApi(broker, store_config).routes()


class GatewayApi:
    """The admin API's routes as methods: each takes a Request and answers JSON, and can
    be called on its own (tests do)."""

    def __init__(self, broker: Broker, store_config: object | None = None) -> None:
        self.broker = broker
        self.store = broker.store
        self.store_config = store_config
        self._alerts_registered = False  # routes are built before the loop: register lazily

    def routes(self) -> list[Route | Mount]:
        guard = _store_away_is_503
        return [
            Route("/", self.index),
            Mount("/static", StaticFiles(directory=DASHBOARD), name="static"),
            metrics_route(self.broker),
            Route("/api/v1/overview", self.overview),
            Route("/api/v1/cluster", self.cluster),
            Route("/api/v1/alerts", guard(self.alerts)),
            Route("/api/v1/runtime", self.runtime),
            Route("/api/v1/config", self.config),
            Route("/api/v1/clients", self.clients),
            Route("/api/v1/clients/{client_id:path}/kick", self.kick, methods=["POST"]),
            Route("/api/v1/clients/{client_id:path}", self.client),
            Route("/api/v1/sessions", guard(self.sessions)),
            Route("/api/v1/subscriptions", self.subscriptions),
            Route("/api/v1/topics", guard(self.topics)),
            Route("/api/v1/lag", guard(self.lag)),
            Route("/api/v1/retained", guard(self.retained)),
            Route("/api/v1/retained/{topic:path}", guard(self.retained_delete),
                  methods=["DELETE"]),
            Route("/api/v1/messages", guard(self.messages)),
            Route("/api/v1/messages/{msg_id}", guard(self.message)),
        ]

    def _session(self, request: Request) -> Session:
        s = self.broker.sessions.get(request.path_params["client_id"])
        if s is None:
            raise HTTPException(404, "no such client on this gateway")
        return s

    async def clients(self, request: Request) -> JSONResponse:
        rows = [_client_row(s) for s in self.broker.sessions.values()
                if s.connection is not None]
        return paginate(request, rows, "client_id", "peer")

    async def client(self, request: Request) -> JSONResponse:
        return JSONResponse(_client_detail(self._session(request)))

    async def kick(self, request: Request) -> JSONResponse:
        s = self._session(request)
        if s.connection is None:
            raise HTTPException(409, "client is not connected")
        s.connection.kick()  # the session stays (if persistent); the will goes out
        return JSONResponse({"kicked": s.client_id})

    async def sessions(self, request: Request) -> JSONResponse:
        """Live sessions and offline persistent ones, which only the store knows."""
        rows = []
        for cid, info in stored_sessions(await self.store.meta_items("sessions")):
            live = self.broker.sessions.get(cid)
            rows.append({"client_id": cid, "connected": bool(live and live.connection),
                         "persistent": True, "expiry": info.get("expiry"),
                         "protocol": info.get("version"),
                         "disconnected_at": info.get("disconnected_at")})
        known = {r["client_id"] for r in rows}
        rows += [{"client_id": s.client_id, "connected": s.connection is not None,
                  "persistent": s.persistent, "expiry": s.expiry, "protocol": s.version,
                  "disconnected_at": s.disconnected_at}
                 for s in self.broker.sessions.values() if s.client_id not in known]
        return paginate(request, rows, "client_id")

    async def subscriptions(self, request: Request) -> JSONResponse:
        rows = [{"client_id": s.client_id, "filter": sub.topic_filter, "qos": sub.options.qos,
                 "queue": sub.queue, "shared": sub.shared is not None}
                for s in self.broker.sessions.values() for sub in s.subscriptions.values()]
        return paginate(request, rows, "client_id", "filter")

    async def topics(self, request: Request) -> JSONResponse:
        # Separated mode: topics the store's metadata knows. With the store in-process,
        # store_routes' /api/v1/topics comes first and also finds devices' topics.
        return paginate(request, await topic_rows(self.store), "topic")

    async def lag(self, request: Request) -> JSONResponse:
        """Consumer lag per queue and reader: MQTT sessions (end - cursor), shared
        subscription groups, and server apps' consumer groups (committed offsets)."""
        readers = await _readers(self.broker)
        ends = await self.store.queue_ends(sorted({q for _, q, _ in readers})) if readers else {}
        rows = [{"reader": who, "queue": q, "offset": off, "end": ends.get(q, off),
                 "lag": max(0, ends.get(q, off) - off),
                 "kind": _queue_kind(q)}
                for who, q, off in readers]
        rows.sort(key=lambda r: -r["lag"])  # the ones falling behind first
        return paginate(request, rows, "queue", "reader")

    def _reader(self, request: Request) -> Callable[[str], bool]:
        """Whether the caller may read a message on a topic: SUB (or GET) on it, decided
        as for history (Cluster GET alone reads no payload)."""
        auth, subject, cache = self.broker.auth, getattr(request.state, "subject", None), \
            DecisionCache()
        return lambda topic: _may_read(auth, subject, topic, cache=cache)

    async def retained(self, request: Request) -> JSONResponse:
        may_read = self._reader(request)
        rows = [{"topic": t, "qos": d["qos"], "ts": d.get("ts"), "client_id": d.get("client_id"),
                 **_body_json(d["body"])} for t, d in await self.store.meta_items("retained")
                if may_read(t)]
        return paginate(request, rows, "topic")

    async def retained_delete(self, request: Request) -> JSONResponse:
        topic = request.path_params["topic"]
        if await self.store.meta_get("retained", topic) is None:
            raise HTTPException(404, "no retained message on that topic")
        await self.broker.delete_retained(topic)
        return JSONResponse({"deleted": topic})

    async def message(self, request: Request) -> JSONResponse:
        """One message by id, with where it went: stored when, in which queues, and which
        sessions on this gateway have been past it (delivered) or not yet."""
        msg_id = request.path_params["msg_id"]
        if not MSG_ID.fullmatch(msg_id):
            raise HTTPException(400, "a message id is 16 hex digits (its CommitLog offset)")
        try:
            msg = await self.store.get_message(msg_id)
        except (KeyError, ValueError) as exc:  # past the log, retained away, not a record
            raise HTTPException(404, f"no message {msg_id}: {exc}") from None
        if not self._reader(request)(msg.topic):  # its topic unnamed: ids can be walked
            raise HTTPException(403, f"reading message {msg_id} needs SUB (or GET) on its "
                                     "topic")
        delivered, pending = [], []
        for s in self.broker.sessions.values():
            for queue, off in msg.queues:
                cursor = s.cursors.get(queue)
                if cursor is not None:
                    (delivered if cursor > off else pending).append(
                        {"client_id": s.client_id, "queue": queue, "offset": off})
        return JSONResponse({
            "msg_id": msg.msg_id, "topic": msg.topic, "qos": msg.qos, "retain": msg.retain,
            "client_id": msg.client_id, "store_time": msg.store_ts, "born_time": msg.born_ts,
            "key": msg.key, "properties": _props_json(msg.properties),
            "queues": [{"queue": q, "offset": o} for q, o in msg.queues],
            "delivered_to": delivered, "not_yet_delivered_to": pending, **_body_json(msg.body),
        })

    async def messages(self, request: Request) -> JSONResponse:
        """A page of a topic filter's stored messages, in store order: `filter`, `since`
        (earliest, last, RFC 3339, -15m, epoch ms), `until`, `limit`, and `cursor` (the
        previous page's `next`). With --auth the caller needs SUB on the whole filter,
        and topics it may not read are left out. `cut`: retention removed part of what
        was asked for. A page may hold fewer than `limit` while `next` is not null (the
        store bounds one request's work)."""
        topic_filter, since, until, limit, cursor = _history_args(request)
        auth, subject = self.broker.auth, getattr(request.state, "subject", None)
        if not _may_read(auth, subject, topic_filter, is_filter=True):
            raise HTTPException(403, f"reading {topic_filter!r} needs SUB on all of it")
        try:
            batch = await self.store.history(topic_filter, since, until=until, cursor=cursor,
                                             max_count=limit)
        except ValueError as exc:  # with a cursor, the cursor's: the rest was checked
            raise HTTPException(400, f"cursor: {exc}" if cursor is not None else str(exc)
                                ) from None
        may_read = self._reader(request)
        rows = [_history_row(m) for m in batch.messages if may_read(m.topic)]
        return JSONResponse({"messages": rows, "next": batch.cursor, "cut": batch.cut})

    async def config(self, request: Request) -> JSONResponse:
        out = {"gateway": _config_json(self.broker.config)}
        if self.store_config is not None:
            out["store"] = _config_json(self.store_config)
        return JSONResponse(out)

    async def runtime(self, request: Request) -> JSONResponse:
        """Live tasks and open file descriptors: what a leak would show first."""
        return JSONResponse({
            "tasks": _count_tasks(trio.lowlevel.current_root_task()),
            "open_fds": open_fds(),  # None where the platform does not list them
            "sessions": len(self.broker.sessions),
            "connections": self.broker.stats.connections,
        })

    async def overview(self, request: Request) -> JSONResponse:
        """Counters for the dashboard; it turns them into rates itself."""
        st = self.broker.stats
        sessions = list(self.broker.sessions.values())
        return JSONResponse({
            "time": time.time(), "uptime": time.time() - st.started,
            "connections": st.connections, "sessions": len(sessions),
            "subscriptions": sum(len(s.subscriptions) for s in sessions),
            "inflight": sum(s.in_flight() for s in sessions),
            **st.totals(), "dropped": st.dropped,
            "expired": st.expired, "store": _store_summary(await _store_stats(self.store)),
        })

    async def cluster(self, request: Request) -> JSONResponse:
        """The store group as the store sees it (the dashboard's Store panel): one row
        per store node (address, role, epoch, replicated offset, lag, in sync). The
        embedded store is a single master row."""
        try:
            view = await self.store.cluster()
        except Exception as exc:  # noqa: BLE001 - no master right now (a failover)
            return JSONResponse({"up": False, "error": str(exc), "nodes": []}, status_code=503)
        view["up"] = True
        return JSONResponse(view)

    async def alerts(self, request: Request) -> JSONResponse:
        """The latest messages on alerts/# (its wildcard queue), newest first."""
        if not self._alerts_registered:
            await self.store.add_wildcard(ALERTS)  # idempotent; indexes alerts from now on
            self._alerts_registered = True
        end = await self.store.queue_end(ALERTS)
        res = await self.store.pull(ALERTS, max(0, end - ALERTS_SHOWN), ALERTS_SHOWN)
        may_read = self._reader(request)
        rows = [{"msg_id": m.msg_id, "topic": m.topic, "store_time": m.store_ts,
                 "client_id": m.client_id, **_body_json(m.body)}
                for m in reversed(res.messages) if may_read(m.topic)]
        return JSONResponse({"items": rows, "queue": ALERTS, "end": end})

    async def index(self, request: Request) -> FileResponse:
        return FileResponse(DASHBOARD / "index.html")
