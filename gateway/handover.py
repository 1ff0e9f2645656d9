"""One connection, two owners in turn: the gateway's side of the native plane
(docs/native-plane.md). After its CONNACK a plain-TCP connection that the native side
can carry is *promoted*: it leaves the reactor's epoll set and its socket, negotiated
settings, ACL cache and subscriptions (each at its queue's position) go to the engine,
which reads, answers and delivers from then on. When a packet needs a rule the native
side does not have, or the connection ends, or its client falls behind, or the gateway
needs it back (a takeover, a kick, changed rights, a shutdown: `release`), the engine
*demotes* it: this module restores the connection's MQTT state from the snapshot,
writes what the socket had not taken, hands the packet that needed Python to the
Python core, and lets Python's delivery go on from each queue's position. Once it is
quiet again it is promoted again.

TLS and WebSocket connections on the native plane are the engine's from the accept
(gateway.native_link): promoting one switches its link in the engine to the carried steady
state, and demoting it switches it back to relaying bytes to Python; its session, its
WebSocket framing and its socket never move.

Promoted: clean sessions (3.1.1 clean session, v5 session expiry 0) on plain TCP, TLS,
WebSocket or secure WebSocket (the native listeners'), with plain subscriptions (no
shared, no `$replay`, no `$` filter, no v5 No Local, Retain As Published or subscription
identifiers), no HTTP hook or per-delivery ACL check, no publish rate limit, no
credentials' end, and nothing under way in Python (on a gateway node too: its engine
pulls what it did not publish, gateway.remote_plane); and persistent sessions where the
store is this process's, wherever their queues' positions are (gateway.native_sessions).
Everything else stays in Python (the Python plane's own TLS and WebSocket streams, ...)."""

from __future__ import annotations

import itertools
import logging
import os
from typing import Any, Protocol

import trio

from gateway.inbound import NOT_STORED, not_stored
from gateway.mqtt import protocol as mp
from gateway.mqtt import reason as rc
from gateway.mqtt.protocol import Closing
from gateway.native_link import NativeLinks, NativeStream
from gateway.native_sessions import Deferred, Records, carried, from_positions, settled
from gateway.remote_plane import RemoteNews
from serving.read_budget import ReadBudget
from store.api import StoreFullError

# A client connection (gateway.connection.Connection, which imports this room: named,
# not imported). What is read of it here is its state, not a face of its own.
Connection = Any


class Pipeline(Protocol):
    def idle(self, conn: Connection) -> bool: ...


class Broker(Protocol):
    """The broker, as the handover sees it (gateway.broker.Broker)."""

    inbound: Pipeline
    read_budget: ReadBudget
    config: Any  # gateway.config.GatewayConfig (offsets_flush_interval)

log = logging.getLogger("lightgate.gateway.handover")

MAX_TOPICS = 1024  # topics a connection may publish to natively (its ACL cache), at most
FIRST_LOOK = 0.01  # seconds before a candidate that was busy is looked at again ...
LAST_LOOK = 1.0  # ... doubling up to this
# A candidate busy only with what it publishes (a client that publishes without a
# pause is never quiet) is not read for up to this long, so that what is under way
# settles and it can go over; at most this many times while it is a candidate, each try
# twice as long after the one before and held twice as long, up to QUIESCE_MAX_S.
QUIESCE_S = 0.05
QUIESCE_MAX_S = 0.8
QUIESCE_TRIES = 8
# What a look finds: never (the connection is not the kind), parked (not while its
# subscriptions or rights are what they are: looked at again when they change), busy
# (something is under way: looked at again soon), ready.
NEVER, PARKED, BUSY, READY = range(4)
# Entries of each queue read for a round of a subscriber that fell behind (the engine
# delivers at most 256 messages a round: native/src/backlog.rs); of a persistent
# session's, whose rounds are larger (native/src/reactor/keep.rs ROUND_MESSAGES).
ROUND_ENTRIES = 256
KEPT_ROUND_ENTRIES = 1024


