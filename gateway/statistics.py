"""The broker's statistics, `$SYS/broker/...`: what they say, and how they reach their
subscribers. Not through the store, which Mosquitto keeps `$SYS` out of too: stored,
they were 9 records every round, and a `$SYS` topic in the store's pages beside the
devices'. Each round's values become the current ones a new subscription finds
(Retained.statistics, from memory) and go at once to this gateway's subscribers of a `$`
filter, QoS 0; a client with too much waiting for its socket misses a round, which the
next says again. Such a subscriber stays on the Python side of the native plane
(gateway.handover), where the values come from. In separated mode each gateway says its
own."""

from __future__ import annotations

import time
from typing import Any

from gateway.reserved import SERVER_ID
from gateway.session import Subscription
from gateway.stats import Stats
from serving.version import version_line
from store.api import Message

# A client connection (gateway.connection.Connection): named, not imported (it imports
# the rooms that import this one).
Connection = Any
PREFIX = "$SYS/broker/"


def round_of(stats: Stats, sessions: int, commitlog: dict[str, Any]) -> list[Message]:
    """This round's values as retained messages of the broker's (`sessions`: how many
    the gateway holds; `commitlog`: the store's stats of it)."""
    totals = stats.totals()
    values = {
        "version": version_line(),
        "uptime": f"{int(time.time() - stats.started)} seconds",
        "clients/connected": stats.connections,
        "clients/total": sessions,
        "messages/received": totals["messages_in"],
        "messages/sent": totals["messages_out"],
        "bytes/received": totals["bytes_in"],
        "bytes/sent": totals["bytes_out"],
        "store/bytes": commitlog["bytes"],
        "store/segments": commitlog["segments"],
    }
    now = int(time.time() * 1000)
    return [Message(PREFIX + name, str(v).encode(), 0, True, SERVER_ID, born_ts=now,
                    store_ts=now) for name, v in values.items()]


def hand_out(by_queue: dict[str, set[Any]], msgs: list[Message]) -> None:
    """`msgs` to each session here that reads a `$` filter (`by_queue`: the sessions'
    queues, which are their filters; only a filter naming `$` matches a `$` topic)."""
    for queue, readers in list(by_queue.items()):
        if queue.startswith("$"):
            for s in list(readers):
                conn = s.connection
                if conn is not None and conn.alive and conn.delivery is not None \
                        and conn.native is None:  # (promoted: never with a `$` filter)
                    _to_connection(conn, msgs)


def _to_connection(conn: Connection, msgs: list[Message]) -> None:
    sent = False
    for msg in msgs:
        subs = [x for x in conn.session.matching(msg.topic) if x.shared is None]
        if not subs or conn.out.over or conn.checks_delivery and \
                not conn.may("SUB", msg.topic):
            continue
        retain, sids = _options(conn, subs)
        if conn.asks_hook:  # the HTTP hook decides per topic: ask it first
            conn.spawn(_asked, conn, msg, retain, sids)
        else:
            sent |= conn.delivery.send_now(msg, retain, sids)
    if sent:
        conn.flush()


def _options(conn: Connection, subs: list[Subscription]) -> tuple[bool, list[int] | None]:
    """The retain flag and the subscription identifiers, as for a message of a queue."""
    retain = any(x.options.retain_as_published for x in subs)
    sids = [x.subscription_id for x in subs if x.subscription_id] \
        if conn.core.version == 5 else None
    return retain, sids or None


async def _asked(conn: Connection, msg: Message, retain: bool, sids: list[int] | None
                 ) -> None:
    if await conn.may_ask("SUB", msg.topic) and conn.delivery is not None \
            and conn.delivery.send_now(msg, retain, sids):
        conn.flush()
