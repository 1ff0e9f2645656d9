"""The store's native-protocol server: what gateways and server applications call.

Each connection has a reader (this task), a writer and bounded request concurrency.
Appends (SEND, PUBLISH) are submitted to the CommitLog in frame order by the reader
itself, so one connection's messages are stored in the order they were sent; their
responses follow, in that order, from the store's acknowledgement itself.
"""

from __future__ import annotations

import hmac
import logging
import math
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import trio

from lightqueue.routing import validate_first_level
from serving.accepting import budgeted
from serving.read_budget import read_fd
from serving.startup import NATIVE_LISTENER, listening
from serving.values import split_hostport
from store import protocol as p
from store.auth import AuthError, AuthManager, Policy, Subject, audit
from store.auth.manager import DecisionCache
from store.carried import Carrier
from store.common import PullResult, RawPull, StoreError, StoreFullError
from store.groups import MAX_ATTEMPTS, GroupRegistry, offset_key
from store.history import MAX_BYTES as HISTORY_MAX_BYTES
from store.leases import Leases
from store.native_acl import NODE, STORE_NODE, SUPER, Need, message_need, needs
from store.outbox import Outbox
from store.producers import PUBLISHES, Stamp
from store.record import PRODUCER_PROP, Message, peek_topic
from store.redelivery import Redelivery
from store.service import RAW_PULL_BYTES, EmbeddedStore
from store.streams import batched_writer
from store.validate import validate_message

log = logging.getLogger("lightgate.store.native")

MAX_INFLIGHT_REQUESTS = 64
MAX_PULL_WAIT_MS = 30_000
# What a request that reads messages reserves of its connection's answer budget before
# reading (store.outbox), and so the most its answer holds (one message at least).
PULL_MAX_BYTES = 4 << 20  # unless the PULL asks for another `max_bytes`
PULL_MAX_BYTES_LIMIT = HISTORY_MAX_BYTES
LOOKUP_BYTES = 1 << 20  # GET_MESSAGE, FIND_KEY: what most messages fit in
FIND_MAX = 1000  # messages FIND_KEY returns at most
# With --auth, until a HELLO has authenticated: frames are small (a HELLO is tiny) and the
# connection must authenticate in time, so unauthenticated peers cannot hold memory.
PRE_AUTH_MAX_FRAME = 64 * 1024
HELLO_TIMEOUT_S = 10.0


class BadRequest(Exception):
    status = 400


class Unauthenticated(BadRequest):
    status = 401


class Forbidden(BadRequest):
    status = 403


class ConnCtx:
    """One native connection: who it is (after HELLO), its decision cache and its
    answers on their way out (store.outbox)."""

    def __init__(self, peer_ip: str, outbox: Outbox) -> None:
        self.ip = peer_ip
        self.outbox = outbox
        self.subject: Subject | None = None
        self.cache = DecisionCache()
        self.challenge = ""  # a store node answers it with the group secret (HELLO)
        self.store_node: str | None = None  # a store node of the group, once proven


class NotFound(BadRequest):
    status = 404


class QueueWaiters:
    """Long-polling pulls wait here for their queue to grow. An entry lives while someone
    waits: queue names come from clients, so a table that only a queue's growth empties
    would grow with every name ever polled."""

    def __init__(self) -> None:
        self._events: dict[str, tuple[trio.Event, int]] = {}  # queue -> (event, waiters)
        self.on_wait: Callable[[], None] | None = None  # a pull starts waiting

    @contextmanager
    def waiting(self, queue: str) -> Iterator[trio.Event]:
        if self.on_wait is not None:
            self.on_wait()
        ev, n = self._events.get(queue, (None, 0))
        if ev is None:
            ev = trio.Event()
        self._events[queue] = (ev, n + 1)
        try:
            yield ev
        finally:
            cur = self._events.get(queue)
            if cur is not None and cur[0] is ev:
                if cur[1] <= 1:
                    del self._events[queue]
                else:
                    self._events[queue] = (ev, cur[1] - 1)

    def any_waiting(self, names: set[str]) -> bool:
        """Whether a pull waits on one of these queues (from any thread: the writer asks
        before it wakes the event loop; a pull that starts waiting after this looks at
        its queue again once registered, so it misses nothing)."""
        return not self._events.keys().isdisjoint(names)  # the fewer looked at, no call each

    def any(self) -> bool:
        """Whether any pull waits (from any thread, as `any_waiting`)."""
        return bool(self._events)

    def wake(self, names: set[str]) -> None:
        for name in names:
            entry = self._events.pop(name, None)
            if entry is not None:
                entry[0].set()

    def __len__(self) -> int:
        return len(self._events)


