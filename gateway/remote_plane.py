"""What a gateway node's native engine (`lightgate gateway` on the native plane) and
Python tell each other beside promotions and demotions (gateway.handover). Its
reactors send their publishes to the store themselves (native/src/remote.rs) and
deliver to the clean sessions' subscribers they carry (native/src/readers.rs): this
gateway's own stored publishes from the store's answers, the rest from raw pulls of
their queues, asked when the store's notify says a queue grew (`grew`, from the
broker's notify loop) and again for a queue whose pull failed (`refresh`).

Python keeps the other subscribers (persistent sessions, its own TLS and WebSocket
streams, shared subscriptions...). So that those are served from the cache at once when
a publisher of this node stored a message, as after Python's own appends
(`Broker.stored_here`), the engine hands back the stored messages of the queues Python
delivers from here, which this room keeps it told of. Those it did not hand back come
through the store's notify, as another gateway's do: this is the fast path, not the
only one."""

from __future__ import annotations

import logging
from typing import Any, Protocol

from notify.bus import ends_of
from serving.rate_limited_log import RateLimitedLog
from store.api import Message

log = logging.getLogger("lightgate.gateway.inbound")
_refused = RateLimitedLog(log)  # appends the store refused (a full disk: every one)

REFRESH_S = 0.25  # how often the queues read here are told to the engine, at most


class Host(Protocol):
    """The broker, as this room sees it (gateway.broker.Broker)."""

    queue_subs: dict[str, set[Any]]
    cache: Any
    registry: Any

    def stored_here(self, stored: list[Message]) -> None: ...


def _python_reads(session: Any) -> bool:
    """Whether Python delivers to this session here: a live connection the engine does
    not carry (`Broker.stored_here` serves only those)."""
    conn = session.connection
    return conn is not None and conn.native is None


class RemoteNews:
    def __init__(self, broker: Host, engine: Any) -> None:
        self.broker = broker
        self.engine = engine
        self._told: set[str] = set()
        self.next_refresh = 0.0
        # A queue's first reader here is told at once: its first messages may be
        # stored a moment later (the refresh only drops the queues no longer read).
        broker.registry.on_new_queue = self.queue_added

    def queue_added(self, name: str) -> None:
        self.engine.add_stored_queue(name)
        self._told.add(name)

    def grew(self, names: set[str]) -> None:
        """The store's notify: the engine pulls those of these queues its subscribers
        read, but not one whose end the notify said and its readers have reached."""
        ends = ends_of(names)
        self.engine.grew(list(names), ends or None)

    def refresh(self, now: float) -> None:
        """Tell the engine which queues Python delivers from here, if that changed; have
        it pull again the queues whose last pull failed."""
        if now < self.next_refresh:
            return
        self.next_refresh = now + REFRESH_S
        self.engine.recheck()
        try:
            names = {name for name, sessions in self.broker.queue_subs.items()
                     if any(_python_reads(s) for s in sessions)}
        except RuntimeError:  # changed under us: next time
            return
        if names != self._told:
            self._told = names
            self.engine.set_stored_queues(names)
        whys, batches = self.engine.take_refused()
        if batches:
            _refused.note("native publishes not stored: " + "; ".join(dict.fromkeys(whys)))

    def stored(self, rows: list[tuple]) -> None:
        """Messages this node's carried publishers stored: as after Python's own appends."""
        msgs = [Message(topic, body, qos, False, client_id, born_ts=born, store_ts=store_ts,
                        phys_offset=phys, size=rsize, queues=queues)
                for topic, body, qos, client_id, born, phys, store_ts, rsize, queues in rows]
        self.broker.cache.offer(msgs)
        self.broker.stored_here(msgs)
