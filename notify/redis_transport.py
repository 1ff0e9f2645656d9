"""Notify across nodes through Redis pub/sub (separated mode): the store's "queue X has
new data" events reach the gateways of other processes and machines.

redis-py's asyncio client does not run on trio, so its sync client runs in two threads
the bus owns:
- a publisher thread: `publish` adds names to one pending set (thread-safe, bounded by
  the distinct names), with the ends the store said of them (a mapping of name to
  end); the thread waits `window` after the first name so the burst merges, then sends
  the whole set as one message: an orjson list of names, and, when some have ends, one
  more element, ENDS_TAG then each name's end in the list's order ("" for none). A
  reader that knows nothing of ends takes that element for a queue nobody reads (no
  MQTT topic holds U+0000); one that does reads a list without it as ends unknown;
- a subscriber thread: reads the channel, merges whatever messages are already waiting,
  and hands the batch to trio, where an in-process LocalBus fans it out to subscribers.

A node receives its own events back through Redis, like every other node: one path for
all, at the cost of one round trip. While Redis is unreachable that means no events at
all, which is what `healthy` is for: gateways poll the queue ends meanwhile.

Redis faults never escape the threads: a warning is logged once per outage, both threads
retry with backoff (0.1 s doubling to 2 s), names published meanwhile stay pending (a
set, so bounded) and are sent on reconnect, and subscribers then receive a batch holding
RESYNC ("events may have been lost: re-check every queue").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any

import orjson
import redis
import trio
from redis.backoff import NoBackoff
from redis.retry import Retry
from setproctitle import setthreadtitle

from notify.bus import (
    DEFAULT_BUFFER,
    DEFAULT_WINDOW,
    RESYNC,
    Counters,
    Grown,
    Subscription,
    ends_of,
    grown,
    merge_ends,
)
from notify.local import LocalBus

log = logging.getLogger("lightgate.notify.redis")

CHANNEL = "lightgate:notify"
_READ_POLL = 0.1  # how often the subscriber looks at the stop flag while idle
_DRAIN_MAX = 1000  # messages merged into one hand-over to trio
_JOIN_TIMEOUT = 5.0
# Sends to Redis this far apart at least: under load, a publish (and every node's
# reading of it) per few messages cost more than the messages (a fleet's store sent
# ~350 a second at 2,000 msg/s: ~29 us/msg of Redis client and server CPU over the
# nodes). A name's first send after a quiet spell waits `window` only.
DEFAULT_INTERVAL = 0.01
# The last element of a message whose names have ends: this, then the ends, comma-separated
# in the names' order. U+0000 is in no MQTT topic, so no queue is called that.
ENDS_TAG = "\x00ends:"


class RedisBus(Counters):
    """`async with RedisBus("redis://127.0.0.1:6379") as bus`: same API as LocalBus."""

    def __init__(
        self,
        url: str,
        channel: str = CHANNEL,
        window: float = DEFAULT_WINDOW,
        buffer: int = DEFAULT_BUFFER,
        backoff: tuple[float, float] = (0.1, 2.0),
        connect_timeout: float = 2.0,
        receive: bool = True,
        interval: float = DEFAULT_INTERVAL,
    ) -> None:
        super().__init__()
        self.url = url
        self.channel = channel
        self.window = window
        self.interval = interval
        self.backoff = backoff
        self.connect_timeout = connect_timeout
        # False: this node only publishes (a store node): no subscriber thread, so that
        # the events of every node are not read, decoded and handed to its event loop.
        self.receive = receive
        self.sent = 0  # names sent to Redis
        self.received = 0  # names received from Redis (this node's own included)
        self.resyncs = 0  # reconnects after which subscribers were told to resync
        # Trio-side fan-out only (batches arrive merged: no window); it counts into ours.
        self._local = LocalBus(window=window, buffer=buffer, counters=self)
        self._cond = threading.Condition()
        self._pending: set[str] = set()
        self._pending_ends: dict[str, int] = {}  # of some pending names (see `Grown`)
        self._stopping = False
        self._stopped = threading.Event()  # interrupts backoff sleeps
        self._threads: list[threading.Thread] = []
        self._token: trio.lowlevel.TrioToken | None = None
        self._health_lock = threading.Lock()
        self._pub_ok = True  # no failed send pending
        self._sub_ok = not receive  # subscribed to the channel (or never to be)
        self._outage = False  # a warning was logged and no recovery since
        # Asked in the subscriber thread of each batch received: whether to hand it to
        # trio (False: whoever set it took it there; RESYNC batches are always handed).
        self.early: Callable[[Grown], bool] | None = None
        self.taken_early = 0  # batches `early` kept from trio

    # -- state ------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        """Subscribed, and the last send (if any) went through."""
        return self._pub_ok and self._sub_ok

    def counters(self) -> dict[str, int]:
        return {**super().counters(), "sent": self.sent, "received": self.received,
                "resyncs": self.resyncs, "taken_early": self.taken_early}

    def _set_health(self, part: str, ok: bool, exc: BaseException | None = None) -> None:
        """Log once per outage: when the first part fails, and when all are back."""
        with self._health_lock:
            if part == "pub":
                self._pub_ok = ok
            else:
                self._sub_ok = ok
            if not ok:
                self.count(errors=1)
                if not self._outage:
                    self._outage = True
                    log.warning("notify: Redis unreachable (%s: %s); retrying with backoff, "
                                "events may be lost meanwhile", type(exc).__name__, exc)
            elif self._outage and self._pub_ok and self._sub_ok:
                self._outage = False
                log.warning("notify: Redis reachable again")

    def _client(self, retries: int) -> redis.Redis:
        # Our own loop does the backoff; redis-py's default retries would only delay
        # noticing an outage.
        return redis.Redis.from_url(
            self.url, socket_timeout=self.connect_timeout + 3,
            socket_connect_timeout=self.connect_timeout, socket_keepalive=True,
            retry=Retry(NoBackoff(), retries))

    # -- lifecycle --------------------------------------------------------------------
    async def __aenter__(self) -> RedisBus:
        await self._local.__aenter__()
        self._token = trio.lowlevel.current_trio_token()
        first_try = threading.Event()
        threads: list[tuple[str, Any, tuple[Any, ...]]] = [("publisher", self._publisher, ())]
        if self.receive:
            threads.append(("subscriber", self._subscriber, (first_try,)))
        try:
            for name, target, args in threads:
                t = threading.Thread(target=_named, args=(f"redis-{name}", target, *args),
                                     daemon=True, name=f"notify-redis-{name}")
                t.start()
                self._threads.append(t)
            # Subscribed before returning (or gave up on the first try), so that events
            # published right after entering are not missed when Redis is up.
            if self.receive:
                await trio.to_thread.run_sync(first_try.wait, self.connect_timeout + 1)
        except BaseException as exc:
            await self._shutdown()
            await self._local.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    async def __aexit__(self, *exc: object) -> bool | None:
        await self._shutdown()
        return await self._local.__aexit__(*exc)

    async def _shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._stopped.set()
        # Shielded but bounded: every blocking call in the threads has a timeout, and
        # the trio loop keeps running so a hand-over in progress completes.
        with trio.CancelScope(shield=True):
            for t in self._threads:
                await trio.to_thread.run_sync(t.join, _JOIN_TIMEOUT)
        self._threads.clear()
        self._token = None

    # -- publishing -------------------------------------------------------------------
    def publish(self, names: Iterable[str]) -> None:
        """Non-blocking and thread-safe: from trio or any other thread. `names` may be a
        mapping of each name to its queue's end (the store's dispatch), sent along."""
        new = set(names)
        if not new:
            return
        ends = ends_of(names)
        with self._cond:
            before = len(self._pending)
            merge_ends(self._pending, self._pending_ends, new, ends)
            self._pending |= new
            after = len(self._pending)
            if before == 0:
                self._cond.notify()
        self.count(published=len(new), merged=before + len(new) - after)

    publish_from_thread = publish

    def _publisher(self) -> None:
        client = self._client(retries=1)  # one immediate retry: a stale pooled socket
        delay = self.backoff[0]
        last_sent = -self.interval
        try:
            while True:
                with self._cond:
                    while not self._pending and not self._stopping:
                        self._cond.wait()
                    if not self._pending:
                        return  # stopping, nothing left to send
                    stopping = self._stopping
                if not stopping:  # let the rest of the burst arrive
                    time.sleep(max(self.window, last_sent + self.interval - time.monotonic()))
                with self._cond:
                    names, self._pending = self._pending, set()
                    ends, self._pending_ends = self._pending_ends, {}
                try:
                    client.publish(self.channel, self._encode(names, ends))
                except (redis.RedisError, OSError) as exc:
                    with self._cond:  # keep them for the next try: nothing is lost
                        merge_ends(self._pending, self._pending_ends, names, ends)
                        self._pending |= names
                    self._set_health("pub", False, exc)
                    if stopping or self._stopped.wait(delay):
                        return
                    delay = min(delay * 2, self.backoff[1])
                    continue
                self.sent += len(names)
                last_sent = time.monotonic()
                delay = self.backoff[0]
                if not self._pub_ok:
                    self._set_health("pub", True)
        finally:
            client.close()

    def _encode(self, names: set[str], ends: dict[str, int] | None = None) -> bytes:
        try:
            ordered = sorted(names)
            if ends:
                ordered.append(ENDS_TAG + ",".join(
                    str(ends[n]) if n in ends else "" for n in ordered))
            return orjson.dumps(ordered)
        except orjson.JSONEncodeError:
            # A name that is not valid UTF-8 (a lone surrogate) cannot travel: drop it,
            # and let every node re-check instead, rather than kill this thread.
            ok = set()
            for name in names:
                try:
                    name.encode()
                    ok.add(name)
                except UnicodeEncodeError:
                    self.count(errors=1)
            log.warning("notify: dropped %d unencodable queue names; sending RESYNC",
                        len(names) - len(ok))
            return orjson.dumps(sorted(ok | {RESYNC}))

    # -- subscribing ------------------------------------------------------------------
    def _subscriber(self, first_try: threading.Event) -> None:
        delay = self.backoff[0]
        lost = False  # events may have been missed since the last subscription
        while not self._stopped.is_set():
            client = self._client(retries=0)
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self.channel)
                self._set_health("sub", True)
                delay = self.backoff[0]
                first_try.set()
                if lost:
                    self.resyncs += 1
                    self._hand_over({RESYNC})
                    lost = False
                while not self._stopped.is_set():
                    msg = pubsub.get_message(timeout=_READ_POLL)
                    if msg is None:
                        continue
                    names = self._decode(msg)
                    for _ in range(_DRAIN_MAX):  # merge what is already waiting
                        more = pubsub.get_message(timeout=0.0)
                        if more is None:
                            break
                        names.merge(self._decode(more))
                    self._hand_over(names)
            except Exception as exc:  # never let the thread die: retry, then resync
                if not isinstance(exc, redis.RedisError | OSError):
                    log.exception("notify: unexpected error in the Redis subscriber")
                lost = True
                self._set_health("sub", False, exc)
                first_try.set()
                self._stopped.wait(delay)
                delay = min(delay * 2, self.backoff[1])
            finally:
                try:
                    pubsub.close()
                    client.close()
                except Exception:  # closing a dead connection: nothing to save
                    pass

    def _decode(self, msg: dict) -> Grown:
        if msg.get("type") != "message":
            return Grown()
        try:
            names = orjson.loads(msg["data"])
            if isinstance(names, list) and all(isinstance(n, str) for n in names):
                batch = decode_names(names)
                self.received += len(batch)
                return batch
        except orjson.JSONDecodeError:
            pass
        self.count(errors=1)  # someone else writes to our channel: ignore, but count
        log.debug("notify: ignored a malformed message on %s", self.channel)
        return Grown()

    def _hand_over(self, names: set[str]) -> None:
        """Give a batch to the trio side; blocks until trio took it, so a stalled loop
        backs pressure up to Redis (which disconnects a too-slow subscriber: we then
        reconnect and resync) instead of growing a queue here."""
        token = self._token
        if not names or token is None:
            return
        early = self.early
        if early is not None and RESYNC not in names:
            try:
                if not early(names if isinstance(names, Grown) else grown(names)):
                    self.taken_early += 1
                    return
            except Exception:  # noqa: BLE001 - the thread must go on: trio hears of it
                log.exception("notify: the early look at a batch failed")
        try:
            trio.from_thread.run_sync(self._local.deliver, names, trio_token=token)
        except trio.RunFinishedError:
            pass

    @asynccontextmanager
    async def subscribe(self, buffer: int | None = None) -> AsyncIterator[Subscription]:
        """A subscription receiving every batch from Redis (broadcast)."""
        if not self.receive:
            raise RuntimeError("this bus only publishes (receive=False)")
        async with self._local.subscribe(buffer) as sub:
            yield sub


def decode_names(names: list[str]) -> Grown:
    """A message's list of names as a batch, with the ends its last element says (when
    it is ENDS_TAG's; ends that do not fit their names are left unsaid)."""
    if not names or not names[-1].startswith(ENDS_TAG):
        return Grown(names)
    *names, tail = names
    ends: dict[str, int] = {}
    said = tail[len(ENDS_TAG):].split(",")
    if len(said) == len(names):
        for name, end in zip(names, said, strict=True):
            if end.isdigit():
                ends[name] = int(end)
    return Grown(names, ends)


def _named(name: str, target: Any, *args: Any) -> None:
    """Run `target` in a thread the OS knows by `name` (for /proc and top -H)."""
    setthreadtitle(name)
    target(*args)