def _linked(conn: Connection) -> NativeStream | None:
    """The native link of a connection the engine accepted (TLS, WebSocket), if it is."""
    stream = conn.stream
    return stream if type(stream) is NativeStream else None


def _publishes_anywhere(conn: Connection) -> bool:
    """Whether every topic within the limits is the connection's to publish to (no
    authentication, or a Super user the built-in rules decide for): the engine then
    needs no ACL cache, and no first publish on a topic comes to Python for it (a
    publisher to more topics than the cache holds came back for every one past it)."""
    auth = conn.broker.auth
    if conn._ask_hook:
        return False
    if conn.subject is None:
        return not auth.enabled
    return auth.is_super(conn.subject)


class Handover:
    def __init__(self, broker: Broker, engine: Any) -> None:
        self.broker = broker
        self.engine = engine
        self.promoted: dict[int, Connection] = {}
        self._ids = itertools.count(1)
        # The engine's reactor threads: connection `id` starts on thread `id % threads`
        # (and may move to the thread its deliveries come from).
        self._threads = max(1, getattr(engine, "io_threads", 1))
        # Connections to promote when they are quiet: conn -> (when to look, delay).
        self._candidates: dict[Connection, tuple[float, float]] = {}
        # Candidates held still (`_quiesce`): when it began, and how many times so far.
        self._quiesced: dict[Connection, tuple[float, int]] = {}
        self._then: dict[int, tuple[Closing, trio.Nursery | None]] = {}  # after release
        self._back: dict[int, trio.Event] = {}  # `reclaim`s waiting
        self._waiting: trio.CancelScope | None = None  # the task's wait, until a look
        self._ending = trio.Lock()  # one waits on the engine's descriptor at a time
        self.running = False
        # The connections the engine accepted (its TLS and WebSocket listeners), once it listens.
        self.links: NativeLinks | None = None
        # What a connection that may publish anywhere (adopted with no ACL cache) is
        # held to natively; past it, or on a `$` topic, its publish comes to Python.
        engine.set_topic_limits(broker.max_topic_length, broker.max_topic_levels)
        # A native publish the store refuses is explained in the words Python uses.
        engine.set_not_stored(not_stored(StoreFullError()), NOT_STORED)
        # A gateway node's engine (`lightgate gateway`) sends its publishes to the store
        # and carries clean sessions' subscribers (a persistent session's records are
        # the store's: NEVER above), pulling what it did not publish (remote_plane).
        remote = getattr(engine, "remote", False)
        self.news = RemoteNews(broker, engine) if remote else None  # type: ignore[arg-type]
        # A subscriber past its budget stays native, served from the store a round at a
        # time (`_behind`), where the store is this process's (an embedded one).
        self._queue_runs = getattr(broker.store, "queue_runs", None)
        self._nursery: trio.Nursery | None = None
        if self._queue_runs is not None and hasattr(engine, "set_catch_up"):
            engine.set_catch_up(True)
        # A persistent session is carried where its sends' records can be written as
        # the engine reports them, in order (an embedded store's metadata), and its
        # backlog served from the store.
        meta_now = getattr(broker.store, "meta_write_now", None)
        self.records = Records(engine, meta_now if self._queue_runs is not None
                               and hasattr(engine, "kept") else None)
        self._deferred = Deferred(self.consider)  # persistent sessions' deliveries

    # -- which connections ---------------------------------------------------------------
    def consider(self, conn: Connection) -> None:
        """Promote `conn` once it is quiet (looked at from the handover task)."""
        if conn.native is None and conn.alive and (conn.reactor is not None or _linked(conn)):
            now = trio.current_time()
            self._candidates[conn] = (now, FIRST_LOOK)
            if self._waiting is not None:
                self._waiting.deadline = now

    def _verdict(self, conn: Connection) -> int:
        s, core = conn.session, conn.core
        if not conn.alive or s is None or conn.delivery is None or conn.native is not None:
            return NEVER
        linked = _linked(conn) is not None
        if (conn.stream is not None or conn.reactor is None) and not linked \
                or s.persistent and not (self.records.enabled and carried(conn)) \
                or conn._limits is not None or conn._taken_over or core.version < 3 \
                or core.alias_out_max:
            # Python's TLS or WebSocket, a persistent session it keeps (`carried`), a
            # publish rate limit, a client that takes topic aliases (the native side
            # sends none: Python keeps it to use them)
            return NEVER
        if conn.asks_hook or conn.checks_delivery and s.subscriptions:
            return PARKED  # until the rights change (`rights_changed`)
        for sub in s.subscriptions.values():
            o = sub.options
            if sub.shared or sub.replay or sub.subscription_id or o.no_local \
                    or o.retain_as_published or sub.topic_filter.startswith("$"):
                # ($SYS values come from Python's housekeeping, not from a queue)
                return PARKED  # until an UNSUBSCRIBE
        if not core.quiet() or conn._lane or conn._lane_busy or conn._paused \
                or not self.broker.inbound.idle(conn) \
                or not self._delivery_idle(conn, s.persistent) \
                or s.persistent and (not settled(s) or self._deferred.bounding(conn)):
            return BUSY
        return READY

    def defers(self, conn: Connection) -> bool:
        """Whether the delivery of a persistent session just connected waits for its
        promotion (else Python delivers its whole backlog first): when the engine may
        carry it and Python has nothing in flight to resend (`Deferred.start` if not)."""
        s = conn.session
        if s is None or not s.persistent or s._outgoing or s._incoming_qos2 \
                or self._verdict(conn) not in (READY, BUSY):
            return False
        log.debug("client %r: its delivery waits for its promotion", s.client_id)
        self._deferred.add(conn)
        return True

    @staticmethod
    def _delivery_idle(conn: Connection, restored: bool = False) -> bool:
        """Nothing under way on the way to the client (`restored`: a persistent
        session's bound and news are its positions' at its promotion: `from_positions`)."""
        s = conn.session
        return not (conn._full or conn._held or conn._scopes or conn.out.backlog
                    or (s._dirty or s._restored_upto) and not restored
                    or s._replays or s._groups or conn.delivery._running)

    def _quiesce(self, conn: Connection, now: float) -> bool:
        """A busy candidate: hold it still (no more reads) when what keeps it busy is
        only what it publishes, which then settles; let go of one held too long. Whether
        it is held now."""
        began, tries = self._quiesced.get(conn, (0.0, 0))
        if conn._quiescing:
            if now - began < min(QUIESCE_S * 2 ** (tries - 1), QUIESCE_MAX_S):
                return True
            conn.quiesce(False)  # something else keeps it busy: read it again
            return False
        # MQTT 3.1.1 only: a 5.0 client's Receive Maximum counts publishes it sent before
        # it saw their PUBACKs, and a burst split across the handover would be counted
        # on each side apart (an overrun the client made would go unanswered).
        # Nor a persistent session's: what it acknowledges (sends Python has in flight
        # for it) must be read as it comes, its place kept in the store at once.
        if conn.core.version < 5 and tries < QUIESCE_TRIES and not conn.session.persistent \
                and now - began >= QUIESCE_S * 2 ** tries \
                and conn.core.settles() and self._delivery_idle(conn):
            log.debug("client %r (%s) not read for a moment: it settles to be promoted",
                      conn.session.client_id, conn.peer)
            conn.quiesce(True)
            if (stream := _linked(conn)) is not None:
                stream.read_again()  # its reader waits for no bytes now
            self._quiesced[conn] = (now, tries + 1)
            return True
        return False

    def _forget_candidate(self, conn: Connection) -> None:
        del self._candidates[conn]
        if not conn.alive:
            self._deferred.forget(conn)
        self._quiesced.pop(conn, None)
        if conn._quiescing and conn.native is None:
            conn.quiesce(False)

    # -- promotion -----------------------------------------------------------------------
    def _promote(self, conn: Connection) -> bool:
        """Hand `conn` to the engine; False if a queue holds more than Python delivered
        (it delivers the rest first) and nothing changed."""
        s, core, reactor = conn.session, conn.core, conn.reactor
        stream = _linked(conn)
        assert s is not None and (reactor is not None or stream is not None)
        keep = None  # a persistent session's: its progress reported this often
        if s.persistent:
            keep = self.broker.config.offsets_flush_interval
            from_positions(s)
        subs = []
        for sub in s.subscriptions.values():
            cursor = s.cursors.get(sub.queue)
            if cursor is None:
                return False  # where it starts is still the store's to say
            subs.append((sub.topic_filter, sub.options.qos, cursor))
        now = trio.current_time()
        aliases, idle, unread, unacked = core.handed_over(now)
        limits = core.limits
        relayed = b""
        if stream is not None:
            # Its link stays in the engine: what was relayed and not read yet goes to
            # the carried connection, behind the partial packet read here.
            conn_id = stream.link.id
            relayed = stream.take_unread()
            carry, first = self.engine.carry, (stream.link, stream.relayed)
        else:
            conn_id = next(self._ids)
            assert reactor is not None
            reactor.forget(conn)  # out of the set; the socket stays open
            carry, first = self.engine.adopt, (conn_id, conn.fd)
        more = {} if keep is None else {"keep": keep}
        try:
            taken = carry(
                *first, 5 if core.version == 5 else 4, core.keepalive,
                core.decoder.max_packet_size, limits.max_qos, limits.topic_alias_maximum,
                limits.receive_maximum, core.receive_maximum, limits.max_inflight,
                core.client_max_packet, unread=unread + relayed, idle_for=idle,
                acl=None if _publishes_anywhere(conn) else set(conn.native_topics or ()),
                subscriptions=subs, aliases_in=aliases, next_packet_id=s.next_packet_id,
                max_unsent=conn.out.rules.high,  # --max-unsent-bytes: past it, back
                client_id=s.client_id,  # each publish's record names its client
                inbound_unacked=unacked, problem_info=core.problem_info,
                # --min-drain-bytes per --write-timeout, or back "stuck"
                min_drain=conn.out.rules.min_drain, write_timeout=conn.out.rules.timeout,
                **more)
        except Exception:  # noqa: BLE001 - it stays in Python
            log.exception("promotion of %r failed", s.client_id)
            taken = False
        if not taken:
            core.handed_back_unread(unread)
            if stream is not None:
                stream.put_back(relayed)
            else:
                assert reactor is not None
                reactor.take_back(conn)
            return False
        conn.native = conn_id
        self._deferred.forget(conn)
        if stream is not None:
            stream.carry()
            stream.read_again()  # its reader waits until the connection is back
        conn._quiescing = False  # read by the engine now; by Python again once back
        left = getattr(self.broker.store, "readers_left", None)  # an embedded store's
        if left is not None and s.subscriptions:
            left([sub.queue for sub in s.subscriptions.values()])
        conn.park()
        self.promoted[conn_id] = conn
        log.debug("client %r (%s) promoted to the native plane (%d subscriptions), "
                  "thread %d", s.client_id, conn.peer, len(subs), conn_id % self._threads)
        return True

    def _look(self) -> float:
        """Promote the candidates that are quiet; when to look again."""
        now = trio.current_time()
        nxt = float("inf")
        for conn, (at, delay) in list(self._candidates.items()):
            if at > now:
                nxt = min(nxt, at)
                continue
            verdict = self._verdict(conn)
            if verdict == READY and self._promote(conn) or verdict in (NEVER, PARKED):
                self._forget_candidate(conn)
                self._deferred.start(conn)
                continue
            if verdict == READY or self._deferred.overdue(conn, now):
                self._deferred.start(conn)  # not promoted: Python delivers
            if verdict == BUSY and self._quiesce(conn, now):
                delay = FIRST_LOOK / 2  # settling: look again soon
            elif conn._quiescing:  # not to be promoted now after all: read it again
                conn.quiesce(False)
            delay = min(delay * 2, LAST_LOOK)
            self._candidates[conn] = (now + delay, delay)
            nxt = min(nxt, now + delay)
        return nxt

    def rights_changed(self, conn: Connection) -> None:
        """Users or policies changed: a promoted connection comes back (what its ACL cache
        holds may not hold any more); one parked for its rights is looked at again."""
        if conn.native is not None:
            self.release(conn)
        elif conn.delivery is not None:
            self.consider(conn)

    # -- taking connections back ---------------------------------------------------------
    def release(self, conn: Connection, closing: Closing | None = None,
                nursery: trio.Nursery | None = None) -> None:
        """Ask the engine for `conn` back; `closing`: close it with this once back."""
        conn_id = conn.native
        if conn_id is None:
            return
        if closing is not None:
            self._then.setdefault(conn_id, (closing, nursery))
        self.engine.release(conn_id)

    async def reclaim(self, conn: Connection) -> None:
        """`release`, and return once it is Python's again."""
        conn_id = conn.native
        if conn_id is None:
            return
        back = self._back.setdefault(conn_id, trio.Event())
        self.engine.release(conn_id)
        await back.wait()

    async def release_all(self, reactor: object, closing: Closing,
                          nursery: trio.Nursery) -> None:
        """At shutdown: every promoted connection of `reactor` back, and closed (None:
        those the engine accepted)."""
        mine = [c for c in self.promoted.values() if c.reactor is reactor]
        for conn in mine:
            self.release(conn, closing, nursery)
        async with self._ending:  # (the node's other reactors may be ending too)
            while any(c.native is not None for c in mine):
                with trio.move_on_after(0.1):  # another's wait may have taken ours
                    await trio.lowlevel.wait_readable(self.engine.wake_fd)
                self._take()

    def _take(self) -> None:
        # The engine wakes us too when its connections took the node back within the
        # budget for partial packets: those held back for it here may read again.
        self.broker.read_budget.refresh()
        links = self.links
        for row in self.engine.take_events():
            if type(row) is tuple:  # news of a connection the engine accepted
                if row[0] == "stored":  # a gateway node's publishes, stored
                    if self.news is not None:
                        self.news.stored(row[1])
                elif row[0] == "behind":
                    self._behind(*row[1:])
                elif row[0] == "keep" or row[0] == "progress":
                    self.records.take(row, self.promoted)
                elif links is not None:
                    links.on_event(row)
                continue
            self.records.write()  # a connection's records before its hand-back
            try:
                self._demoted(row)
            except Exception:  # noqa: BLE001 - one connection's trouble is its own
                log.exception("taking back connection %d failed", row["conn"])
        self.records.write()

    def _demoted(self, row: dict[str, Any]) -> None:
        conn_id = row["conn"]
        conn = self.promoted.pop(conn_id, None)
        fd = row["fd"]
        if conn is None:
            if fd is not None:
                os.close(fd)
            elif self.links is not None:
                self.links.forget(conn_id)
            self.broker.read_budget.update(row["partial"], 0)
            return
        conn.native = None
        conn.unpark(-1 if fd is None else fd)
        conn._held = row["partial"]  # the engine counted it: ours to count from here
        s, core = conn.session, conn.core
        assert s is not None
        sends = row.get("sends") or {}
        outgoing = [mp.Outgoing(pid, *sends.get(pid, (None, -1)), data, 1,
                                version=core.version)
                    for pid, data, _ in row["outgoing"]]
        if s.persistent:
            self.records.handed_back(s, outgoing)
            s.offsets_dirty.update(q for q in row["positions"] if q in s.subscriptions)
        core.handed_back(trio.current_time(), row["idle_for"], row["next_packet_id"],
                         row["aliases_in"], outgoing)
        for queue, nxt in row["positions"].items():
            if s.cursors.get(queue, -1) < nxt:  # Python delivers from here
                s.cursors[queue] = nxt
        if conn.reactor is not None:
            conn.reactor.take_back(conn)
        elif (stream := _linked(conn)) is not None:  # its stream's reader reads again
            stream.carried = False
            conn._reading_changed()
        why = row["why"]
        log.debug("client %r (%s) back from the native plane: %s", s.client_id, conn.peer,
                  why)
        if why != "stuck":  # (one that took too little of it is disconnected below)
            conn.out.write(row["unsent"])  # before anything Python says
        back = self._back.pop(conn_id, None)
        if back is not None:  # taken back for good: `reclaim` goes on from here
            back.set()
        then = self._then.pop(conn_id, None)
        if then is not None:
            conn.close(*then)
        elif why == "stuck":
            conn.stuck()  # as when the client stops reading here: said, and closed
        elif why == "timeout":
            conn.close(Closing("keepalive timeout", True, rc.KEEP_ALIVE_TIMEOUT))
        elif why == "lost":
            conn.close(Closing(row["detail"] or "connection lost"))
        else:
            if row["unread"]:  # the packet that needed Python, counted as it was read
                with core.read_behind(row["inbound_unacked"]):
                    conn.data_received(row["unread"])
            assert conn.delivery is not None
            if not (why == "packet" and s.persistent and back is None and self.defers(conn)):
                conn.delivery.start()  # from each queue's position (or the engine's again)
            if back is None:
                self.consider(conn)

    # -- subscribers that fell behind ----------------------------------------------------
    def _behind(self, conn_id: int, rnd: int, positions: dict[str, int]) -> None:
        """A carried subscriber that fell behind has room for its next batch: what the
        index holds of its queues from its positions goes to the engine, which reads the
        records and sends them (a queue not delivered from yet is where it was promoted)."""
        conn = self.promoted.get(conn_id)
        s = None if conn is None else conn.session
        if s is None:
            return
        queues = []
        for sub in s.subscriptions.values():
            at = positions.get(sub.queue, s.cursors.get(sub.queue))
            if at is None:
                self.engine.release(conn_id)  # (promoted only with every position known)
                return
            queues.append((sub.queue, at))
        if self._nursery is None or self._queue_runs is None:
            self.engine.release(conn_id)
            return
        entries = KEPT_ROUND_ENTRIES if s.persistent else ROUND_ENTRIES
        self._nursery.start_soon(self._feed, conn_id, rnd, queues, entries)

    async def _feed(self, conn_id: int, rnd: int, queues: list[tuple[str, int]],
                    entries: int = ROUND_ENTRIES) -> None:
        queue_runs, engine = self._queue_runs, self.engine
        assert queue_runs is not None

        def feed() -> None:
            runs, horizon = queue_runs(queues, entries)
            engine.feed_runs(conn_id, rnd, runs, horizon)

        try:
            await trio.to_thread.run_sync(feed)
        except Exception:  # noqa: BLE001 - it goes back to Python's delivery
            log.exception("reading the store for connection %d failed", conn_id)
            engine.release(conn_id)

    # -- the task ------------------------------------------------------------------------
    def start(self, nursery: trio.Nursery) -> None:
        """Run the task in `nursery` unless it runs (one for the node's listeners)."""
        if not self.running:
            self.running = True
            nursery.start_soon(self.run)

    async def run(self) -> None:
        """Take each demotion as the engine reports it, and the news of the connections
        it accepted; promote quiet candidates."""
        self.running = True
        fd = self.engine.wake_fd
        try:
            async with trio.open_nursery() as self._nursery:
                while True:
                    at = self._look()
                    if self.news is not None:
                        self.news.refresh(trio.current_time())
                        at = min(at, self.news.next_refresh)
                    with trio.move_on_at(at) as self._waiting:
                        await trio.lowlevel.wait_readable(fd)
                    self._waiting = None
                    self._take()
        finally:
            self._nursery = None
            self.running = False