class NativeServer:
    def __init__(self, store: EmbeddedStore, auth: AuthManager | None = None) -> None:
        self.store = store
        self.auth = auth or AuthManager(store)  # disabled unless configured
        self.groups = GroupRegistry()
        self.leases = Leases()  # shared subscription groups' gateways (store.leases)
        self.redelivery = Redelivery(store, store.config.max_retry_messages)
        self.waiters = QueueWaiters()
        self.gateways: dict[str, dict[str, Any]] = {}
        self.connections = 0
        # A store group's node: which requests it refuses now (a replica refuses writes)
        # and what its HELLO says of its role, so clients find the master.
        self.write_refusal: Callable[[int], StoreError | None] | None = None
        self.hello_extra: Callable[[], dict[str, Any]] | None = None
        # The group secret: a store node proves it holds it to fetch the log (REPL_FETCH).
        self.node_secret: bytes | None = None
        # Sync replication: readers see a message only once the group acknowledged it (its
        # queue offset is then never given to another message after a failover).
        self.read_limit: Callable[[], int | None] | None = None
        self._scopes: set[trio.CancelScope] = set()
        # The native server that carries authenticated connections (store.carried), set
        # by `carry` before `serve`: a store with no group, whose engine writes the log.
        self.carrier: Carrier | None = None
        self._handlers: dict[int, Callable[[p.Frame], Awaitable[tuple[dict, bytes]]]] = {
            p.PULL: self._pull,
            p.QUEUE_RANGE: self._queue_range,
            p.QUEUE_ENDS: self._queue_ends,
            p.QUEUE_TAIL: self._queue_tail,
            p.HISTORY: self._history,
            p.QUEUE_SEEK: self._queue_seek,
            p.HEARTBEAT: self._heartbeat,
            p.COMMIT: self._commit,
            p.FETCH_OFFSETS: self._fetch_offsets,
            p.NACK: self._nack,
            p.GET_MESSAGE: self._get_message,
            p.FIND_KEY: self._find_key,
            p.PRODUCER_INIT: self._producer_init,
            p.TOPIC_CREATE: self._topic_create,
            p.TOPIC_LIST: self._topic_list,
            p.TOPIC_DESCRIBE: self._topic_describe,
            p.META_GET: self._meta_get,
            p.META_PUT: self._meta_put,
            p.META_DELETE: self._meta_delete,
            p.META_ITEMS: self._meta_items,
            p.META_WRITE: self._meta_write,
            p.WILDCARD_ADD: self._wildcard_add,
            p.STATS: self._stats,
            p.CLUSTER: self._cluster,
            p.GATEWAY_HEARTBEAT: self._gateway_heartbeat,
            p.GATEWAY_LIST: self._gateway_list,
            p.SHARED_LEASE: self._shared_lease,
            p.USER_ADD: self._user_add,
            p.USER_UPDATE: self._user_update,
            p.USER_DELETE: self._user_delete,
            p.USER_LIST: self._user_list,
            p.ACL_ADD: self._acl_add,
            p.ACL_DELETE: self._acl_delete,
            p.ACL_LIST: self._acl_list,
        }

    def register(self, code: int, handler: Callable[[p.Frame, ConnCtx],
                                                   Awaitable[tuple[dict, bytes]]]) -> None:
        """Serve another request code (store.replication's REPL_FETCH)."""
        self._handlers[code] = handler

    def wrap(self, code: int, wrapper: Callable[[Callable[[p.Frame, ConnCtx], Awaitable[
            tuple[dict, bytes]]]], Callable[[p.Frame, ConnCtx], Awaitable[tuple[dict, bytes]]]]
             ) -> None:
        """Wrap the handler of `code` (store.replication: metadata writes answer once
        replicated)."""
        self._handlers[code] = wrapper(self._handlers[code])

    def drop_clients(self) -> None:
        """Close every connection (a master stepping down: clients look for the new one)."""
        for scope in list(self._scopes):
            scope.cancel()
        if self.carrier is not None:
            self.carrier.close_all()

    def carry(self, native: Any) -> None:
        """Hand authenticated connections to this native server
        (serving.lightgate_native.StoreServer) from `serve` on."""
        self.carrier = Carrier(self, native)

    async def serve(
        self, addr: str, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
    ) -> None:
        with listening(*NATIVE_LISTENER, addr):
            host, port = split_hostport(addr, "127.0.0.1")
            listeners = await trio.open_tcp_listeners(port, host=host)
        bound = listeners[0].socket.getsockname()
        async with trio.open_nursery() as nursery:
            if self.carrier is not None:
                await nursery.start(self.carrier.run)
            task_status.started(f"{bound[0]}:{bound[1]}")
            await trio.serve_listeners(self._handle, budgeted(listeners, "native protocol"))

    # -- connection -------------------------------------------------------------------
    async def _handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        channel, recv = trio.open_memory_channel[bytes](256)
        send = Outbox(channel, self.store.native_answers)  # answers within a budget
        limit = trio.Semaphore(MAX_INFLIGHT_REQUESTS)
        ctx = ConnCtx(_peer_ip(stream), send)
        must_auth = self.auth.enabled
        decoder = p.FrameDecoder(PRE_AUTH_MAX_FRAME if must_auth else p.MAX_FRAME)
        hello_by = trio.current_time() + HELLO_TIMEOUT_S
        budget, held = self.store.native_budget, 0
        scope: trio.CancelScope | None = None
        started = 0  # requests begun: a connection is handed over before any
        handover: tuple[bytes, bytes] | None = None  # (the HELLO's answer, bytes past it)
        try:
            async with trio.open_nursery() as nursery:
                scope = nursery.cancel_scope
                self._scopes.add(scope)
                nursery.start_soon(batched_writer, stream, recv, nursery.cancel_scope,
                                   send.written)
                try:
                    while True:
                        await send.wait_room()  # no new request while answers wait unread
                        if held and budget.must_wait(held) and not await budget.wait(held):
                            raise p.ProtocolError(
                                "a partial frame held while the store's read budget was "
                                "exhausted (--native-max-partial-bytes)")
                        with trio.move_on_at(hello_by if must_auth else math.inf):
                            data = await read_fd(stream.socket.fileno(), budget, held)
                        if must_auth and trio.current_time() >= hello_by:
                            raise p.ProtocolError(
                                f"not authenticated within {HELLO_TIMEOUT_S:.0f} s")
                        if not data:
                            break
                        frames = decoder.feed(data)
                        budget.update(held, decoder.buffered)
                        held = decoder.buffered
                        for i, frame in enumerate(frames):
                            if frame.kind == p.REQUEST and frame.code == p.HELLO:
                                # Inline: nothing after a HELLO runs before it decides.
                                answer = await self._hello(frame, ctx)
                                if (not started and self.carrier is not None
                                        and (ctx.subject is not None or not must_auth)
                                        and self.carrier.may_carry(ctx)):
                                    handover = (answer, b"".join(
                                        p.encode_frame(f) for f in frames[i + 1:]
                                    ) + decoder.take())
                                    break
                                await send.send(answer)
                                if must_auth and ctx.subject is not None:
                                    must_auth = False
                                    decoder.max_frame = p.MAX_FRAME
                                continue
                            started += 1
                            await limit.acquire()
                            self._start(nursery, frame, send, limit, ctx)
                        if handover is not None:
                            break
                except p.ProtocolError as exc:
                    log.warning("native client broke the protocol: %s", exc)
                    await send.send(p.encode_frame(p.Frame(
                        p.ERROR, 0, 0, {"status": 400, "error": f"protocol error: {exc}"})))
                    await trio.sleep(0.05)  # let the writer flush the error frame
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass
                except Exception:  # a bug: end this connection only, never the server
                    log.exception("native connection from %s failed", ctx.ip)
                    await send.send(p.encode_frame(p.Frame(
                        p.ERROR, 0, 0, {"status": 500, "error": "internal error"})))
                    await trio.sleep(0.05)
                nursery.cancel_scope.cancel()
        except Exception:  # a request task's bug ends this connection, never the server
            log.exception("native connection from %s failed", ctx.ip)
        finally:
            if scope is not None:
                self._scopes.discard(scope)
            budget.update(held, 0)
            send.close()
            self.connections -= 1
            if handover is not None and self.carrier is not None:
                trio.lowlevel.notify_closing(stream.socket)
                self.carrier.adopt(stream.socket.detach(), *handover, ctx)
            else:
                with trio.move_on_after(1) as scope:
                    scope.shield = True
                    await stream.aclose()

    def _start(self, nursery: trio.Nursery, frame: p.Frame, send: Any, limit: Any,
               ctx: ConnCtx) -> None:
        if frame.kind != p.REQUEST:
            limit.release()
            return
        if self.write_refusal is not None:
            why = self.write_refusal(frame.code)
            if why is not None:
                status = 507 if isinstance(why, StoreFullError) else 503
                nursery.start_soon(self._reply_error, frame, send, limit, status, str(why))
                return
        if frame.code in (p.SEND, p.PUBLISH):
            try:  # submitted now, in frame order; answered when stored
                pending = self._submit(frame, ctx)
            except (BadRequest, ValueError, p.ProtocolError) as exc:
                status = getattr(exc, "status", 400)
                nursery.start_soon(self._reply_error, frame, send, limit, status, str(exc))
                return
            self._answer_when_stored(nursery, frame, pending, send, limit)
            return
        try:
            self._check(frame, ctx)
        except BadRequest as exc:
            nursery.start_soon(self._reply_error, frame, send, limit, exc.status, str(exc))
            return
        nursery.start_soon(self._reply, frame, send, limit, ctx)

    # -- authentication and authorisation ---------------------------------------------
    async def _hello(self, f: p.Frame, ctx: ConnCtx) -> bytes:
        auth, h = self.auth, f.header
        if h.get("node_proof") is not None:
            if not self._node_proven(ctx, str(h.get("node", "")), str(h["node_proof"])):
                return _error(f, 401, "authentication failed")
        elif h.get("node") is not None:
            pass  # a store node asks for its challenge: it answers in the next HELLO
        else:
            username = h.get("username")
            if username is not None or ctx.subject is None:
                try:
                    ctx.subject = await auth.authenticate(
                        None if username is None else str(username),
                        str(h.get("password") or ""), ctx.ip, "native")
                except AuthError:
                    ctx.subject = None
                    return _error(f, 401, "authentication failed")
        if not ctx.challenge:
            ctx.challenge = os.urandom(16).hex()
        header = {"version": p.VERSION, "server": "lightgate-store", "max_frame": p.MAX_FRAME,
                  "auth": auth.enabled, "allow_anonymous": auth.allow_anonymous,
                  "user": ctx.subject.name if ctx.subject else "",
                  "node": self._is_node(ctx), "challenge": ctx.challenge}
        if self.hello_extra is not None:
            header.update(self.hello_extra())
        return p.encode_frame(p.Frame(p.RESPONSE, f.code, f.request_id, header))

    def _node_proven(self, ctx: ConnCtx, node: str, proof: str) -> bool:
        """A store node's HELLO: the HMAC of this connection's challenge under the group
        secret (see node_proof). The challenge is used once."""
        challenge, ctx.challenge = ctx.challenge, ""
        if not self.node_secret or not challenge or not node:
            audit.authentication(f"store node {node}", ctx.ip, "native", False,
                                 "no group secret or no challenge")
            return False
        if not hmac.compare_digest(p.node_proof(self.node_secret, challenge, node), proof):
            audit.authentication(f"store node {node}", ctx.ip, "native", False,
                                 "wrong group secret")
            return False
        ctx.store_node = node
        ctx.subject = Subject(f"store node {node}", ctx.ip, "native", backend="group",
                              super_user=True)
        audit.authentication(ctx.subject.name, ctx.ip, "native", True, "group secret")
        return True

    def _is_node(self, ctx: ConnCtx) -> bool:
        if ctx.store_node is not None:
            return True
        return ctx.subject is not None and self.auth.is_node(ctx.subject)

    def may_fetch(self, ctx: ConnCtx) -> bool:
        """Whether this connection may copy the log (REPL_FETCH: a store node)."""
        try:
            self._check(p.Frame(p.REQUEST, p.REPL_FETCH, 0, {}, b""), ctx)
        except Forbidden:
            return False
        return True

    def _check(self, frame: p.Frame, ctx: ConnCtx, mqtt_topics: list[str] | None = None) -> None:
        """Raise Forbidden unless this connection may make this request."""
        auth = self.auth
        required = needs(frame, mqtt_topics)
        name = p.CODE_NAMES.get(frame.code, str(frame.code))
        if required == STORE_NODE and (self.node_secret or auth.enabled):
            # The whole log and metadata: a store node of the group, proven with the
            # group secret (a Super user too, with --auth); no policy grants it.
            if ctx.store_node is None and not (ctx.subject is not None and auth.enabled
                                               and auth.is_super(ctx.subject)):
                raise Forbidden(f"{name} is for the store nodes of the group (the group "
                                "secret)")
            return
        if not auth.enabled or ctx.store_node is not None:
            return
        if ctx.subject is None:
            raise Unauthenticated("authenticate first: HELLO with username and password")
        if not auth.still_valid(ctx.subject):
            raise Forbidden(f"user {ctx.subject.name!r} is disabled or deleted")
        if required == SUPER:
            if not auth.is_super(ctx.subject):
                auth.authorize(ctx.subject, "Cluster", "", "UPDATE")  # audit the refusal
                raise Forbidden(f"{name} needs a Super user")
            return
        if required == NODE:
            if not self._is_node(ctx):
                raise Forbidden(f"{name} is for nodes: a node user (lightgate user add NAME "
                                "--node) or a Super user")
            return
        assert isinstance(required, list)
        if required and self._is_node(ctx):
            return
        for need in required:
            if not self._allowed(ctx, need):
                raise Forbidden(f"{name} denied: {'/'.join(need.actions)} on "
                                f"{need.rtype}:{need.name}")

    def _allowed(self, ctx: ConnCtx, need: Need) -> bool:
        assert ctx.subject is not None
        return any(self.auth.authorize(ctx.subject, need.rtype, need.name, action,
                                       is_filter=need.is_filter, cache=ctx.cache)
                   for action in need.actions)

    async def _reply_error(self, frame: p.Frame, send: Any, limit: Any, status: int,
                           message: str) -> None:
        try:
            await send.send(_error(frame, status, message))
        finally:
            limit.release()

    async def _reply(self, frame: p.Frame, send: Any, limit: Any, ctx: ConnCtx) -> None:
        try:
            handler = self._handlers.get(frame.code)
            if handler is None:
                out = _error(frame, 400, f"unknown request code {frame.code}")
            else:
                try:
                    header, body = await handler(frame, ctx)
                    out = p.encode_frame(p.Frame(p.RESPONSE, frame.code, frame.request_id,
                                                 header, body))
                except BadRequest as exc:
                    out = _error(frame, exc.status, str(exc))
                except (KeyError, ValueError, TypeError, p.ProtocolError) as exc:
                    out = _error(frame, 400, f"bad request: {exc}")
                except StoreFullError as exc:  # the disk, or a budget of it
                    out = _error(frame, 507, str(exc))
                except StoreError as exc:
                    out = _error(frame, 503, str(exc))
            await send.send(out)
        finally:
            limit.release()

    # -- appends ----------------------------------------------------------------------
    def _submit(self, frame: p.Frame, ctx: ConnCtx) -> Any:
        msgs = p.unpack_messages(frame.header.get("messages", []), frame.body)
        self._check(frame, ctx, [m.topic for m in msgs])
        if not msgs:
            raise BadRequest("no messages")
        topic = str(frame.header.get("topic", ""))
        for m in msgs:  # ValueError: a 400, nothing of the frame stored
            validate_message(m, mqtt=frame.code == p.PUBLISH or bool(m.topic and m.topic != topic))
        if frame.code == p.PUBLISH:  # (one sequence for all of a producer's publishes)
            return self.store.publish_start(
                msgs, producer=self._producer_stamp(frame, ctx, msgs, PUBLISHES))
        return self.store.send_start(topic, msgs, self._producer_stamp(frame, ctx, msgs))

    # -- idempotent producers ---------------------------------------------------------
    def _producer_stamp(self, frame: p.Frame, ctx: ConnCtx, msgs: list[Message],
                        sequence: str | None = None) -> Stamp | None:
        """A SEND or PUBLISH of an idempotent producer: its id (issued to this
        connection's user) and its sequence (a SEND's: its topic's; `sequence` else),
        checked inside the append (store.producers)."""
        if any(PRODUCER_PROP in m.properties for m in msgs):
            raise BadRequest(f"property {PRODUCER_PROP!r} is the store's own")
        h = frame.header
        if "producer" not in h:
            return None
        epoch, seq = h.get("epoch", 0), h.get("seq")
        if type(epoch) is not int or type(seq) is not int or epoch < 0 or seq < 0:
            raise BadRequest("an idempotent SEND or PUBLISH has a sequence `seq` (and an `epoch`), "
                             "integers from 0")
        try:
            pid = self.store.check_producer(h["producer"], self._user(ctx))
        except ValueError as exc:
            raise _refusal(exc) from None
        return Stamp(pid, str(h.get("topic", "")) if sequence is None else sequence, epoch, seq)

    def _user(self, ctx: ConnCtx) -> str:
        """Whose a producer id is: the authenticated user's ("" without --auth)."""
        return ctx.subject.name if self.auth.enabled and ctx.subject is not None else ""

    async def _producer_init(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        name = f.header.get("name")
        if name is not None and not isinstance(name, str):
            raise BadRequest("a producer name is a string")
        try:
            pid = await self.store.init_producer(self._user(ctx), name)
        except ValueError as exc:
            raise _refusal(exc) from None
        return {"producer": pid}, b""

    def _answer_when_stored(self, nursery: trio.Nursery, frame: p.Frame, fut: Any, send: Any,
                            limit: Any) -> None:
        """Answer an append once the store acknowledges it, from the acknowledgement itself
        (no task per append): appends acknowledged together (a group commit, the in-sync
        set's copy) are answered in the order they were sent, which a gateway's cache
        relies on to serve its subscribers without reading back what it just stored."""
        def answer(_: Any = None) -> None:
            try:
                out = self._append_answer(frame, fut)
            except Exception:  # a bug: this request fails, never the callback's caller
                log.exception("answering an append failed")
                out = _error(frame, 500, "internal error")
            try:
                if send.send_nowait(out):
                    limit.release()
                    return
                nursery.start_soon(self._send_answer, out, send, limit)  # room first
            except (trio.ClosedResourceError, trio.BrokenResourceError, RuntimeError):
                limit.release()  # the connection ended meanwhile: nobody to answer

        if fut.done():
            answer()
            return
        token, loop = trio.lowlevel.current_trio_token(), threading.get_ident()

        def settled(_: Any) -> None:  # (a writer thread's group commit: to the loop)
            if threading.get_ident() == loop:
                answer()
                return
            try:
                token.run_sync_soon(answer)
            except trio.RunFinishedError:
                pass

        fut.add_done_callback(settled)

    @staticmethod
    def _append_answer(frame: p.Frame, fut: Any) -> bytes:
        try:
            stored = fut.result()
        except StoreFullError as exc:
            return _error(frame, 507, str(exc))
        except StoreError as exc:
            return _error(frame, 503, str(exc))
        except ValueError as exc:  # refused by the writer (a record too large, a
            # producer's sequence: store.producers)
            return _error(frame, getattr(exc, "status", 400), str(exc))
        results = [{"msg_id": m.msg_id, "queues": m.queues, "store_ts": m.store_ts,
                    "phys": m.phys_offset, "rsize": m.size} for m in stored]
        return p.encode_frame(p.Frame(p.RESPONSE, frame.code, frame.request_id,
                                      {"results": results}))

    @staticmethod
    async def _send_answer(out: bytes, send: Any, limit: Any) -> None:
        try:
            await send.send(out)
        finally:
            limit.release()

    # -- handlers ---------------------------------------------------------------------

    async def _pull(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        """Messages of a queue from an offset: at most `max` and about `max_bytes` (one
        message at least), waiting up to `wait_ms` for the first (long polling)."""
        if f.header.get("raw"):
            return await self._pull_raw(f, ctx)
        queue = str(f.header["queue"])
        offset = int(f.header.get("offset", 0))
        max_count = int(f.header.get("max", 32))
        max_bytes = max(1, min(int(f.header.get("max_bytes", PULL_MAX_BYTES)),
                               PULL_MAX_BYTES_LIMIT))
        wait_ms = min(int(f.header.get("wait_ms", 0)), MAX_PULL_WAIT_MS)
        res = await self._pull_within(ctx, queue, offset, max_count, max_bytes)
        if not res.messages and wait_ms > 0:
            with self.waiters.waiting(queue) as ev:
                # Re-check after registering the waiter: a message may have just landed.
                res = await self._pull_within(ctx, queue, offset, max_count, max_bytes)
                if not res.messages:
                    with trio.move_on_after(wait_ms / 1000):
                        await ev.wait()
            if not res.messages:
                res = await self._pull_within(ctx, queue, offset, max_count, max_bytes)
        metas, body = p.pack_messages(self._readable(ctx, res.messages))
        return {"messages": metas, "next_offset": res.next_offset,
                "min_offset": res.min_offset, "max_offset": res.max_offset}, body

    async def _pull_within(self, ctx: ConnCtx, queue: str, offset: int, max_count: int,
                           max_bytes: int) -> PullResult:
        """One read of a PULL, with room for its answer held (store.outbox): the
        messages it returns are queued before the next wait."""
        pull = self.store.pull if self.read_limit is None else self._pull_acked
        async with ctx.outbox.reserve(max_bytes):
            return await pull(queue, offset, max_count, max_bytes)

    # -- PULL `raw`: records as the log holds them --------------------------------------
    async def _pull_raw(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        """A PULL answered with runs of records as the log holds them (see
        EmbeddedStore.pull_raw): the reader decodes them; header `runs` [log offset,
        bytes, first queue offset, records] say where each starts in the body."""
        h = f.header
        queue, offset = str(h["queue"]), int(h.get("offset", 0))
        max_count = int(h.get("max", 32))
        wait_ms = min(int(h.get("wait_ms", 0)), MAX_PULL_WAIT_MS)
        res = await self._raw(ctx, queue, offset, max_count)
        if not res.runs and wait_ms > 0:
            with self.waiters.waiting(queue) as ev:
                res = await self._raw(ctx, queue, offset, max_count)  # it may have landed
                if not res.runs:
                    with trio.move_on_after(wait_ms / 1000):
                        await ev.wait()
            if not res.runs:
                res = await self._raw(ctx, queue, offset, max_count)
        runs, data = self._raw_readable(ctx, res.runs, res.data)
        return {"raw": True, "runs": runs, "next_offset": res.next_offset,
                "min_offset": res.min_offset, "max_offset": res.max_offset}, data

    async def _raw(self, ctx: ConnCtx, queue: str, offset: int, max_count: int) -> RawPull:
        """One read of a raw PULL, with room for its answer held (store.outbox), as a
        PULL's: the answer is queued before the next wait."""
        store = self.store
        async with ctx.outbox.reserve(RAW_PULL_BYTES):
            if store.commitlog.inline:  # appends are inline: the index is current
                return store.pull_raw(queue, offset, max_count, self._limit())
            return await trio.to_thread.run_sync(store.pull_raw, queue, offset, max_count,
                                                 self._limit())

    def _raw_readable(self, ctx: ConnCtx, runs: list[list[int]], data: bytes
                      ) -> tuple[list[list[int]], bytes]:
        """The records of a raw answer this reader may see, as `_readable` decides for
        messages: the others are left out of the runs (next_offset moves past them)."""
        if not self.auth.enabled or not runs or self._is_node(ctx):
            return runs, data
        kept_runs: list[list[int]] = []
        parts: list[bytes] = []
        pos = 0
        for phys, _, first, count in runs:
            for i in range(count):
                topic, size = peek_topic(data, pos)
                if self._allowed(ctx, message_need(topic)):
                    last = kept_runs[-1] if kept_runs else None
                    if last is not None and last[0] + last[1] == phys and \
                            last[2] + last[3] == first + i:
                        last[1] += size
                        last[3] += 1
                    else:
                        kept_runs.append([phys, size, first + i, 1])
                    parts.append(data[pos:pos + size])
                phys += size
                pos += size
        return kept_runs, b"".join(parts)

    def _readable(self, ctx: ConnCtx, msgs: list[Message]) -> list[Message]:
        """The messages this reader may see, each checked as MQTT deliveries are (the
        right on the queue was checked in _check). The others are skipped, not refused:
        next_offset still moves past them."""
        if not self.auth.enabled or not msgs or self._is_node(ctx):
            return msgs
        return [m for m in msgs if self._allowed(ctx, message_need(m.topic))]

    async def _pull_acked(self, queue: str, offset: int, max_count: int,
                          max_bytes: int | None = None) -> PullResult:
        """`store.pull`, cut before the first message past the read limit."""
        res = await self.store.pull(queue, offset, max_count, max_bytes)
        limit = self._limit()
        if limit is None:
            return res
        for i, m in enumerate(res.messages):
            if m.phys_offset + m.size > limit:
                res.next_offset = next((o for q, o in m.queues if q == queue),
                                       res.next_offset)
                res.messages = res.messages[:i]
                break
        return res

    # A new subscription starts at the end these give: held at the read limit, as PULL
    # is, it never starts past messages a failover may cut (their offsets then go to
    # other messages, which the subscription would skip).
    async def _queue_range(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        lo, hi = self.store.queue_range(str(f.header["queue"]), self._limit())
        return {"min_offset": lo, "max_offset": hi}, b""

    async def _queue_ends(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        queues = [str(q) for q in f.header["queues"]]
        return {"ends": await self.store.queue_ends(queues, self._limit())}, b""

    def _limit(self) -> int | None:
        return self.read_limit() if self.read_limit is not None else None

    async def _history(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        """A batch of a filter's history (store.history). The filter's right was checked
        in _check; each message's topic is checked here, and the topics of the messages
        left out are left out of `ends` too."""
        h = f.header
        until = h.get("until")
        cursor = h.get("cursor")
        max_bytes = max(1, min(int(h.get("max_bytes", 4 << 20)), HISTORY_MAX_BYTES))
        async with ctx.outbox.reserve(max_bytes):
            batch = await self.store.history(
                str(h["filter"]), str(h.get("since", "earliest")),
                until=until if until is None or type(until) is int else str(until),
                cursor=None if cursor is None else str(cursor),
                max_count=int(h.get("max", 1024)), max_bytes=max_bytes,
                read_limit=self._limit())
            msgs = self._readable(ctx, batch.messages)
            ends = batch.ends
            if len(msgs) < len(batch.messages):
                shown = {m.topic for m in msgs}
                ends = {t: o for t, o in ends.items() if t in shown}
            metas, body = p.pack_messages(msgs)
        return {"messages": metas, "ends": ends, "cursor": batch.cursor, "cut": batch.cut,
                "end": batch.end}, body

    async def _queue_seek(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        seek = await self.store.seek_time(str(f.header["queue"]), int(f.header["time"]))
        return {"offset": seek.offset, "min_offset": seek.min_offset,
                "max_offset": seek.max_offset, "cut": seek.cut}, b""

    async def _queue_tail(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        h = f.header
        start = await self.store.queue_tail_start(str(h["queue"]), int(h["start"]),
                                                  int(h["max_bytes"]))
        return {"start": start}, b""

    async def _heartbeat(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        group, topic = str(f.header["group"]), str(f.header["topic"])
        member = str(f.header["member"])
        if f.header.get("leave"):
            self.groups.leave(group, member)
            return {"left": True}, b""
        queues = self.store.topic_queues(validate_first_level(topic))
        return self.groups.heartbeat(group, topic, member,
                                     str(f.header.get("strategy", "average")), queues), b""

    async def _commit(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        group = str(f.header["group"])
        ops = [("put", "offsets", offset_key(group, str(q)), int(off))
               for q, off in dict(f.header["offsets"]).items()]
        await self.store.meta_write(ops)
        return {"committed": len(ops)}, b""

    async def _fetch_offsets(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        group = str(f.header["group"])
        out = {}
        for q in f.header["queues"]:
            off = await self.store.meta_get("offsets", offset_key(group, str(q)))
            out[str(q)] = off
        return {"offsets": out}, b""

    async def _nack(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        """Give a message the reader received another try later, or dead-letter it
        (store.redelivery: once per delivery, within a budget). It is named by queue and
        offset and copied from the store: a reader may put back only what it could pull,
        never a body (or an attempt count) of its own."""
        h = f.header
        if "queue" not in h or "offset" not in h:
            raise BadRequest("NACK names the received message by queue and offset")
        queue, offset = str(h["queue"]), int(h["offset"])
        msg = await self._message_at(ctx, queue, offset)
        answer = await self.redelivery.nack(str(h["group"]), queue, offset, msg,
                                            int(h.get("max_attempts", MAX_ATTEMPTS)))
        return answer, b""

    async def _message_at(self, ctx: ConnCtx, queue: str, offset: int) -> Message:
        """The message at `offset` of `queue`, if this reader may pull it (the queue's
        right was checked in _check; the message's own topic here)."""
        pull = self.store.pull if self.read_limit is None else self._pull_acked
        res = await pull(queue, offset, 1)
        msg = res.messages[0] if res.messages else None
        if msg is None or msg.offset_in(queue) != offset:
            raise NotFound(f"no message at offset {offset} of {queue!r}")
        if not self._readable(ctx, [msg]):
            raise Forbidden(f"denied: SUB/GET on Topic:{msg.topic}")
        return msg

    async def _get_message(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        """A message by id (Cluster GET, checked in _check), if the reader may read its
        topic, as a PULL would decide; its topic goes unnamed (ids can be walked)."""
        msg_id = str(f.header["msg_id"])
        async with ctx.outbox.reserve(LOOKUP_BYTES):
            try:
                msg = await self.store.get_message(msg_id)
            except (KeyError, ValueError) as exc:
                raise NotFound(f"no message {msg_id!r}: {exc}") from exc
            if not self._readable(ctx, [msg]):
                raise Forbidden(f"reading message {msg_id} needs SUB (or GET) on its topic")
            metas, body = p.pack_messages([msg])
        return {"messages": metas}, body

    async def _find_key(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        """The messages with a key, those the reader may read (as PULL decides)."""
        if f.header.get("last"):  # a gateway's QoS 2 check: the newest offset alone
            return {"messages": [], "phys": await self.store.last_key_offset(
                str(f.header["key"]))}, b""
        async with ctx.outbox.reserve(LOOKUP_BYTES):
            msgs = await self.store.find_by_key(str(f.header["key"]),
                                                min(int(f.header.get("max", 100)), FIND_MAX))
            metas, body = p.pack_messages(self._readable(ctx, msgs))
        return {"messages": metas}, body

    async def _topic_create(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        topic = str(f.header["topic"])
        self.store.create_topic(topic, int(f.header.get("partitions", 4)))
        return {"topic": topic, "queues": self.store.topic_queues(topic)}, b""

    async def _topic_list(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        topics = {t: info for t, info in await self.store.meta_items("topics")
                  if self._may_list(ctx, t)}
        return {"topics": topics}, b""

    def _may_list(self, ctx: ConnCtx, topic: str) -> bool:
        if not self.auth.enabled:
            return True
        return self._is_node(ctx) or self._allowed(
            ctx, Need("Topic", topic, ("LIST", "GET", "SUB")))

    async def _topic_describe(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        topic = validate_first_level(str(f.header["topic"]))
        queues = []
        for q in self.store.topic_queues(topic):
            lo, hi = self.store.queue_range(q)
            queues.append({"queue": q, "min_offset": lo, "max_offset": hi})
        return {"topic": topic, "partitions": len(queues), "queues": queues}, b""

    async def _meta_get(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        return {"value": await self.store.meta_get(str(f.header["cf"]), str(f.header["key"]))}, b""

    async def _meta_put(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        await self.store.meta_put(str(f.header["cf"]), str(f.header["key"]), f.header["value"])
        return {}, b""

    async def _meta_delete(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        await self.store.meta_delete(str(f.header["cf"]), str(f.header["key"]))
        return {}, b""

    async def _meta_items(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        limit = f.header.get("limit")
        items = await self.store.meta_items(str(f.header["cf"]), str(f.header.get("prefix", "")),
                                            int(limit) if limit is not None else None)
        return {"items": items}, b""

    async def _meta_write(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        ops = [(str(op), str(cf), str(key), value) for op, cf, key, value in f.header["ops"]]
        await self.store.meta_write(ops)
        return {}, b""

    async def _wildcard_add(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        """One filter (`filter`) or many (`filters`: a gateway's periodic touch)."""
        filters = f.header.get("filters")
        if filters is None:
            filters = [f.header["filter"]]
        if not isinstance(filters, list) or len(filters) > 100_000:
            raise ValueError("filters must be a list (at most 100,000)")
        await self.store.add_wildcards([str(x) for x in filters])
        return {}, b""

    async def _stats(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        stats = await self.store.get_stats()
        carrier = self.carrier
        stats["native_connections"] = self.connections + (
            len(carrier.conns) if carrier is not None else 0)
        # Connections handed to the native server since the start (store.carried).
        stats["native_carried"] = carrier.carried if carrier is not None else 0
        stats["pull_waiters"] = len(self.waiters)  # queues with a long-poll waiting
        return stats, b""

    async def _cluster(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        return await self.store.cluster(), b""

    async def _gateway_heartbeat(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        """Gateways announce themselves; nobody needs a static node list."""
        gid = str(f.header["id"])
        self.gateways[gid] = {**dict(f.header.get("info", {})), "last_seen": time.time()}
        return {"gateways": self._live_gateways()}, b""

    async def _gateway_list(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        return {"gateways": self._live_gateways()}, b""

    async def _shared_lease(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        member, now = str(f.header["member"]), time.monotonic()
        if "leave" in f.header:
            return {"left": self.leases.leave(member, [str(n) for n in f.header["leave"]],
                                              now)}, b""
        held = {str(n): bool(v) for n, v in dict(f.header["held"]).items()}
        return {"holders": self.leases.ask(member, held, now)}, b""

    # -- users and policies (Super only; checked in _check) ---------------------------
    async def _user_add(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        user = await self.auth.add_user(str(f.header["name"]), str(f.header["password"]),
                                        super_user=bool(f.header.get("super")),
                                        node=bool(f.header.get("node")))
        return {"user": user.public()}, b""

    async def _user_update(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        h = f.header
        try:
            user = await self.auth.update_user(
                str(h["name"]), password=h.get("password"), enabled=h.get("enabled"),
                super_user=h.get("super"), node=h.get("node"))
        except KeyError as exc:
            raise NotFound(str(exc.args[0])) from None
        self._rights_changed()
        return {"user": user.public()}, b""

    async def _user_delete(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        try:
            await self.auth.delete_user(str(f.header["name"]))
        except KeyError as exc:
            raise NotFound(str(exc.args[0])) from None
        self._rights_changed()
        return {}, b""

    def _rights_changed(self) -> None:
        """A user changed or went: the carried connections it no longer may keep close
        now (store.carried looks again every second for changes made elsewhere)."""
        if self.carrier is not None:
            self.carrier.revalidate()

    async def _user_list(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        return {"users": [u.public() for u in self.auth.users.values()]}, b""

    async def _acl_add(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        h = f.header
        policy = Policy.create(str(h["user"]), str(h["resource"]), h["actions"],
                               match=str(h.get("match", "literal")), ip=str(h.get("ip", "")),
                               deny=bool(h.get("deny")))
        try:
            await self.auth.add_policy(policy)
        except KeyError as exc:
            raise NotFound(str(exc.args[0])) from None
        return {"policy": policy.to_dict()}, b""

    async def _acl_delete(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        h = f.header
        n = await self.auth.delete_policies(str(h["user"]), h.get("resource"), h.get("match"))
        return {"deleted": n}, b""

    async def _acl_list(self, f: p.Frame, ctx: ConnCtx) -> tuple[dict, bytes]:
        return {"policies": self.auth.list_policies(f.header.get("user"))}, b""

    def _live_gateways(self) -> dict[str, Any]:
        now = time.time()
        for gid in [g for g, info in self.gateways.items() if now - info["last_seen"] > 15]:
            del self.gateways[gid]
        return self.gateways


def _peer_ip(stream: trio.SocketStream) -> str:
    try:
        return str(stream.socket.getpeername()[0])
    except (OSError, AttributeError):
        return "?"


def _refusal(exc: ValueError) -> BadRequest:
    """A refusal of the store's (an error with a status, e.g. store.producer_ids') as the
    native answer it becomes."""
    err = BadRequest(str(exc))
    err.status = getattr(exc, "status", 400)
    return err


def _error(frame: p.Frame, status: int, message: str) -> bytes:
    return p.encode_error(frame.code, frame.request_id, status, message)

