"""The gateway's sessions: opened for a CONNECT (taking over the client id's live
connection, resuming what the store holds), detached when the connection ends, expired
or discarded; and what they keep in the store on the way (subscriptions, where each
queue resumes, messages in flight). Layout of the records: gateway.session."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import trio

from gateway import replay, takeover
from gateway.background import Background
from gateway.cache import Templates
from gateway.locks import ClientLocks
from gateway.session import (
    NEVER_EXPIRES,
    NUL,
    Client,
    Outgoing,
    Session,
    Subscription,
    batch_key,
    in_key,
    offset_key,
    out_key,
    qos2_key,
    sub_key,
)
from gateway.shared import SharedGroups
from gateway.stats import Stats
from gateway.wills import Wills
from lightqueue.topic import is_wildcard
from serving.rate_limited_log import RateLimitedLog
from store.api import AuthManager, Store, StoreError

log = logging.getLogger("lightgate.gateway")

_not_kept = RateLimitedLog(log)  # the store refusing writes refuses each session's


class SessionLimitReached(Exception):
    """No new persistent session: the node holds --max-sessions already."""


class ClientIdTaken(Exception):
    """The client id's session (live or kept) belongs to another identity."""


class SessionRegistry:
    def __init__(self, store: Store, auth: AuthManager, stats: Stats, max_sessions: int, *,
                 wills: Wills, groups: SharedGroups, templates: Templates,
                 background: Background, locks: ClientLocks) -> None:
        self.store = store
        self.auth = auth
        self.stats = stats
        self.max_sessions = max_sessions  # persistent ones; 0: no limit
        self.wills = wills
        self.groups = groups
        self.templates = templates
        self.background = background
        self.locks = locks
        self.by_id: dict[str, Session] = {}
        self.by_queue: dict[str, set[Session]] = {}  # who reads each queue itself
        # Told of each queue that gets its first reader here (gateway.remote_plane).
        self.on_new_queue: Callable[[str], None] | None = None
        # Persistent sessions in the store: counted by each expiry sweep, plus those
        # made and discarded here since.
        self.persistent = 0
        # This gateway's id among the store's gateways (gateway.app); None in `serve`,
        # the only gateway of its store.
        self.gateway_id: str | None = None
        # Asks another gateway over the notify bus to release a session's claim:
        # (holder, claim, client id) (gateway.takeover; None: no bus between gateways).
        self.ask_release: Callable[[str, str, str], None] | None = None

    # -- opening ----------------------------------------------------------------------
    async def open(self, client_id: str, clean_start: bool, expiry: int, version: int,
                   connection: Client | None = None) -> tuple[Session, bool]:
        """The session for a new connection, attached to `connection`, and whether one was
        present. CONNECTs with the same client id are taken one at a time, in order, so
        the last one wins: two at once both stayed connected, holding one session."""
        async with self.locks.hold(client_id):
            session, present = await self._open(client_id, clean_start, expiry, version,
                                                self._owner(connection))
            if connection is not None:
                session.connection = connection
            return session, present

    def _owner(self, connection: Client | None) -> str | None:
        """The identity a session made on `connection` belongs to (None: auth off)."""
        subject = connection.subject if connection is not None else None
        if not self.auth.enabled or subject is None:
            return None
        return f"{subject.backend}:{subject.name}"

    async def _open(self, client_id: str, clean_start: bool, expiry: int, version: int,
                    owner: str | None = None) -> tuple[Session, bool]:
        if owner is not None:
            await self._check_owner(client_id, owner)
        session = self.by_id.get(client_id)
        if session is not None and session.connection is None \
                and not await takeover.current_here(self, session):
            await takeover.forget_here(self, session)  # another gateway served it since
            session = None
        if session is not None and session.connection is not None:
            await session.connection.take_over()  # closed, will sent, session detached
            session = self.by_id.get(client_id)
        stored = None  # its record in the store, when the session is not here
        if session is None:
            stored = await takeover.released_elsewhere(self, client_id)
        await self.wills.client_back(client_id, clean_start)
        if clean_start:
            if session is not None or stored is not None:
                await self.discard(client_id)
            session, present = None, False
        elif session is not None:
            present = True
        else:
            session = await self._load(client_id, stored)
            present = session is not None
        made = session is None
        if session is None:
            session = self._new(client_id, expiry, version)
        if owner is not None:
            session.owner = owner
        claim = None
        if expiry > 0 or self.gateway_id is not None:
            # A session without expiry keeps nothing; its record only says where it is
            # connected, for a takeover from another gateway (gateway.takeover).
            info = {"version": version, "expiry": expiry, "owner": session.owner}
            if self.gateway_id is not None:  # connected here (gateway.takeover)
                info["gateway"] = self.gateway_id
                info["claim"] = claim = uuid.uuid4().hex[:12]  # (gateway.takeover)
            try:
                await self.store.meta_put("sessions", client_id, info)
            except StoreError:  # refused (a full disk, the store away): as it was
                if made and self.by_id.get(client_id) is session:
                    del self.by_id[client_id]
                    if expiry > 0:
                        self.persistent = max(0, self.persistent - 1)
                elif session.connection is None and session.disconnected_at is None:
                    session.disconnected_at = time.time()  # offline still: it expires
                raise
        session.persistent = expiry > 0
        session.expiry = expiry
        session.version = version
        session.disconnected_at = None
        session.claim = claim
        return session, present

    async def _check_owner(self, client_id: str, owner: str) -> None:
        """ClientIdTaken if another identity holds the client id: a live connection's
        session, or a persistent one kept for it. Taking it over would end the other's
        connection and discard what it was promised (its subscriptions, what it had in
        flight, what it missed). A session made with auth off has no owner: the first
        identity to come back claims it."""
        held = self.by_id.get(client_id)
        if held is not None:
            holder = None if held.expired() else held.owner
        else:
            info = await self.store.meta_get("sessions", client_id)
            holder = None if info is None or _expired(info, time.time()) \
                else info.get("owner")
        if holder not in (None, owner):
            log.warning("connect of %s with client id %r refused: its session belongs to "
                        "%s", owner, client_id, holder)
            raise ClientIdTaken(f"client id {client_id!r} is another user's")

    def _new(self, client_id: str, expiry: int, version: int) -> Session:
        if expiry > 0 and self.max_sessions and self.persistent >= self.max_sessions:
            self.stats.limit_refusals += 1
            self.stats.sessions_refused += 1
            raise SessionLimitReached(
                f"{self.persistent} persistent sessions held (--max-sessions)")
        session = Session(client_id, persistent=expiry > 0, version=version, expiry=expiry)
        self.by_id[client_id] = session
        if expiry > 0:
            self.persistent += 1
        return session

    async def _load(self, client_id: str, info: dict[str, Any] | None) -> Session | None:
        """The session stored as `info` (its record), with what it holds in the store."""
        if info is None or connected_only(info):
            return None
        s = Session(client_id, persistent=True, version=info.get("version", 4),
                    expiry=info.get("expiry", NEVER_EXPIRES), owner=info.get("owner"))
        for key, value in await self.store.meta_items("subscriptions", client_id + NUL):
            sub = Subscription.from_meta(key.split(NUL, 1)[1], value)
            s.add_subscription(sub)
            if sub.shared:
                await self.groups.join(s, sub.shared)
            else:
                self._index(s, sub.queue)
        for sub in s.subscriptions.values():
            if sub.shared:
                continue
            pos = await self.store.meta_get("offsets", offset_key(client_id, sub.queue))
            replay.restore(s, sub, pos)
            if pos is not None:
                # Resume at the first unacknowledged offset; what lies between it and the
                # next unsent one was acknowledged or is resent from the in-flight state.
                s.cursors[sub.queue] = pos["acked"]
                if pos["next"] > pos["acked"]:
                    s.restored_upto[sub.queue] = pos["next"] - 1
        batches: list[tuple[int, dict[str, Any]]] = []
        for key, value in await self.store.meta_items("inflight", client_id + NUL):
            _, direction, pid = key.split(NUL)
            if direction == "outs":
                batches.append((int(pid), value))
            elif direction == "in":
                if "done" not in value:
                    s.incoming_qos2.add(int(pid))
                    if "phys" in value:
                        s.incoming_phys[int(pid)] = value["phys"]
            else:
                await self._restore_outgoing(s, int(pid), value)
        if batches:
            await self._unbatch(s, batches)
        self.by_id[client_id] = s
        log.info("session %r restored from the store (%d subscriptions, %d in flight)",
                 client_id, len(s.subscriptions), len(s.outgoing))
        return s

    async def _unbatch(self, s: Session, batches: list[tuple[int, dict[str, Any]]]) -> None:
        """The native plane's batch records (gateway.handover), rewritten in one write as
        the per-send records this plane keeps, and restored as those are: a packet id
        named by several is the latest batch's (an id is used again only once its send
        completed), and one with a per-send record already is that record's (written
        after the native plane handed the session back)."""
        sends: dict[int, tuple[str, int, int]] = {}
        for _, value in sorted(batches, key=lambda b: b[0]):
            qos = value.get("qos", 1)
            for first, queue, start, count in value["runs"]:
                for i in range(count):
                    pid = (first - 1 + i) % 65535 + 1
                    if pid not in s.outgoing:
                        sends.pop(pid, None)  # (in the order of the latest)
                        sends[pid] = (queue, start + i, qos)
        records = {pid: {"queue": q, "offset": o, "state": "publish", "qos": qos}
                   for pid, (q, o, qos) in sends.items()}
        await self.store.meta_write(
            [("put", "inflight", out_key(s.client_id, pid), v) for pid, v in records.items()]
            + [("delete", "inflight", batch_key(s.client_id, b), None) for b, _ in batches])
        for pid, value in records.items():
            await self._restore_outgoing(s, pid, value)

    async def _restore_outgoing(self, s: Session, pid: int, value: dict[str, Any]) -> None:
        queue, offset, state = value["queue"], value["offset"], value["state"]
        res = await self.store.pull(queue, offset, 1)
        if not res.messages or res.messages[0].offset_in(queue) != offset:
            return  # gone by retention: nothing to resend
        msg = res.messages[0]
        qos = value.get("qos", msg.qos)
        data = self.templates(msg).for_subscriber(pid, False, version=s.version, qos=qos,
                                                  retain=False)
        s.outgoing[pid] = Outgoing(pid, queue, offset, data, qos, state, message=msg,
                                   version=s.version)
        s.restored_upto[queue] = max(offset, s.restored_upto.get(queue, -1))
        s.next_packet_id = pid % 65535 + 1

    # -- ending -----------------------------------------------------------------------
    async def discard(self, client_id: str) -> None:
        s = self.by_id.pop(client_id, None)
        if s is None or s.persistent:
            self.persistent = max(0, self.persistent - 1)
        if s is not None:
            await self.unload(s)
        await self.store.meta_write([
            ("delete", "sessions", client_id, None),
            ("delete_prefix", "subscriptions", client_id + NUL, None),
            ("delete_prefix", "offsets", offset_key(client_id, ""), None),
            ("delete_prefix", "inflight", client_id + NUL, None),
        ])

    async def unload(self, s: Session, *, keep_groups: bool = False) -> None:
        """What this gateway holds for `s` besides `by_id` goes: its messages in flight
        of shared groups count as acknowledged here, it leaves its groups (their
        positions stay in the store if `keep_groups`) and its queues' readers."""
        for o in s.outgoing.values():
            if o.group is not None:  # a QoS 2 kept for it: nobody else gets it here
                o.group.acked(o.offset)
        for sub in list(s.subscriptions.values()):
            if sub.shared:
                await self.groups.leave(s, sub.shared, keep=keep_groups)
            else:
                self._unindex(s, sub.queue)

    async def detached(self, session: Session) -> None:
        """The connection of `session` closed; keep or drop the session per its expiry."""
        session.connection = None
        session.disconnected_at = time.time()
        replay.let_go(session)
        if not session.persistent:
            if self.by_id.get(session.client_id) is session:
                await self.discard(session.client_id)
            return
        info: dict[str, Any] = {"version": session.version, "expiry": session.expiry,
                                "disconnected_at": session.disconnected_at,
                                "owner": session.owner}
        if session.claim is not None:  # whose copy the record is (gateway.takeover)
            info["claim"] = session.claim
        will = self.wills.record(session.client_id)
        if will is not None:  # kept with the session: published after a restart too
            info["will"] = will
        try:
            await self.flush_offsets(session)
            await self.store.meta_put("sessions", session.client_id, info)
        except StoreError as exc:  # its offsets stay dirty: the periodic round retries
            _not_kept.note(f"sessions of clients that left not kept in the store yet "
                           f"(a restart resumes them as they were stored): {exc}")
        if session.expiry != NEVER_EXPIRES:
            self.background.spawn(self._expire_later, session)

    async def _expire_later(self, s: Session) -> None:
        await trio.sleep(s.expiry)
        if self.by_id.get(s.client_id) is s and s.expired():
            try:
                if not await takeover.current_here(self, s):
                    await takeover.forget_here(self, s)  # its client went on elsewhere
                    return
                log.info("session %r expired after %ds offline", s.client_id, s.expiry)
                await self.discard(s.client_id)
                self.stats.sessions_expired += 1
            except StoreError as exc:  # the periodic expiry check will try again
                log.warning("expired session %r not removed yet: %s", s.client_id, exc)

    async def expire(self) -> int:
        """Discard every session past its expiry, live here or only in the store; the
        count of persistent sessions is taken afresh on the way."""
        now = time.time()
        gone = 0
        items = stored_sessions(await self.store.meta_items("sessions"))
        for client_id, info in items:
            s = self.by_id.get(client_id)
            if s is not None and s.connection is None and s.claim is not None \
                    and s.claim != info.get("claim"):
                await takeover.forget_here(self, s)  # another gateway's now: as stored
                s = None
            if s is not None:
                if s.expired(now):
                    await self.discard(client_id)
                    gone += 1
                continue
            if _expired(info, now):
                await self.discard(client_id)
                gone += 1
        self.persistent = len(items) - gone
        self.stats.sessions_expired += gone
        return gone

    # -- subscriptions ----------------------------------------------------------------
    def _index(self, s: Session, queue: str) -> None:
        readers = self.by_queue.get(queue)
        if readers is None:
            readers = self.by_queue[queue] = set()
            if self.on_new_queue is not None:
                self.on_new_queue(queue)
        readers.add(s)

    def _unindex(self, s: Session, queue: str) -> None:
        subs = self.by_queue.get(queue)
        if subs is not None:
            subs.discard(s)
            if not subs:
                del self.by_queue[queue]

    async def subscribe(self, s: Session, sub: Subscription) -> bool:
        """Add or replace a subscription; a new one starts at its queue's end."""
        if is_wildcard(sub.queue):
            # Wildcard queues are registered by their first subscriber: no admin step.
            await self.store.add_wildcard(sub.queue)
        new = s.add_subscription(sub)
        if sub.shared:
            await self.groups.join(s, sub.shared)
        else:
            if new:
                s.cursors[sub.queue] = await self.store.queue_end(sub.queue)
                s.offsets_dirty.add(sub.queue)
            self._index(s, sub.queue)
        if s.persistent:
            await self.store.meta_put("subscriptions", sub_key(s.client_id, sub.topic_filter),
                                      sub.to_meta())
            await self.flush_offsets(s)
        return new

    async def unsubscribe(self, s: Session, topic_filter: str) -> bool:
        sub = s.subscription(topic_filter)
        if sub is None:
            return False
        s.remove_subscription(topic_filter)
        if sub.shared:
            await self.groups.leave(s, sub.shared)
        else:
            self._unindex(s, sub.queue)
        if s.persistent:
            await self.store.meta_write([
                ("delete", "subscriptions", sub_key(s.client_id, topic_filter), None),
                ("delete", "offsets", offset_key(s.client_id, sub.queue), None),
            ])
        return True

    # -- what a persistent session keeps in the store ---------------------------------
    async def flush_offsets(self, s: Session,
                            also: list[tuple[str, str, str, Any]] | None = None) -> None:
        """Persist where each queue of `s` resumes: the first unacknowledged offset, and
        the first never sent (`also`: more ops, written in the same batch)."""
        if not s.persistent or not s.has_dirty_offsets():
            if also:
                await self.store.meta_write(also)
            return
        ops = list(also or ())
        for queue in s.offsets_dirty:
            acked = s.acked_offset(queue)
            if acked is not None and queue in s.subscriptions:
                pos = {"acked": acked, "next": _sent_upto(s, queue, acked)}
                if s._replays and (progress := replay.meta(s, queue)) is not None:
                    pos["replay"] = progress
                ops.append(("put", "offsets", offset_key(s.client_id, queue), pos))
        if ops:
            await self.store.meta_write(ops)
        s.offsets_dirty.clear()

    async def flush_all_offsets(self) -> None:
        """Where every session resumes; a failure keeps them dirty, so the next round
        flushes them."""
        for s in list(self.by_id.values()):
            if s.has_dirty_offsets():
                await self.flush_offsets(s)

    async def persist_outgoing(self, s: Session, *sends: Outgoing) -> None:
        """The in-flight records of `sends`, in one write."""
        ops = [("put", "inflight", out_key(s.client_id, o.packet_id),
                {"queue": o.queue, "offset": o.offset, "state": o.state, "qos": o.qos})
               for o in sends if o.queue is not None]
        if s.persistent and ops:
            await self.store.meta_write(ops)

    async def forget_outgoing(self, s: Session, *sends: Outgoing) -> None:
        """Sends completed: their in-flight records go, and in the same write the
        queues' offsets say they were sent (else a crash before the next round of
        offsets would deliver them again, as new messages)."""
        done = [o for o in sends if o.queue is not None]
        if s.persistent and done:
            s.offsets_dirty.update(o.queue for o in done if o.queue is not None)
            try:
                await self.flush_offsets(
                    s, [("delete", "inflight", out_key(s.client_id, o.packet_id), None)
                        for o in done])
            except StoreError as exc:  # the store is away (a failover): the client's ack
                # stands; the stale record only means a resend with DUP after a restart
                _not_kept.note(f"in-flight records of completed sends not removed (a "
                               f"restart resends them with DUP): {exc}")

    async def remember_incoming_qos2(self, s: Session, pid: int, done: bool,
                                     phys: int = -1) -> None:
        """`phys`: where the publish's record is (its key is qos2_key). Released, the
        marker keeps that position: a crash may leave a later publish with this id stored
        but unmarked, and `stored_qos2` tells the two apart by it."""
        if not s.persistent:
            return
        if done:
            phys = s.incoming_phys.pop(pid, -1)
            if phys >= 0:
                await self.store.meta_put("inflight", in_key(s.client_id, pid), {"done": phys})
            else:
                await self.store.meta_delete("inflight", in_key(s.client_id, pid))
        else:
            if phys >= 0:
                s.incoming_phys[pid] = phys
            await self.store.meta_put("inflight", in_key(s.client_id, pid),
                                      {"phys": phys} if phys >= 0 else {})

    async def stored_qos2(self, s: Session, pid: int) -> int | None:
        """For a DUP QoS 2 PUBLISH of a packet id the session has no exchange for: the
        position of the record an earlier attempt stored before a crash cut the exchange
        (then it is a duplicate), or None (a new message, to store)."""
        last = await self.store.last_key_offset(qos2_key(s.client_id, pid))
        if last is None:
            return None
        mark = await self.store.meta_get("inflight", in_key(s.client_id, pid))
        if mark is not None and mark.get("done", -1) >= last:
            return None  # that record's exchange was completed
        return last


def _sent_upto(s: Session, queue: str, acked: int) -> int:
    """The first offset of `queue` never sent: the cursor, or past what was sent before
    a restart while the session reads up to it again (its resends skip it)."""
    nxt = s.cursors.get(queue, acked)
    upto = s._restored_upto.get(queue) if s._restored_upto else None
    return nxt if upto is None else max(nxt, upto + 1)


def connected_only(info: dict[str, Any]) -> bool:
    """Whether a session record is only a clean session's claim (a gateway holds it
    connected; it ends with the connection), not a session to resume."""
    return info.get("expiry") == 0


def stored_sessions(items: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict]]:
    """The records of sessions that outlive their connection, among `items`."""
    return [(cid, info) for cid, info in items if not connected_only(info)]


def _expired(info: dict[str, Any], now: float) -> bool:
    """Whether a session record (sessions: client_id -> info) is past its expiry."""
    at, expiry = info.get("disconnected_at"), info.get("expiry", NEVER_EXPIRES)
    return at is not None and expiry != NEVER_EXPIRES and now - at >= expiry
