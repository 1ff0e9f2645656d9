"""Notify across nodes through Redis pub/sub.

redis-py's asyncio client does not run on trio, so its sync client runs in two threads:
a publisher that drains merged names and publishes them pipelined, and a subscriber that
listens and hands batches to trio. Events published here come back to this node through
Redis too (simpler than filtering echoes, and it keeps one path for every node).

Redis going away must not stop delivery: `healthy` turns False (gateways fall back to
polling queue ends), both threads retry with backoff, and on reconnect subscribers get
the RESYNC name ("events may have been lost: look at every queue").
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

import redis
import trio

from notify.local import RESYNC, LocalBus

log = logging.getLogger("lightgate.notify.redis")

CHANNEL = "lightgate:notify"
_STOP = object()


class RedisBus:
    def __init__(self, url: str, channel: str = CHANNEL, window: float = 0.002) -> None:
        self.url = url
        self.channel = channel
        self.local = LocalBus(window)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._token: trio.lowlevel.TrioToken | None = None
        self._pub_ok = True
        self._sub_ok = True
        self.published = 0
        self.errors = 0

    @property
    def healthy(self) -> bool:
        return self._pub_ok and self._sub_ok

    @property
    def delivered(self) -> int:
        return self.local.delivered

    async def __aenter__(self) -> RedisBus:
        await self.local.__aenter__()
        self._token = trio.lowlevel.current_trio_token()
        ready = threading.Event()
        for target, args in ((self._publisher, ()), (self._subscriber, (ready,))):
            t = threading.Thread(target=target, args=args, daemon=True,
                                 name=f"notify-{target.__name__.strip('_')}")
            t.start()
            self._threads.append(t)
        await trio.to_thread.run_sync(ready.wait, 5.0)  # subscribed (or gave up waiting)
        return self

    async def __aexit__(self, *exc: object) -> bool | None:
        self._stop.set()
        self._outbox.put(_STOP)
        for t in self._threads:
            await trio.to_thread.run_sync(t.join, 5.0)
        return await self.local.__aexit__(*exc)

    # -- publishing -------------------------------------------------------------------
    def publish(self, names: Iterable[str]) -> None:
        self._outbox.put(set(names))

    publish_from_thread = publish  # a SimpleQueue is thread-safe

    def _publisher(self) -> None:
        client = redis.Redis.from_url(self.url, socket_timeout=2, socket_connect_timeout=2)
        delay = 0.1
        pending: set[str] = set()
        while not self._stop.is_set():
            if not pending:
                item = self._outbox.get()
                if item is _STOP:
                    return
                pending |= item
            while True:  # merge everything already waiting into one message
                try:
                    item = self._outbox.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    return
                pending |= item
            try:
                client.publish(self.channel, "\n".join(sorted(pending)))
                self.published += len(pending)
                pending = set()
                if not self._pub_ok:
                    log.warning("notify: Redis reachable again (publisher)")
                self._pub_ok, delay = True, 0.1
            except redis.RedisError as exc:
                self.errors += 1
                if self._pub_ok:
                    log.warning("notify: Redis unreachable (%s); gateways poll meanwhile", exc)
                self._pub_ok = False
                self._stop.wait(delay)
                delay = min(delay * 2, 2.0)

    # -- subscribing ------------------------------------------------------------------
    def _subscriber(self, ready: threading.Event) -> None:
        delay = 0.1
        first = True
        while not self._stop.is_set():
            try:
                client = redis.Redis.from_url(self.url, socket_timeout=5,
                                              socket_connect_timeout=2)
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(self.channel)
                ready.set()
                if not self._sub_ok or not first:
                    log.warning("notify: Redis reachable again (subscriber): resync")
                    self._deliver({RESYNC})
                self._sub_ok, delay, first = True, 0.1, False
                while not self._stop.is_set():
                    msg = pubsub.get_message(timeout=0.5)
                    if msg and msg.get("type") == "message":
                        data = msg["data"]
                        text = data.decode() if isinstance(data, bytes) else str(data)
                        self._deliver(set(filter(None, text.split("\n"))))
                pubsub.close()
            except redis.RedisError as exc:
                self.errors += 1
                if self._sub_ok:
                    log.warning("notify: lost Redis subscription (%s); retrying", exc)
                self._sub_ok = False
                ready.set()
                self._stop.wait(delay)
                delay = min(delay * 2, 2.0)

    def _deliver(self, names: set[str]) -> None:
        if not names or self._token is None:
            return
        try:
            trio.from_thread.run_sync(self.local.publish, names, trio_token=self._token)
        except trio.RunFinishedError:
            pass

    @asynccontextmanager
    async def subscribe(self) -> AsyncIterator[Any]:
        async with self.local.subscribe() as sub:
            yield sub
