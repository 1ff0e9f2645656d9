"""Client SDK for server applications: one async core (trio) and a sync facade over it,
as the RocketMQ 5.0 SDK does.

    from lightgate import Producer, Consumer
    p = Producer("127.0.0.1:10911"); p.send("home", b"...", mqtt_topic="home/bath/cmd")
    c = Consumer("127.0.0.1:10911", group="billing", topic="home")
    for msg in c.poll(timeout=1.0): ...; c.ack(msg)

The async twins `AsyncProducer` / `AsyncConsumer` run on trio (the loop the gateway and
store use); from asyncio, use the sync classes in a thread (`asyncio.to_thread`).
Every call's `timeout` bounds all of it: reconnecting, sending and the reply; but for an
idempotent producer's send, where it bounds one attempt, and `delivery_timeout` the
send (as Kafka's request.timeout.ms and delivery.timeout.ms).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import trio

from store import protocol as p
from store.client import DEFAULT_TIMEOUT, NativeClient
from store.common import AnswerLost, StoreError, StoreFullError, StoreUnavailable
from store.groups import retry_queue
from store.record import Message

log = logging.getLogger("lightgate.sdk")
HEARTBEAT_S = 3.0
COMMIT_INTERVAL_S = 0.2
DELIVERY_TIMEOUT = 120.0  # an idempotent send is retried this long (Kafka's default)


class DeliveryTimeout(StoreUnavailable):
    """An idempotent send that no attempt got an answer for within the producer's
    `delivery_timeout`. `maybe_stored`: whether an attempt reached the store (the store
    may then hold the message, and a send of it again under a new id would store it
    twice); False: no attempt went out, nothing was stored."""

    def __init__(self, message: str, maybe_stored: bool) -> None:
        super().__init__(message)
        self.maybe_stored = maybe_stored


# -- tracing hooks ----------------------------------------------------------------------
def _tracer() -> Any:
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    return trace.get_tracer("lightgate")


def span(name: str, **attrs: Any) -> contextlib.AbstractContextManager:
    """An OpenTelemetry span when opentelemetry-api is installed, else nothing."""
    tracer = _tracer()
    if tracer is None:
        return contextlib.nullcontext()
    return tracer.start_as_current_span(name, attributes={k: v for k, v in attrs.items()
                                                          if v is not None})


# -- results ----------------------------------------------------------------------------
@dataclass
class SendResult:
    msg_id: str
    queues: list[tuple[str, int]]


@dataclass
class ReceivedMessage:
    body: bytes
    mqtt_topic: str
    qos: int
    properties: dict[str, Any]
    client_id: str
    msg_id: str
    queue: str
    offset: int
    store_time: int
    key: str = ""
    retain: bool = False

    @property
    def attempt(self) -> int:
        """How many times processing failed before (0 on the first delivery)."""
        return int(self.properties.get("lg_attempt", 0))


def epoch_ms(when: datetime | int | float) -> int:
    """ms since the epoch: a datetime (a naive one is local time, as datetime.timestamp()
    takes it) or a number already in ms."""
    if isinstance(when, datetime):
        return int(when.timestamp() * 1000)
    if isinstance(when, bool) or not isinstance(when, int | float):
        raise TypeError(f"a time is a datetime or ms since the epoch, not {when!r}")
    return int(when)


def _received(m: Message, queue_name: str, offset: int) -> ReceivedMessage:
    return ReceivedMessage(m.body, m.topic, m.qos, m.properties, m.client_id, m.msg_id,
                           queue_name, offset, m.store_ts, m.key, m.retain)


# -- async core -------------------------------------------------------------------------
class AsyncProducer:
    """`async with AsyncProducer(addr) as p: await p.send("home", b"x")` (trio).

    Idempotent unless `idempotent=False`: the store issues the producer an id and
    numbers what it sends to each first-level topic; a send whose answer was lost (a
    dropped connection, a store group's failover, a connection that went silent: each
    attempt waits `timeout`, then the next goes on a new connection) is sent again with
    the same numbers until `delivery_timeout`, and the store keeps it once
    (store.producers). Sends to one topic go one after the other, in call order. A send
    that fails for good raises DeliveryTimeout, whose `maybe_stored` says whether the
    store may hold it; if it may, the producer takes a new id, so that what follows is
    not refused for the gap. Without idempotence `timeout` bounds the send, and a lost
    answer is the caller's (StoreUnavailable)."""

    def __init__(self, addr: str, *, username: str | None = None,
                 password: str | None = None, client_id: str = "",
                 timeout: float = DEFAULT_TIMEOUT, idempotent: bool = True,
                 delivery_timeout: float = DELIVERY_TIMEOUT) -> None:
        if not timeout > 0 or not delivery_timeout > 0:
            raise ValueError(f"timeout ({timeout}) and delivery_timeout "
                             f"({delivery_timeout}) must be above 0")
        self.addr = addr
        self.credentials = (username, password) if username else None
        self.client_id = client_id or f"producer-{uuid.uuid4().hex[:8]}"
        self.timeout = timeout
        self.delivery_timeout = delivery_timeout
        self.idempotent = idempotent
        self.producer_id: str | None = None  # the store's id for this producer
        self.resent = 0  # requests sent again after a lost answer
        # (id, topic) -> sequence of the next message sent to it under that id
        self._next: dict[tuple[str, str], int] = {}
        self._turns: dict[str, trio.Lock] = {}  # topic -> one send at a time
        self._init_lock = trio.Lock()
        self._stack = contextlib.AsyncExitStack()
        self.client: NativeClient | None = None

    async def __aenter__(self) -> AsyncProducer:
        self.client = await self._stack.enter_async_context(
            NativeClient.open(self.addr, credentials=self.credentials))
        if self.idempotent:
            try:
                await self._current_id()
            except p.RemoteError as exc:
                if exc.status != 400 or "unknown request code" not in exc.message:
                    await self._stack.aclose()
                    raise
                log.warning("the store at %s issues no producer ids (an older version): "
                            "%s sends at least once", self.addr, self.client_id)
                self.idempotent = False
            except BaseException:
                await self._stack.aclose()
                raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def send(self, topic: str, body: bytes, *, mqtt_topic: str | None = None,
                   key: str = "", qos: int = 0, retain: bool = False,
                   properties: dict[str, Any] | None = None,
                   timeout: float | None = None) -> SendResult:
        [res] = await self.send_batch(topic, [body], mqtt_topic=mqtt_topic, key=key, qos=qos,
                                      retain=retain, properties=properties, timeout=timeout)
        return res

    async def send_batch(self, topic: str, bodies: list[bytes], *,
                         mqtt_topic: str | None = None, key: str = "", qos: int = 0,
                         retain: bool = False, properties: dict[str, Any] | None = None,
                         timeout: float | None = None) -> list[SendResult]:
        """Many messages in one request (and one CommitLog write)."""
        assert self.client is not None, "use `async with`"
        now = int(time.time() * 1000)
        msgs = [Message(mqtt_topic or topic, b, qos, retain, self.client_id,
                        dict(properties or {}), born_ts=now, key=key) for b in bodies]
        metas, body = p.pack_messages(msgs)
        header: dict[str, Any] = {"topic": topic, "messages": metas}
        with span("lightgate produce", topic=topic, mqtt_topic=mqtt_topic, count=len(msgs)):
            if self.idempotent:
                answer = await self._send_once(topic, header, body, timeout or self.timeout)
            else:
                answer, _ = await self.client.request(p.SEND, header, body,
                                                      timeout=timeout or self.timeout)
        return [SendResult(r["msg_id"], [(q, o) for q, o in r["queues"]])
                for r in answer["results"]]

    async def _send_once(self, topic: str, header: dict[str, Any], body: bytes,
                         timeout: float) -> dict[str, Any]:
        """An idempotent SEND, each attempt within `timeout`, sent again with the same
        sequence while its answer is lost or the store cannot take it now (503: no
        master yet, a replica, a lease lost), until the delivery timeout."""
        assert self.client is not None
        deadline = trio.current_time() + self.delivery_timeout
        count = len(header["messages"])
        what = f"{count} message{'s' if count > 1 else ''} to {topic}"
        async with self._turns.setdefault(topic, trio.Lock()):
            pid = await self._id_for(what, deadline)
            attempt = 0
            maybe_stored = False  # an attempt went out and its answer never came
            last: StoreError | None = None  # why it failed: the most telling error
            while True:
                seq = self._next.get((pid, topic), 0)
                stamped = {**header, "producer": pid, "seq": seq}
                try:
                    answer, _ = await self.client.request(
                        p.SEND, stamped, body, timeout=self._attempt(timeout, deadline),
                        leave_if_silent=True)
                except StoreFullError:
                    raise  # nothing was stored: the same sequence goes next
                except StoreError as exc:  # lost, or refused for now: the same again
                    maybe_stored |= isinstance(exc, AnswerLost)
                    if last is None or not isinstance(exc, StoreUnavailable) \
                            or isinstance(last, StoreUnavailable):
                        last = exc  # (a refusal says more than the timeout after it)
                    if not self._again(exc, deadline):
                        if maybe_stored:
                            self._drop_id(pid)  # the sequence may be taken: a new id next
                        raise self._failed(what, seq, maybe_stored, last,
                                           trio.current_time() >= deadline) from None
                    attempt += 1
                    self.resent += 1
                    log.info("%s: sending %s again (sequence %d): %s", self.client_id,
                             what, seq, exc)
                    await trio.sleep(min(0.05 * attempt, 0.5, _left(deadline)))
                    continue
                except p.RemoteError as exc:
                    if exc.status == 410 and attempt < 3:  # forgotten while idle
                        attempt += 1
                        self._drop_id(pid)
                        pid = await self._id_for(what, deadline)
                        continue
                    raise  # refused: nothing of it was stored
                self._next[(pid, topic)] = seq + count
                return answer

    def _attempt(self, timeout: float, deadline: float) -> float:
        """How long one attempt may wait: `timeout`, within the delivery timeout."""
        return max(0.001, min(timeout, _left(deadline)))

    async def _id_for(self, what: str, deadline: float) -> str:
        """The producer id for a send of `what`; DeliveryTimeout (nothing sent) when
        there is none by `deadline`."""
        try:
            return await self._current_id(deadline)
        except StoreUnavailable as exc:
            raise self._failed(what, None, False, exc, True) from None

    def _failed(self, what: str, seq: int | None, maybe_stored: bool, last: StoreError,
                timed_out: bool) -> StoreError:
        """The error a send that failed for good raises: DeliveryTimeout past the
        delivery timeout; before it (a single store's refusal is its answer) the
        refusal, which says so when an attempt before it may have stored the message."""
        if maybe_stored:
            doubt = (f"{what} may have been stored (sequence {seq} reached the store, its "
                     "answer was lost): sending it again may store it twice")
        else:
            doubt = f"{what} was not stored (no attempt reached the store)"
        if timed_out:
            return DeliveryTimeout(f"not delivered within delivery_timeout="
                                   f"{self.delivery_timeout:g} s: {doubt}; last: {last}",
                                   maybe_stored)
        return type(last)(f"{last}; before it, {doubt}") if maybe_stored else last

    def _again(self, exc: StoreError, deadline: float) -> bool:
        """Whether to send again after `exc`: a lost connection, until the deadline; a
        refusal for now (503) too when the producer was given a store group (the
        client then finds its master); a single store's refusal is its answer."""
        assert self.client is not None
        if trio.current_time() >= deadline:
            return False
        return isinstance(exc, StoreUnavailable) or self.client.group

    def _drop_id(self, pid: str) -> None:
        """Stop using `pid`: the next send asks for a new id (sequences from 0)."""
        if self.producer_id == pid:
            self.producer_id = None
            self._next = {k: v for k, v in self._next.items() if k[0] != pid}

    async def _current_id(self, deadline: float | None = None) -> str:
        """The producer id, asked for when there is none (again while the store cannot
        answer, each attempt within `timeout`, until `deadline`: an id whose answer was
        lost is never used, and the store forgets it when idle)."""
        assert self.client is not None
        async with self._init_lock:
            if deadline is None:
                deadline = trio.current_time() + self.timeout
            while self.producer_id is None:
                try:
                    header, _ = await self.client.request(
                        p.PRODUCER_INIT, {}, timeout=self._attempt(self.timeout, deadline),
                        leave_if_silent=True)
                except StoreFullError:
                    raise
                except StoreError as exc:
                    if not self._again(exc, deadline):
                        raise
                    await trio.sleep(min(0.1, _left(deadline)))
                    continue
                self.producer_id = str(header["producer"])
            return self.producer_id


