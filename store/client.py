"""Native-protocol client (trio): one connection to a store (of a group: to its master,
found and followed through failovers and hangs), requests multiplexed by id.
`RemoteStore` gives the gateway the same async interface as the in-process store, so
one gateway code runs embedded or separated."""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio

from serving.startup import first_of
from serving.values import split_hostport
from store import protocol as p
from store.common import (
    AnswerLost,
    HistoryBatch,
    PullResult,
    QueueSeek,
    StoreError,
    StoreFullError,
    StoreUnavailable,
    await_future,
)
from store.record import Message
from store.streams import batched_writer

log = logging.getLogger("lightgate.client")

DEFAULT_TIMEOUT = 10.0
MASTER = "master"
# A request this long past when its answer was due (its long-poll wait included) makes
# the client ask the node, on a connection of its own, whether it is alive and still
# master: the request's own connection may queue behind up to 64 others at the node.
PROBE_AFTER_S = 1.0
# Dialing a node and its HELLO answer. A stopped process (SIGSTOP, a frozen VM) still
# has its kernel accept connections, so only an answer proves a node alive.
HELLO_TIMEOUT_S = 2.0
# A search for the master waits this long for other nodes' answers once one says it is
# master: a second master claim with a later epoch wins (the other one is stale).
MASTER_GRACE_S = 0.2
# ... and this long for nodes that stopped answering lately, once the others answered.
SUSPECT_GRACE_S = 0.3
SEARCH_PAUSE_S = (0.1, 0.5)  # between rounds of the search: from, doubling up to
SEARCH_LOG_S = 5.0  # while no master is found: one line this often, not one a round
WATCH_TICK_S = 0.25
# Frames written to the connection but not yet taken by its writer task (as the store's
# server bounds its own). Requests that can wait (`request`) wait for room; a submission
# that cannot (`submit`: an append started from the trio thread) fails as unavailable
# rather than grow memory without end while the store does not read.
SEND_QUEUE = 256
# Requests sent again when their connection was lost (reads, and registrations that mean
# the same twice): they wait for the next master within their timeout. Writes are
# failed back to the caller, who knows whether a second copy is harmless (a device
# re-sends a QoS 1 publish).
RETRY_SAFE = frozenset({
    p.PULL, p.QUEUE_RANGE, p.QUEUE_ENDS, p.QUEUE_TAIL, p.FETCH_OFFSETS, p.GET_MESSAGE,
    p.FIND_KEY, p.TOPIC_LIST, p.TOPIC_DESCRIBE, p.META_GET, p.META_ITEMS, p.STATS,
    p.CLUSTER, p.GATEWAY_LIST, p.GATEWAY_HEARTBEAT, p.SHARED_LEASE, p.WILDCARD_ADD,
    p.USER_LIST, p.ACL_LIST,
})
MAX_ATTEMPTS = 3  # of a RETRY_SAFE request (a failover costs one)

Addr = tuple[str, int]


class AuthFailed(p.RemoteError):
    """The store refused these credentials (or their absence): retrying will not help."""


def _raise_for(frame: p.Frame) -> None:
    if frame.kind == p.ERROR:
        status = int(frame.header.get("status", 500))
        message = str(frame.header.get("error", "error"))
        if status == 507:
            raise StoreFullError(message)
        if status == 503:
            raise StoreError(message)
        raise p.RemoteError(status, message)


@dataclass
class _Answer:
    """A node's HELLO answer, on the connection it came on (kept if the node is chosen)."""

    addr: Addr
    stream: trio.SocketStream
    decoder: p.FrameDecoder
    hello: dict[str, Any]

    @property
    def role(self) -> str:
        return str(self.hello.get("role") or MASTER)  # a store in no group is master

    @property
    def epoch(self) -> int:
        return int(self.hello.get("epoch") or 0)


def _name(addr: Addr) -> str:
    return f"{addr[0]}:{addr[1]}"


def _reason(exc: BaseException) -> str:
    """Why a dial failed, short: "connection refused" rather than trio's "all attempts to
    connect to HOST:PORT failed"."""
    cause = first_of(exc.__cause__, OSError) if exc.__cause__ is not None else None
    if cause is not None and cause.errno:
        return os.strerror(cause.errno).lower()
    return str(exc)


