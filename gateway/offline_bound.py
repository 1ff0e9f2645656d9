"""How far behind a persistent session may resume: at most --max-offline-messages and
--max-offline-bytes behind each queue's end when it comes back; what is older is
skipped, counted and logged."""

from __future__ import annotations

import logging
from typing import Protocol

from gateway.config import GatewayConfig
from gateway.session import Session
from gateway.stats import Stats
from store.api import Store

log = logging.getLogger("lightgate.gateway.delivery")


class Host(Protocol):
    config: GatewayConfig
    stats: Stats
    store: Store


async def apply(s: Session, host: Host) -> None:
    """Move each of `s`'s cursors that lies too far behind up to the bound."""
    cfg, store, stats = host.config, host.store, host.stats
    limit, max_bytes = cfg.max_offline_messages, cfg.max_offline_bytes
    for queue in s.reading():
        cursor = s.cursors.get(queue)
        if cursor is None:
            continue
        end = await store.queue_end(queue)
        start = max(cursor, end - limit) if limit else cursor
        if max_bytes and start < end:
            start = await store.queue_tail_start(queue, start, max_bytes)
        if start > cursor:
            dropped = start - cursor
            s.cursors[queue] = start
            s.offsets_dirty.add(queue)
            stats.dropped += dropped
            stats.offline_dropped += dropped
            log.warning("client %r: %d offline messages on %r dropped (limit %d "
                        "messages, %d bytes)", s.client_id, dropped, queue, limit, max_bytes)