def _left(deadline: float) -> float:
    return max(0.0, deadline - trio.current_time())


@dataclass
class _QueueState:
    next_offset: int  # next to fetch
    delivered: set[int] = field(default_factory=set)  # handed out, not acked
    acked: set[int] = field(default_factory=set)  # acked above the committed point
    committed: int = 0  # everything below is done

    def advance(self) -> bool:
        moved = False
        while self.committed in self.acked:
            self.acked.discard(self.committed)
            self.committed += 1
            moved = True
        if not self.delivered and not self.acked and self.committed < self.next_offset:
            self.committed, moved = self.next_offset, True  # nothing outstanding below
        return moved


class AsyncConsumer:
    """A member of a consumer group reading a first-level topic (trio).

    Queues are assigned by the store; offsets are committed (automatically after acks
    unless `auto_commit=False`, then call `commit()`). A message that fails is `nack`ed:
    redelivered later with backoff, dead-lettered after `max_attempts`. A group with no
    committed offset starts from the earliest message (`start="earliest"`) or the end.
    """

    def __init__(self, addr: str, group: str, topic: str, *, strategy: str = "average",
                 auto_commit: bool = True, max_attempts: int = 5, start: str = "earliest",
                 member_id: str | None = None, username: str | None = None,
                 password: str | None = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.addr, self.group, self.topic = addr, group, topic
        self.strategy = strategy
        self.auto_commit = auto_commit
        self.max_attempts = max_attempts
        self.start = start
        self.member_id = member_id or f"{group}-{uuid.uuid4().hex[:8]}"
        self.credentials = (username, password) if username else None
        self.timeout = timeout
        self.assigned: list[str] = []
        self.generation = -1
        self._states: dict[str, _QueueState] = {}
        self._held: list[tuple[ReceivedMessage, int]] = []  # retries not yet due
        self._ready: list[ReceivedMessage] = []  # fetched past a poll's max: the next's
        self._stack = contextlib.AsyncExitStack()
        self.client: NativeClient | None = None
        self.rebalances = 0
        self._uncommitted = False
        self._last_commit = 0.0

    async def __aenter__(self) -> AsyncConsumer:
        self.client = await self._stack.enter_async_context(
            NativeClient.open(self.addr, credentials=self.credentials))
        try:
            await self._heartbeat()  # e.g. refused: no right on the group
        except BaseException:
            await self._stack.aclose()  # never leave the client's nursery behind
            raise
        nursery = await self._stack.enter_async_context(trio.open_nursery())
        nursery.start_soon(self._heartbeat_loop)
        self._stack.callback(nursery.cancel_scope.cancel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        with trio.CancelScope(shield=True), contextlib.suppress(Exception):
            await self.commit()
            await self._request(p.HEARTBEAT, {"group": self.group, "topic": self.topic,
                                              "member": self.member_id, "leave": True})
        await self._stack.aclose()

    async def _request(self, code: int, header: dict[str, Any], body: bytes = b"",
                       timeout: float | None = None) -> tuple[dict[str, Any], bytes]:
        assert self.client is not None, "use `async with`"
        return await self.client.request(code, header, body, timeout=timeout or self.timeout)

    # -- membership ---------------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        while True:
            await trio.sleep(HEARTBEAT_S)
            try:
                await self._heartbeat()
            except Exception as exc:  # keep trying; the store may be restarting
                log.warning("heartbeat of %s failed: %s", self.member_id, exc)

    async def _heartbeat(self) -> None:
        header, _ = await self._request(p.HEARTBEAT, {
            "group": self.group, "topic": self.topic, "member": self.member_id,
            "strategy": self.strategy})
        if header["generation"] != self.generation or header["queues"] != self.assigned:
            await self._rebalance(list(header["queues"]))
            self.generation = header["generation"]

    async def _rebalance(self, queues: list[str]) -> None:
        gone = [q for q in self._states if q not in queues]
        if gone:
            await self.commit()
            for q in gone:
                del self._states[q]
            self._held = [(m, o) for m, o in self._held if m.queue not in gone]
            self._ready = [m for m in self._ready if m.queue not in gone]
        new = [q for q in queues if q not in self._states]
        if new:
            header, _ = await self._request(p.FETCH_OFFSETS, {"group": self.group,
                                                               "queues": new})
            for q in new:
                off = header["offsets"].get(q)
                if off is None:
                    off = 0 if self.start == "earliest" else await self._queue_end(q)
                self._states[q] = _QueueState(off, committed=off)
        self.assigned = queues
        self.rebalances += 1
        log.info("%s now reads %s", self.member_id, queues)

    async def _queue_end(self, q: str) -> int:
        header, _ = await self._request(p.QUEUE_RANGE, {"queue": q})
        return int(header["max_offset"])

    async def seek(self, when: datetime | int | float) -> dict[str, int]:
        """Start every topic queue this member reads (not the group's retry queue: what
        waits there is the group's unfinished work) from its first message stored at or
        after `when` (a datetime or ms since the epoch), back or forward; each found by a
        search of the queue's index, not a scan. Messages handed out before and not yet
        acked are forgotten. With auto_commit the new positions are committed at once,
        so a restart, or a member the queue moves to, goes on from there. Returns the
        queues and their new offsets."""
        ms = epoch_ms(when)
        moved: dict[str, int] = {}
        for q in [q for q in self._states if q != retry_queue(self.group)]:
            header, _ = await self._request(p.QUEUE_SEEK, {"queue": q, "time": ms})
            if q in self._states:  # (not rebalanced away meanwhile)
                moved[q] = int(header["offset"])
                self._states[q] = _QueueState(moved[q], committed=moved[q])
        self._held = [(m, o) for m, o in self._held if m.queue not in moved]
        self._ready = [m for m in self._ready if m.queue not in moved]
        if moved:
            self._uncommitted = True
            if self.auto_commit:
                await self.commit()
        return moved

    # -- consuming ----------------------------------------------------------------------
    async def poll(self, timeout: float = 1.0, max_messages: int = 32) -> list[ReceivedMessage]:
        """What is ready now, up to `max_messages` from every queue this member reads;
        if nothing is, the first that comes within `timeout` (with whatever else is
        there by then); [] when none came."""
        deadline = trio.current_time() + timeout
        if self.auto_commit and self._uncommitted and \
                trio.current_time() - self._last_commit >= COMMIT_INTERVAL_S:
            await self.commit()
        while True:
            if len(self._ready) < max_messages:
                self._ready += self._due_retries(max_messages - len(self._ready))
            if len(self._ready) < max_messages:
                self._ready += await self._fetch_all(max_messages - len(self._ready))
            if self._ready:
                out, self._ready = self._ready[:max_messages], self._ready[max_messages:]
                return out
            left = deadline - trio.current_time()
            if left <= 0:
                return []
            if self._states and not self._held:
                await self._wait_any(max_messages, int(min(left, 0.5) * 1000))
            else:
                await trio.sleep(min(left, 0.05))

    async def _fetch_all(self, n: int) -> list[ReceivedMessage]:
        """One pull per assigned queue, all at once (one round trip, not one per queue);
        up to `n` from each (what a poll does not hand out waits for the next)."""
        results: dict[str, list[ReceivedMessage]] = {}

        async def one(q: str, st: _QueueState) -> None:
            results[q] = await self._fetch(q, st, n, 0)

        async with trio.open_nursery() as nursery:
            for q, st in list(self._states.items()):
                nursery.start_soon(one, q, st)
        out: list[ReceivedMessage] = []
        for q in self._states:
            out.extend(results.get(q, []))
        return out

    async def _wait_any(self, n: int, wait_ms: int) -> None:
        """Long-poll every assigned queue at once until one has messages (they go to
        `_ready`) or `wait_ms` passes. The other pulls are dropped unanswered: a queue's
        position moves only with an answer taken in, so nothing is skipped."""
        async with trio.open_nursery() as nursery:

            async def one(q: str, st: _QueueState) -> None:
                got = await self._fetch(q, st, n, wait_ms)
                if got:
                    self._ready += got
                    nursery.cancel_scope.cancel()

            for q, st in list(self._states.items()):
                nursery.start_soon(one, q, st)

    async def _fetch(self, q: str, st: _QueueState, n: int, wait_ms: int) -> list:
        with span("lightgate receive", group=self.group, queue=q):
            header, body = await self._request(
                p.PULL, {"queue": q, "offset": st.next_offset, "max": n, "wait_ms": wait_ms},
                timeout=self.timeout + wait_ms / 1000)
        if self._states.get(q) is not st:
            return []  # rebalanced away while we waited
        msgs = p.unpack_messages(header["messages"], body)
        if header["next_offset"] != st.next_offset and not msgs:
            # Past retention, or back to the end of a log cut by a repair.
            st.next_offset = header["next_offset"]
            st.committed = min(st.committed, st.next_offset)
        out = []
        now_ms = time.time() * 1000
        for m in msgs:
            off = m.offset_in(q)
            st.next_offset = off + 1
            st.delivered.add(off)
            rm = _received(m, q, off)
            if int(m.properties.get("lg_not_before", 0)) > now_ms:
                self._held.append((rm, off))  # a retry whose backoff has not passed
                continue
            out.append(rm)
        return out

    def _due_retries(self, n: int) -> list[ReceivedMessage]:
        now_ms = time.time() * 1000
        due = [(m, o) for m, o in self._held
               if int(m.properties.get("lg_not_before", 0)) <= now_ms][:n]
        for item in due:
            self._held.remove(item)
        return [m for m, _ in due]

    async def ack(self, msg: ReceivedMessage) -> None:
        with span("lightgate ack", group=self.group, msg_id=msg.msg_id):
            st = self._states.get(msg.queue)
            if st is None or msg.offset not in st.delivered:
                return  # rebalanced away: the new owner will see it again
            st.delivered.discard(msg.offset)
            st.acked.add(msg.offset)
            if st.advance():
                self._uncommitted = True  # committed by the next poll (batched), or close

    async def nack(self, msg: ReceivedMessage) -> bool:
        """Processing failed: try again later; True if it went to the dead-letter queue."""
        with span("lightgate nack", group=self.group, msg_id=msg.msg_id):
            # The store copies the message it holds there into the retry queue.
            header, _ = await self._request(p.NACK, {
                "group": self.group, "queue": msg.queue, "offset": msg.offset,
                "max_attempts": self.max_attempts})
        await self.ack(msg)  # handled: its copy lives on in the retry or dead-letter queue
        return bool(header["dead"])

    async def commit(self) -> None:
        """Commit what was acknowledged (auto: at most every 0.2 s, on poll and close)."""
        offsets = {q: st.committed for q, st in self._states.items()}
        self._uncommitted = False
        self._last_commit = trio.current_time()
        if offsets:
            await self._request(p.COMMIT, {"group": self.group, "offsets": offsets})


# -- sync facade ------------------------------------------------------------------------
class _Portal:
    """A trio loop in a daemon thread running one async object; calls cross over."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self._ready: queue.Queue = queue.Queue()
        self._token: trio.lowlevel.TrioToken | None = None
        self._done: trio.Event | None = None
        self.obj: Any = None
        self._thread = threading.Thread(target=trio.run, args=(self._main, factory),
                                        daemon=True, name="lightgate-sdk")
        self._thread.start()
        ok, value = self._ready.get()
        if not ok:
            raise value

    async def _main(self, factory: Callable[[], Any]) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._done = trio.Event()
        try:
            async with factory() as obj:
                self.obj = obj
                self._ready.put((True, None))
                await self._done.wait()
        except BaseException as exc:  # noqa: BLE001 - reported to the creating thread
            if self.obj is None:
                self._ready.put((False, exc))
            else:
                raise

    def call(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        async def run() -> Any:
            return await fn(*args, **kw)

        return trio.from_thread.run(run, trio_token=self._token)

    def close(self) -> None:
        if self._token is not None and self._done is not None:
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._done.set, trio_token=self._token)
            self._thread.join(10)


class Producer:
    """Synchronous producer: `Producer("127.0.0.1:10911").send("home", b"...")`."""

    def __init__(self, addr: str, **kw: Any) -> None:
        self._portal = _Portal(lambda: AsyncProducer(addr, **kw))

    def send(self, topic: str, body: bytes, **kw: Any) -> SendResult:
        return self._portal.call(self._portal.obj.send, topic, body, **kw)

    def send_batch(self, topic: str, bodies: list[bytes], **kw: Any) -> list[SendResult]:
        return self._portal.call(self._portal.obj.send_batch, topic, bodies, **kw)

    def close(self) -> None:
        self._portal.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Consumer:
    """Synchronous consumer: `poll()` returns a list ([] on timeout); iterating blocks."""

    def __init__(self, addr: str, group: str, topic: str, **kw: Any) -> None:
        self._acks: list[ReceivedMessage] = []
        self._portal = _Portal(lambda: AsyncConsumer(addr, group, topic, **kw))

    @property
    def assigned(self) -> list[str]:
        return list(self._portal.obj.assigned)

    def poll(self, timeout: float = 1.0, max_messages: int = 32) -> list[ReceivedMessage]:
        acks, self._acks = self._acks, []
        return self._portal.call(self._poll, acks, timeout, max_messages)

    async def _poll(self, acks: list[ReceivedMessage], timeout: float,
                    max_messages: int) -> list[ReceivedMessage]:
        for msg in acks:  # acks cross into the loop in one go, with the next poll
            await self._portal.obj.ack(msg)
        return await self._portal.obj.poll(timeout, max_messages)

    def ack(self, msg: ReceivedMessage) -> None:
        """Mark done; sent with the next poll, commit or close."""
        self._acks.append(msg)

    def _flush_acks(self) -> None:
        acks, self._acks = self._acks, []
        if acks:
            self._portal.call(self._apply_acks, acks)

    async def _apply_acks(self, acks: list[ReceivedMessage]) -> None:
        for msg in acks:
            await self._portal.obj.ack(msg)

    def nack(self, msg: ReceivedMessage) -> bool:
        self._flush_acks()
        return self._portal.call(self._portal.obj.nack, msg)

    def commit(self) -> None:
        self._flush_acks()
        self._portal.call(self._portal.obj.commit)

    def seek(self, when: datetime | int | float) -> dict[str, int]:
        """See AsyncConsumer.seek: this member's topic queues start from the first
        message stored at or after `when` (a datetime or ms since the epoch)."""
        self._flush_acks()
        return self._portal.call(self._portal.obj.seek, when)

    def __iter__(self) -> Iterator[ReceivedMessage]:
        while True:
            yield from self.poll(timeout=1.0)

    def close(self) -> None:
        self._flush_acks()
        self._portal.close()

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