class NativeClient:
    """`async with NativeClient.open("host:port") as c: header, body = await c.request(...)`

    A store group's addresses, comma-separated ("a:1,b:2,c:3"): the client asks every
    node and stays with the one whose HELLO says it is master (the latest epoch, if two
    say so). It looks again when its connection ends, when a request goes unanswered
    while the node does not answer a HELLO either (hung, partitioned), and when the
    node says it is no longer master; until it finds one, requests wait (within their
    timeout) and publishes fail at once."""

    def __init__(self, addr: str, *, credentials: tuple[str, str] | None = None,
                 connect_timeout: float = 5.0,
                 node: tuple[str, bytes] | None = None) -> None:
        self.addr = addr
        self.credentials = credentials
        self.node = node  # a store node of the group: (its name, the group secret)
        self.hello: dict[str, Any] = {}  # the master's answer: version, auth, user, node
        self.fatal: Exception | None = None
        self._settled = trio.Event()  # first connection made, or failed for good
        self.addrs = list(dict.fromkeys(
            split_hostport(a.strip(), "127.0.0.1") for a in addr.split(",") if a.strip()
        )) or [split_hostport(addr, "127.0.0.1")]
        self.group = len(self.addrs) > 1
        self.host, self.port = self.addrs[0]
        self.connect_timeout = connect_timeout
        self.last_failure = ""  # why the last search found no master (for the log)
        # The last search: nodes that answered, and a master they named that did not
        # (the group has one, out of this client's reach) or None.
        self.answering = 0
        self.master_elsewhere: str | None = None
        self._suspect: set[Addr] = set()  # stopped answering: not waited for in a search
        self._ids = itertools.count(1)
        self._waiting: dict[int, Future] = {}
        self._due: dict[int, float] = {}  # request id -> when its answer is due
        self._last_heard = 0.0  # when the connection last brought bytes
        self._recheck = False  # the node refused a request (503): is it still master?
        self._send: trio.MemorySendChannel[bytes] | None = None
        self._session_no = 0  # counts the connections to a master made so far
        self._leave: Callable[[str], None] | None = None  # ends the current session
        self._connected = trio.Event()
        self._closed = False
        self.reconnects = 0

    @classmethod
    @asynccontextmanager
    async def open(cls, addr: str, *, wait: bool = True,
                   **kw: Any) -> AsyncIterator[NativeClient]:
        """Connected to the store (the group's master) within `connect_timeout`, or
        StoreUnavailable; `wait=False` yields at once (see `ready`)."""
        client = cls(addr, **kw)
        failure: Exception | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client._run)
            try:
                if wait:
                    await client.ready(client.connect_timeout)
            except (StoreUnavailable, AuthFailed) as exc:
                # Raised outside the nursery: callers see the error itself, not a group.
                failure = exc
                nursery.cancel_scope.cancel()
            else:
                try:
                    yield client
                finally:
                    client._closed = True
                    nursery.cancel_scope.cancel()
        if failure is not None:
            raise failure

    async def ready(self, timeout: float) -> None:
        """Wait until connected to the master; StoreUnavailable after `timeout`, or the
        fatal error (credentials refused)."""
        with trio.move_on_after(timeout):
            await self._settled.wait()
        if self.fatal is not None:
            raise self.fatal
        if not self._settled.is_set():
            why = f" ({self.last_failure})" if self.last_failure else ""
            raise StoreUnavailable(f"cannot reach the store at {self.addr}{why}")

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    # -- finding the master ---------------------------------------------------------------
    async def _run(self) -> None:
        pause = SEARCH_PAUSE_S[0]
        lost_at: float | None = None
        logged = trio.current_time()
        while not self._closed:
            found = await self._find_master()
            if self.fatal is not None:
                self._closed = True
                self._connected.set()  # wake waiting requests: they raise `fatal`
                self._settled.set()
                return
            if found is None:
                if trio.current_time() - logged >= SEARCH_LOG_S:
                    logged = trio.current_time()
                    log.warning("still no store master at %s (%s); trying again",
                                self.addr, self.last_failure or "no answer")
                await trio.sleep(pause)
                pause = min(pause * 2, SEARCH_PAUSE_S[1])
                continue
            pause = SEARCH_PAUSE_S[0]
            self.host, self.port = found.addr
            self.hello = found.hello
            if lost_at is not None:
                log.warning("store master now %s (epoch %d), %.1f s after the last was lost",
                            _name(found.addr), found.epoch, trio.current_time() - lost_at)
            else:
                log.info("connected to the store at %s (%s, epoch %d)", _name(found.addr),
                         found.role, found.epoch)
            try:
                await self._session(found.stream, found.decoder)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError,
                    p.ProtocolError, StoreUnavailable) as exc:
                log.warning("connection to store %s lost: %s", _name(found.addr), exc)
            finally:
                if self._connected.is_set():  # keep an unset one: requests wait on it
                    self._connected = trio.Event()
                self._send = None
                self._fail_all(AnswerLost(
                    f"connection to the store {_name(found.addr)} lost"))
                with trio.CancelScope(shield=True):
                    await found.stream.aclose()
            lost_at = logged = trio.current_time()
            self.reconnects += 1

    async def _find_master(self) -> _Answer | None:
        """One round: every node asked at once. The one that says it is master is kept
        (the latest epoch if two do); None if none did, `last_failure` saying why."""
        answers: dict[Addr, _Answer] = {}
        failures: dict[Addr, str] = {}
        refused: list[AuthFailed] = []
        done_send, done_recv = trio.open_memory_channel[None](len(self.addrs))

        async def ask(addr: Addr) -> None:
            try:
                got = await self._dial(addr, failures)
            except AuthFailed as exc:
                failures[addr] = f"refused our credentials: {exc.message}"
                refused.append(exc)
                got = None
            if got is not None:
                answers[addr] = got
            done_send.send_nowait(None)

        chosen: _Answer | None = None
        try:
            async with trio.open_nursery() as outer:
                async with trio.open_nursery() as asking:
                    outer.start_soon(self._settle, asking.cancel_scope, done_recv, answers,
                                     failures, set(self._suspect))
                    for addr in self.addrs:
                        asking.start_soon(ask, addr)
                outer.cancel_scope.cancel()
            chosen = self._choose(answers, failures)
            if chosen is None and refused and not self._settled.is_set():
                self.fatal = refused[0]  # wrong credentials at start: say so, do not wait
            return chosen
        finally:
            with trio.CancelScope(shield=True):
                for a in answers.values():
                    if a is not chosen:
                        await a.stream.aclose()

    async def _settle(self, asking: trio.CancelScope, done: trio.MemoryReceiveChannel[None],
                      answers: dict[Addr, _Answer], failures: dict[Addr, str],
                      suspects: set[Addr]) -> None:
        """End a round once a master answered (MASTER_GRACE_S later: another may answer
        with a later epoch) or every node was heard. Nodes that stopped answering lately
        get SUSPECT_GRACE_S after the others: enough to answer if they are back, not a
        whole HELLO timeout a round while the group elects another master."""
        deadline = math.inf
        while True:
            heard = answers.keys() | failures.keys()
            if len(heard) == len(self.addrs):
                break
            now = trio.current_time()
            if any(not self.group or a.role == MASTER for a in answers.values()):
                deadline = min(deadline, now + MASTER_GRACE_S)
            elif heard and heard | suspects >= set(self.addrs):
                deadline = min(deadline, now + SUSPECT_GRACE_S)
            with trio.move_on_at(deadline) as waited:
                await done.receive()
            if waited.cancelled_caught:
                break
        asking.cancel()

    def _choose(self, answers: dict[Addr, _Answer],
                failures: dict[Addr, str]) -> _Answer | None:
        masters = [a for a in answers.values() if not self.group or a.role == MASTER]
        self.answering = len(answers)
        named = sorted({str(a.hello["master"]) for a in answers.values()
                        if a.hello.get("master")})
        self.master_elsewhere = None if masters or not named else named[0]
        if masters:
            return max(masters, key=lambda a: a.epoch)
        notes = [f"{_name(a)} {failures[a]}" for a in self.addrs if a in failures]
        for a in answers.values():
            named = a.hello.get("master")
            notes.append(f"{_name(a.addr)} is a {a.role}"
                         + (f" naming master {named}" if named else ", no master elected"))
        self.last_failure = "; ".join(notes)
        return None

    async def _dial(self, addr: Addr, failures: dict[Addr, str]) -> _Answer | None:
        """Connect to `addr` and HELLO it, within HELLO_TIMEOUT_S; None (the reason in
        `failures`) if it did not answer. A node that takes the connection and then says
        nothing is suspect until it answers again. AuthFailed: it refused our
        credentials."""
        stream: trio.SocketStream | None = None
        try:
            with trio.move_on_after(HELLO_TIMEOUT_S):
                stream = await trio.open_tcp_stream(*addr)
                answer = await self._hello(addr, stream)
                self._suspect.discard(addr)
                stream = None  # the caller's now
                return answer
            failures[addr] = f"no answer within {HELLO_TIMEOUT_S:g} s"
            if self.group:
                self._suspect.add(addr)
        except (OSError, trio.BrokenResourceError, p.ProtocolError) as exc:
            failures[addr] = f"unreachable ({_reason(exc)})"
        finally:
            if stream is not None:
                with trio.CancelScope(shield=True):
                    await stream.aclose()
        return None

    async def _hello(self, addr: Addr, stream: trio.SocketStream) -> _Answer:
        """HELLO first on every connection (with credentials when given): the store
        handles it before anything else the connection sends. A store node then answers
        the connection's challenge with the group secret, in a second HELLO."""
        header: dict[str, Any] = {"sdk": "lightgate-python"}
        if self.node is not None:
            header["node"] = self.node[0]  # the challenge first: no credentials
        elif self.credentials:
            header["username"], header["password"] = self.credentials
        decoder = p.FrameDecoder()
        answer = await self._hello_once(stream, decoder, header)
        if self.node is not None:
            name, secret = self.node
            proof = p.node_proof(secret, str(answer.get("challenge", "")), name)
            answer = await self._hello_once(stream, decoder,
                                            {"node": name, "node_proof": proof})
        return _Answer(addr, stream, decoder, answer)

    async def _hello_once(self, stream: trio.SocketStream, decoder: p.FrameDecoder,
                          header: dict[str, Any]) -> dict[str, Any]:
        rid = next(self._ids)
        await stream.send_all(p.encode_frame(p.Frame(p.REQUEST, p.HELLO, rid, header)))
        while True:
            data = await stream.receive_some(65536)
            if not data:
                raise trio.BrokenResourceError("the store closed the connection")
            for frame in decoder.feed(data):
                if frame.request_id != rid:
                    continue
                if frame.kind == p.ERROR:
                    raise AuthFailed(int(frame.header.get("status", 500)),
                                     str(frame.header.get("error", "error")))
                return frame.header

    # -- one connection to the master ------------------------------------------------------
    async def _session(self, stream: trio.SocketStream, decoder: p.FrameDecoder) -> None:
        send, recv = trio.open_memory_channel[bytes](SEND_QUEUE)
        error: Exception | None = None
        self._last_heard = trio.current_time()
        self._recheck = False
        lost: list[str] = []  # why the watchdog (or `leave`) ended the session
        # On the way out, requests still waiting for room fail (and may go to the next master).
        with recv:
            async with trio.open_nursery() as nursery:

                def leave(why: str) -> None:
                    lost.append(why)
                    nursery.cancel_scope.cancel()

                nursery.start_soon(batched_writer, stream, recv, nursery.cancel_scope)
                nursery.start_soon(self._watch, nursery.cancel_scope, lost)
                self._session_no += 1
                self._leave = leave
                self._send = send
                self._connected.set()
                self._settled.set()
                try:
                    while True:
                        data = await stream.receive_some(65536)
                        if not data:
                            raise trio.BrokenResourceError("store closed the connection")
                        self._last_heard = trio.current_time()
                        for frame in decoder.feed(data):
                            self._answered(frame)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError,
                        p.ProtocolError) as exc:
                    error = exc
                finally:
                    self._leave = None
                nursery.cancel_scope.cancel()
        if lost:
            raise StoreUnavailable(lost[0])
        if error is not None:
            raise error

    def _answered(self, frame: p.Frame) -> None:
        self._due.pop(frame.request_id, None)
        fut = self._waiting.pop(frame.request_id, None)
        if fut is not None and not fut.done():
            fut.set_result(frame)
        if self.group and frame.kind == p.ERROR and frame.header.get("status") == 503:
            self._recheck = True  # "a replica", "stepped down": the watchdog asks

    async def _watch(self, scope: trio.CancelScope, lost: list[str]) -> None:
        """End the session when the node stops answering (a request overdue, and no
        HELLO answer on a new connection either) or says it is no longer master."""
        while True:
            await trio.sleep(WATCH_TICK_S)
            overdue = self._overdue()
            if overdue < PROBE_AFTER_S and not self._recheck:
                continue
            self._recheck = False
            why = await self._probe(overdue)
            if why is not None:
                lost.append(why)
                scope.cancel()
                return

    def _overdue(self) -> float:
        """How long the oldest unanswered request is past due, counted from the last
        bytes the connection brought (0: nothing is overdue)."""
        due = [t for rid, t in self._due.items()
               if (f := self._waiting.get(rid)) is not None and not f.done()]
        if not due:
            return 0.0
        return max(0.0, trio.current_time() - max(min(due), self._last_heard))

    async def _probe(self, overdue: float) -> str | None:
        """Ask the node on a new connection; why to leave it, or None to stay."""
        addr = (self.host, self.port)
        failures: dict[Addr, str] = {}
        try:
            answer = await self._dial(addr, failures)
        except AuthFailed:  # it answers, if not to these credentials now: alive
            self._last_heard = trio.current_time()
            return None
        if answer is None:
            return (f"a request {overdue:.1f} s overdue, then a HELLO on a new connection: "
                    f"{failures[addr]}")
        with trio.CancelScope(shield=True):
            await answer.stream.aclose()
        self._last_heard = trio.current_time()  # it answers: alive
        if self.group and answer.role != MASTER:
            return f"it is no longer master (now {answer.role})"
        return None

    def _fail_all(self, exc: Exception) -> None:
        waiting, self._waiting = self._waiting, {}
        self._due.clear()
        for fut in waiting.values():
            if not fut.done():
                fut.set_exception(exc)

    def submit(self, code: int, header: dict[str, Any], body: bytes = b"") -> Future:
        """Send now (from the trio thread), without waiting; the future gets the reply,
        or StoreUnavailable when not connected or SEND_QUEUE frames wait already."""
        fut: Future = Future()
        if self._send is None:
            fut.set_exception(StoreUnavailable(
                f"not connected to the store {self.addr} (looking for its master)"))
            return fut
        rid, frame = self._expect(code, header, body, fut)
        try:
            self._send.send_nowait(frame)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            self._forget(rid)
            fut.set_exception(StoreUnavailable(
                f"the connection to the store {self.addr} is not taking requests "
                f"({SEND_QUEUE} wait to be written)"))
        return fut

    async def _send_waiting(self, code: int, header: dict[str, Any], body: bytes,
                            fut: Future) -> None:
        """Send, waiting while SEND_QUEUE frames are ahead (the writer is behind)."""
        send = self._send
        assert send is not None
        rid, frame = self._expect(code, header, body, fut)
        try:
            await send.send(frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError):  # the session ended
            self._forget(rid)
            raise StoreUnavailable(f"connection to the store {self.addr} lost") from None
        except BaseException:  # cancelled while waiting: never sent, no answer to expect
            self._forget(rid)
            raise

    def _expect(self, code: int, header: dict[str, Any], body: bytes, fut: Future
                ) -> tuple[int, bytes]:
        """A new request id whose answer goes to `fut`, and the request's frame."""
        rid = next(self._ids)
        self._waiting[rid] = fut
        self._due[rid] = trio.current_time() + int(header.get("wait_ms") or 0) / 1000
        return rid, p.encode_frame(p.Frame(p.REQUEST, code, rid, header, body))

    def _forget(self, rid: int) -> None:
        self._waiting.pop(rid, None)
        self._due.pop(rid, None)

    async def request(
        self, code: int, header: dict[str, Any], body: bytes = b"",
        timeout: float = DEFAULT_TIMEOUT, *, leave_if_silent: bool = False,
    ) -> tuple[dict[str, Any], bytes]:
        """One request; `timeout` bounds all of it, waiting for the master included, and
        StoreUnavailable says it ran out: AnswerLost when the request had gone out (the
        store may have carried it out). A RETRY_SAFE request whose connection was lost
        goes to the next master. `leave_if_silent`: a request sent and unanswered within
        `timeout` ends its connection (when it is still the current one), so that what
        is sent next goes on a new one: a connection can stay open and carry nothing
        back (a NAT or firewall that lost the flow) while the node answers others."""
        attempts = MAX_ATTEMPTS if code in RETRY_SAFE else 1
        sent_on: list[int] = []  # the session each attempt went out on
        try:
            with trio.fail_after(timeout):
                for attempt in range(1, attempts + 1):
                    try:
                        frame = await self._once(code, header, body, sent_on)
                        break
                    except StoreUnavailable:
                        if attempt == attempts:
                            raise
        except trio.TooSlowError:
            why = f"no answer from the store {self.addr} within {timeout:g} s"
            if not sent_on:
                raise StoreUnavailable(why) from None
            if leave_if_silent and sent_on[-1] == self._session_no and self._leave:
                self._leave(f"a request went unanswered for {timeout:g} s")
            raise AnswerLost(why) from None
        _raise_for(frame)
        return frame.header, frame.body

    async def _once(self, code: int, header: dict[str, Any], body: bytes,
                    sent_on: list[int]) -> p.Frame:
        while self._send is None or not self._connected.is_set():
            if self.fatal is not None:
                raise self.fatal
            await self._connected.wait()
        if self.fatal is not None:
            raise self.fatal
        fut: Future = Future()
        session = self._session_no
        await self._send_waiting(code, header, body, fut)
        sent_on.append(session)  # (a cancelled send sent nothing)
        try:
            frame: p.Frame = await await_future(fut)
        except trio.Cancelled:
            fut.cancel()
            raise
        return frame


