"""Native-protocol client (trio): one connection to a store, reconnecting with backoff,
requests multiplexed by id. `RemoteStore` gives the gateway the same async interface as
the in-process store, so one gateway code runs embedded or separated."""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from contextlib import asynccontextmanager
from typing import Any

import trio

from serving.startup import split_hostport
from store import protocol as p
from store.common import PullResult, StoreError, StoreFullError, StoreUnavailable, await_future
from store.record import Message
from store.streams import batched_writer

log = logging.getLogger("lightgate.client")

DEFAULT_TIMEOUT = 10.0


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


class NativeClient:
    """`async with NativeClient.open("host:port") as c: header, body = await c.request(...)`

    A store group's addresses, comma-separated ("a:1,b:2,c:3"): the client stays with the
    node whose HELLO says it is master, and looks again (the named master first) when
    its connection ends, so it follows the master through a failover."""

    def __init__(self, addr: str, *, credentials: tuple[str, str] | None = None,
                 connect_timeout: float = 5.0) -> None:
        self.addr = addr
        self.credentials = credentials
        self.hello: dict[str, Any] = {}  # the store's answer: version, auth, user, node
        self.fatal: Exception | None = None
        self._settled = trio.Event()  # first connection made, or failed for good
        self.addrs = [split_hostport(a.strip(), "127.0.0.1") for a in addr.split(",")
                      if a.strip()] or [split_hostport(addr, "127.0.0.1")]
        self.host, self.port = self.addrs[0]
        self._turn = 0  # which of addrs to dial next
        self.not_master: str | None = None  # the last node said it is not the master
        self.connect_timeout = connect_timeout
        self._ids = itertools.count(1)
        self._waiting: dict[int, Future] = {}
        self._send: trio.MemorySendChannel[bytes] | None = None
        self._connected = trio.Event()
        self._closed = False
        self.reconnects = 0

    @classmethod
    @asynccontextmanager
    async def open(cls, addr: str, **kw: Any) -> AsyncIterator[NativeClient]:
        client = cls(addr, **kw)
        failure: Exception | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client._run)
            with trio.move_on_after(client.connect_timeout):
                await client._settled.wait()
            if client.fatal is not None or not client._settled.is_set():
                # Raised outside the nursery: callers see the error itself, not a group.
                failure = client.fatal or StoreUnavailable(f"cannot reach the store at {addr}")
                nursery.cancel_scope.cancel()
            else:
                try:
                    yield client
                finally:
                    client._closed = True
                    nursery.cancel_scope.cancel()
        if failure is not None:
            raise failure

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    async def _run(self) -> None:
        delay = 0.05
        while not self._closed:
            self.host, self.port = self.addrs[self._turn % len(self.addrs)]
            try:
                stream = await trio.open_tcp_stream(self.host, self.port)
            except OSError as exc:
                log.debug("store %s:%s unreachable: %s", self.host, self.port, exc)
                self._turn += 1
                if self._turn % len(self.addrs) == 0:  # each node tried: back off
                    await trio.sleep(delay)
                    delay = min(delay * 2, 2.0)
                continue
            delay = 0.05
            self.not_master = None
            try:
                await self._session(stream)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError,
                    p.ProtocolError) as exc:
                log.warning("connection to store %s lost: %s", self.addr, exc)
            except AuthFailed as exc:
                log.error("the store at %s refused our credentials: %s", self.addr, exc)
                self.fatal = exc
                self._closed = True
            finally:
                if self._connected.is_set():  # keep an unset one: requests wait on it
                    self._connected = trio.Event()
                self._send = None
                self._fail_all(self.fatal or StoreUnavailable(
                    f"connection to the store {self.addr} lost"))
                with trio.CancelScope(shield=True):
                    await stream.aclose()
                if self.fatal is not None:
                    self._connected.set()  # wake waiting requests: they raise `fatal`
                    self._settled.set()
            self.reconnects += 1
            if len(self.addrs) > 1:
                self._next_node()

    def _next_node(self) -> None:
        """A group: dial the master a replica named, else the next node."""
        named = self.not_master
        here = self._turn % len(self.addrs)
        if named:
            target = split_hostport(named, "127.0.0.1")
            if target in self.addrs and self.addrs.index(target) != here:
                self._turn = self.addrs.index(target)
                return
        self._turn += 1

    async def _session(self, stream: trio.SocketStream) -> None:
        send, recv = trio.open_memory_channel[bytes](math.inf)
        error: Exception | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(batched_writer, stream, recv, nursery.cancel_scope)
            self._send = send
            nursery.start_soon(self._greet, nursery.cancel_scope)
            decoder = p.FrameDecoder()
            try:
                while True:
                    data = await stream.receive_some(65536)
                    if not data:
                        raise trio.BrokenResourceError("store closed the connection")
                    for frame in decoder.feed(data):
                        fut = self._waiting.pop(frame.request_id, None)
                        if fut is not None and not fut.done():
                            fut.set_result(frame)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError,
                    p.ProtocolError) as exc:
                error = exc
            nursery.cancel_scope.cancel()
        if self.fatal is not None:
            raise self.fatal
        if error is not None:
            raise error

    async def _greet(self, scope: trio.CancelScope) -> None:
        """HELLO first on every connection (with credentials when given): the store
        handles it before anything else this connection sends."""
        header: dict[str, Any] = {"sdk": "lightgate-python"}
        if self.credentials:
            header["username"], header["password"] = self.credentials
        frame: p.Frame = await await_future(self.submit(p.HELLO, header))
        if frame.kind == p.ERROR:
            status = int(frame.header.get("status", 500))
            self.fatal = AuthFailed(status, str(frame.header.get("error", "error")))
            scope.cancel()
            return
        self.hello = frame.header
        if len(self.addrs) > 1 and frame.header.get("role", "master") != "master":
            # A replica (or a master that stepped down): look for the master.
            self.not_master = str(frame.header.get("master") or "")
            log.info("store %s:%s is a %s; looking for the master", self.host, self.port,
                     frame.header.get("role"))
            await trio.sleep(0.1)
            scope.cancel()
            return
        self._connected.set()
        self._settled.set()

    def _fail_all(self, exc: Exception) -> None:
        waiting, self._waiting = self._waiting, {}
        for fut in waiting.values():
            if not fut.done():
                fut.set_exception(exc)

    def submit(self, code: int, header: dict[str, Any], body: bytes = b"") -> Future:
        """Send now (from the trio thread), without waiting; the future gets the reply."""
        fut: Future = Future()
        if self._send is None:
            fut.set_exception(StoreUnavailable(f"not connected to the store {self.addr}"))
            return fut
        rid = next(self._ids)
        self._waiting[rid] = fut
        self._send.send_nowait(p.encode_frame(p.Frame(p.REQUEST, code, rid, header, body)))
        return fut

    async def request(
        self, code: int, header: dict[str, Any], body: bytes = b"",
        timeout: float = DEFAULT_TIMEOUT,
    ) -> tuple[dict[str, Any], bytes]:
        """One request; `timeout` bounds all of it, waiting for a reconnect included."""
        with trio.fail_after(timeout):
            while self._send is None or not self._connected.is_set():
                if self.fatal is not None:
                    raise self.fatal
                await self._connected.wait()
            if self.fatal is not None:
                raise self.fatal
            fut = self.submit(code, header, body)
            try:
                frame: p.Frame = await await_future(fut)
            except trio.Cancelled:
                fut.cancel()
                raise
        _raise_for(frame)
        return frame.header, frame.body


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
