"""The store's own HTTP endpoints (stats, queues, topics); the plumbing they run on is
serving/http.py."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import trio
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from lightqueue.routing import partition_queue, split_partition_queue
from serving.http import paginate


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

    routes = [Route("/api/v1/store/stats", stats), Route("/api/v1/queues", queues),
              Route("/api/v1/topics", topics)]
    repl = getattr(store, "replication", None)
    if repl is not None:  # `lightgate store`: its group (store.replication)
        from store.replication.ops import cluster_routes

        routes += cluster_routes(repl)
    return routes