def _stored(msgs: list[Message], results: list[dict[str, Any]]) -> list[Message]:
    for m, r in zip(msgs, results, strict=True):
        m.phys_offset, m.store_ts, m.size = r["phys"], r["store_ts"], r["rsize"]
        m.queues = [(q, o) for q, o in r["queues"]]
    return msgs


class RemoteStore:
    """The store interface the gateway uses, over the native protocol."""

    def __init__(self, client: NativeClient) -> None:
        self.client = client

    def publish_start(self, messages: list[Message], *, validated: bool = False) -> Future:
        """As EmbeddedStore.publish_start; the store validates topic names again."""
        metas, body = p.pack_messages(messages)
        inner = self.client.submit(p.PUBLISH, {"messages": metas}, body)
        outer: Future = Future()

        def done(f: Future) -> None:
            try:
                frame = f.result()
                _raise_for(frame)
                outer.set_result(_stored(messages, frame.header["results"]))
            except p.RemoteError as exc:
                outer.set_exception(StoreError(exc.message))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                outer.set_exception(exc)

        inner.add_done_callback(done)
        return outer

    async def publish(self, messages: list[Message]) -> list[Message]:
        metas, body = p.pack_messages(messages)
        header, _ = await self.client.request(p.PUBLISH, {"messages": metas}, body)
        return _stored(messages, header["results"])

    async def pull(self, queue: str, offset: int, max_count: int = 32,
                   wait_ms: int = 0) -> PullResult:
        header, body = await self.client.request(
            p.PULL, {"queue": queue, "offset": offset, "max": max_count, "wait_ms": wait_ms},
            timeout=DEFAULT_TIMEOUT + wait_ms / 1000)
        return PullResult(p.unpack_messages(header["messages"], body), header["next_offset"],
                          header["min_offset"], header["max_offset"])

    async def queue_end(self, queue: str) -> int:
        header, _ = await self.client.request(p.QUEUE_RANGE, {"queue": queue})
        return int(header["max_offset"])

    async def queue_ends(self, queues: Sequence[str]) -> dict[str, int]:
        header, _ = await self.client.request(p.QUEUE_ENDS, {"queues": list(queues)})
        return {q: int(v) for q, v in header["ends"].items()}

    async def queue_tail_start(self, queue: str, start: int, max_bytes: int) -> int:
        header, _ = await self.client.request(
            p.QUEUE_TAIL, {"queue": queue, "start": start, "max_bytes": max_bytes})
        return int(header["start"])

    async def seek_time(self, queue: str, ms: int) -> QueueSeek:
        header, _ = await self._asked(p.QUEUE_SEEK, {"queue": queue, "time": int(ms)})
        return QueueSeek(int(header["offset"]), int(header["min_offset"]),
                         int(header["max_offset"]), bool(header["cut"]))

    async def history(self, topic_filter: str, since: object = "earliest", *,
                      until: str | int | None = None, cursor: str | None = None,
                      max_count: int = 1024, max_bytes: int = 4 << 20) -> HistoryBatch:
        """EmbeddedStore.history over the wire (the store parses `since`, on its clock)."""
        header: dict[str, Any] = {"filter": topic_filter, "max": max_count,
                                  "max_bytes": max_bytes}
        if cursor is not None:
            header["cursor"] = cursor
        else:
            header["since"] = str(since)  # a Since prints as the text that parses back
            if until is not None:
                header["until"] = until
        answer, body = await self._asked(p.HISTORY, header)
        return HistoryBatch(p.unpack_messages(answer["messages"], body),
                            {str(t): int(o) for t, o in answer["ends"].items()},
                            answer["cursor"], bool(answer["cut"]), int(answer["end"]))

    async def _asked(self, code: int, header: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        """A request whose bad input raises ValueError, as the embedded store's does."""
        try:
            return await self.client.request(code, header)
        except p.RemoteError as exc:
            if exc.status == 400:
                raise ValueError(exc.message) from None
            raise

    async def add_wildcard(self, topic_filter: str) -> None:
        await self.client.request(p.WILDCARD_ADD, {"filter": topic_filter})

    async def add_wildcards(self, filters: Sequence[str]) -> None:
        await self.client.request(p.WILDCARD_ADD, {"filters": list(filters)})

    async def meta_get(self, cf: str, key: str) -> Any:
        header, _ = await self.client.request(p.META_GET, {"cf": cf, "key": key})
        return header.get("value")

    async def meta_put(self, cf: str, key: str, value: Any) -> None:
        await self.client.request(p.META_PUT, {"cf": cf, "key": key, "value": value})

    async def meta_delete(self, cf: str, key: str) -> None:
        await self.client.request(p.META_DELETE, {"cf": cf, "key": key})

    async def meta_items(self, cf: str, prefix: str = "",
                         limit: int | None = None) -> list[tuple[str, Any]]:
        header, _ = await self.client.request(
            p.META_ITEMS, {"cf": cf, "prefix": prefix, "limit": limit})
        return [(k, v) for k, v in header["items"]]

    async def meta_write(self, ops: Sequence[tuple[str, str, str, Any]]) -> None:
        await self.client.request(p.META_WRITE, {"ops": [list(op) for op in ops]})

    async def get_stats(self) -> dict[str, Any]:
        header, _ = await self.client.request(p.STATS, {})
        return header

    async def cluster(self) -> dict[str, Any]:
        """The store group's view, as the node this client talks to (the master) sees it:
        store.replication.ops.cluster_view."""
        header, _ = await self.client.request(p.CLUSTER, {})
        return header

    async def last_key_offset(self, key: str) -> int | None:
        header, _ = await self.client.request(p.FIND_KEY, {"key": key, "last": True})
        return header.get("phys")

    async def get_message(self, msg_id: str) -> Message:
        try:
            header, body = await self.client.request(p.GET_MESSAGE, {"msg_id": msg_id})
        except p.RemoteError as exc:
            raise KeyError(exc.message) from exc
        return p.unpack_messages(header["messages"], body)[0]

    async def gateway_heartbeat(self, gateway_id: str, info: dict[str, Any]) -> dict[str, Any]:
        header, _ = await self.client.request(p.GATEWAY_HEARTBEAT,
                                              {"id": gateway_id, "info": info})
        return header["gateways"]

    async def shared_lease(self, gateway_id: str, held: dict[str, bool]
                           ) -> dict[str, str | None]:
        """Each shared group's holder (store.leases), asked for all of `held` at once."""
        header, _ = await self.client.request(p.SHARED_LEASE,
                                              {"member": gateway_id, "held": held})
        return header["holders"]

    async def shared_leave(self, gateway_id: str, names: list[str]) -> dict[str, int]:
        """This gateway reads these shared groups no more: how many others still do."""
        header, _ = await self.client.request(p.SHARED_LEASE,
                                              {"member": gateway_id, "leave": names})
        return header["left"]
