"""MQTT replay subscriptions: `$replay/<since>/<filter>` gives the filter's stored past
from `since` (lightqueue.since), then its live messages, with no gap and no duplicate
at the switch. The store reads the past (Store.history); this module hands it to the
client through the connection's one delivery path (gateway.delivery); where each replay
stands is gateway.replay_state's.

How a replay of the filter F goes:

1. SUBSCRIBE (`subscribe`): the since is parsed on this gateway's clock (a bad one is
   SUBACK 0x8F). A `Replay` goes into the session *before* the subscription is indexed:
   from then on it holds F's live reading. The subscription is made as any other (the
   wildcard registered, F's live cursor `w` its end), then the first history batch is
   read, which fixes the history's end; a cut by retention is told in the SUBACK.
   Then `w2`, F's end after that read: every message F gets from `w2` on was stored
   after the history's end, so only F's entries in [w, w2) (the overlap, a handful)
   may also be in the history. Their topics are noted.
2. The delivery task calls `step` for F while the replay holds it: one batch at a time,
   each message checked (ACL, No Local) and sent at min(subscription, message) QoS
   within the client's Receive Maximum, as a live one would be.
3. After the last batch F is read live from `w`. An overlap message whose offset in its
   topic's queue is below what the history handed out for that topic is dropped
   (`replayed`); from `w2` on nothing is, and the replay is gone.

Persistent sessions keep a snapshot of the progress in F's offsets record (the
history cursor the current batch started at, what of that batch was handed out per
topic, the overlap), saved once the QoS 1/2 messages sent before it are acknowledged
and what was sent before it is written to the socket, and written to the store before
the replay goes a snapshot further. A gateway restart (or crash) resumes from it; a
reconnect to the same gateway resumes exactly (what was in flight is resent by the
session, with DUP), or from the snapshot when the connection ended with output unwritten."""

from __future__ import annotations

import logging
from typing import Any, Protocol

import trio

from gateway.mqtt import protocol as mp
from gateway.mqtt import reason as rc
from gateway.output import Output
from gateway.replay_budget import ReplayBudget
from gateway.replay_state import Replay, Stats
from gateway.session import SHARE_PREFIX, Session, Subscription, parse_replay
from lightqueue.since import SinceError, parse_since
from store.api import HistoryBatch, Message, Store, StoreError

log = logging.getLogger("lightgate.gateway.replay")

# Messages between snapshots of a persistent session's replay. The one before the newest
# is in the store before the replay goes on, so a crash repeats at most two (256).
CHECKPOINT = 128
CUT = "replay-cut"  # SUBACK user property: this replay's history was cut by retention


class Host(Protocol):
    """The broker, as a replay sees it (gateway.broker.Broker)."""

    store: Store
    stats: Stats
    replay_budget: ReplayBudget

    async def subscribe(self, s: Session, sub: Subscription) -> bool: ...

    async def unsubscribe(self, s: Session, topic_filter: str) -> bool: ...

    async def flush_offsets(self, s: Session) -> None: ...


class Client(Protocol):
    """The connection, as a replay sees it (gateway.connection.Connection)."""

    @property
    def checks_delivery(self) -> bool: ...

    @property
    def asks_hook(self) -> bool: ...

    out: Output  # the connection's write path: where its socket stands

    def may(self, action: str, name: str, is_filter: bool = False) -> bool: ...

    def flush(self) -> None: ...


class Deliverer(Protocol):
    """What a replay uses of gateway.delivery.Delivery (its one delivery path)."""

    session: Session
    conn: Client
    core: mp.MqttProtocol
    broker: Host
    _stopped: bool

    def _blocked(self, qos: int) -> bool: ...

    async def _wait_room(self, qos: int) -> None: ...

    def _send(self, msg: Message, qos: int, retain: bool, sids: list[int] | None,
              queue: str | None, offset: int) -> mp.Outgoing | bool: ...

    async def _hook_refuses(self, topic: str) -> bool: ...


# -- hooks of the delivery path (gateway.delivery) -----------------------------------------
def holds(s: Session, queue: str) -> Replay | None:
    """The replay that reads `queue` instead of its live drain, if one does."""
    r = s._replays.get(queue) if s._replays else None
    return r if r is not None and not r.done else None


def replayed(s: Session, queue: str, offset: int, msg: Message) -> bool:
    r = s._replays.get(queue) if s._replays else None
    return r is not None and r.replayed(s, queue, offset, msg)


def acked(s: Session, taken: int) -> None:
    """A QoS 1/2 send completed, or the socket took what waited (`taken`: its position):
    snapshots waiting for them may be saved."""
    for queue, r in list(s.replays.items()):
        if r.pending:
            r.settle(s, queue, taken)
            r.finish(s, queue, s.cursors.get(queue, -1))


def rewind(s: Session, taken: int) -> None:
    """The connection ended (its socket took up to `taken`): a replay whose messages
    may be in what it did not take goes back to its last snapshot the socket took; the
    others' snapshots wait for acknowledgements alone (the next connection's output
    counts its bytes anew)."""
    for queue, r in list(s.replays.items()):
        r.settle(s, queue, taken)
        if not r.done and r.out_at > taken:
            log.info("replay of %r for %r: the client left with some of it unwritten; it "
                     "goes on from its last snapshot the socket took", queue, s.client_id)
            r.back_to_saved()
        else:
            r.taken_by_socket()


def _at(d: Deliverer) -> int:
    """The output's position after what was handed out so far (see Output.taken)."""
    return d.conn.out.written + d.core.pending_output


async def step(d: Deliverer, queue: str, r: Replay) -> None:
    """One batch of the history to the client (the delivery task runs this while `r`
    holds `queue`); `queue` is marked dirty again while there is more, and once the
    history is over, for its live messages."""
    s, store = d.session, d.broker.store
    if r.opening:
        return  # the SUBACK's delivery start comes back for it
    r.settle(s, queue, d.conn.out.taken)
    budget = d.broker.replay_budget
    if r.batch is None:
        try:
            await r.fetch(store, s, queue, budget)
        except ValueError as exc:  # a cursor the store no longer knows (its data replaced)
            log.warning("replay of %r for %r ends early: %s", queue, s.client_id, exc)
            r.keep(HistoryBatch([], {}, None, False, 0))
            if r.w2 is None:
                await r._note_overlap(store, s, queue)
        if s._replays is None or s._replays.get(queue) is not r or d._stopped:
            return
    sub = s.subscriptions.get(queue)
    if sub is None:
        return
    batch = r.batch
    assert batch is not None
    async with trio.open_nursery() as nursery:
        # A remote store reads the next batch while this one goes out; an in-process
        # one (LocalStore) would read it in a thread of this process, under the same
        # interpreter lock: no faster, and live messages wait for it.
        if (batch.cursor is not None and r.ahead is None and not r.live
                and getattr(store, "pull_now", None) is None):
            nursery.start_soon(r.read_ahead, store, s, queue, batch.cursor, budget)
        handed = await _hand_out(d, queue, sub, r)
    if not handed:
        r.checkpoint(s, queue, _at(d), d.conn.out.taken)  # stopped (or unsubscribed)
        return
    if batch.cursor is None:
        r.done = True
        log.debug("replay of %r for %r: history done, live from here", queue, s.client_id)
    else:
        r.advance(batch.cursor)
    r.checkpoint(s, queue, _at(d), d.conn.out.taken)
    await _saved(d, queue, r)
    if r.done:
        r.finish(s, queue, s.cursors.get(queue, -1))
    s.dirty.add(queue)


async def _saved(d: Deliverer, queue: str, r: Replay) -> None:
    """Before the replay goes on, the snapshot before its newest is in the store (its
    sends acknowledged, its bytes taken by the socket): a crash repeats at most the
    messages of two snapshots, as a clean stop does."""
    s = d.session
    while not d._stopped:
        d.conn.flush()  # what was handed out goes to the socket: it may take it now
        r.settle(s, queue, d.conn.out.taken)
        if len(r.pending) <= 1:
            break
        if s.wakeup is None or s.wakeup.is_set():
            s.wakeup = trio.Event()
        await s.wakeup.wait()  # an acknowledgement, or the socket took what waited
    if s.persistent and queue in s.offsets_dirty and not d._stopped:
        await d.broker.flush_offsets(s)


async def _hand_out(d: Deliverer, queue: str, sub: Subscription, r: Replay) -> bool:
    """The current batch from `r.pos` on, through the delivery path; False if the
    connection stopped or the replay went before the end of it."""
    s, conn, core = d.session, d.conn, d.core
    batch = r.batch
    assert batch is not None
    msgs, ends, overlap = batch.messages, r.ends, r.overlap
    opts = sub.options
    sub_qos, rap = opts.qos, opts.retain_as_published
    no_local = s.client_id if opts.no_local else None
    sids = [sub.subscription_id] if sub.subscription_id and core.version == 5 else None
    checks, hook = conn.checks_delivery, conn.asks_hook
    keep = s.persistent  # what was sent, for the snapshot's acknowledgements
    again = bool(ends)  # the batch is read again: what was handed out is skipped
    n, i = len(msgs), r.pos
    checkpoint = i + CHECKPOINT
    send, blocked = d._send, d._blocked
    full = blocked(0)  # the socket's backlog: it changes when written (a flush)
    turn = i + r.pace
    while i < n:
        msg = msgs[i]
        topic = msg.topic
        q = msg.queues  # a history message carries its exact-topic queue alone
        exact = q[0][1] if q and q[0][0] == topic else msg.offset_in(topic)
        if again and exact < ends.get(topic, 0):
            i += 1
            continue
        qos = msg.qos if msg.qos < sub_qos else sub_qos
        if full or (qos and blocked(qos)):
            r.pos, r.out_at = i, _at(d)
            await d._wait_room(qos)
            if d._stopped or s._replays is None or s._replays.get(queue) is not r:
                return False
            full = blocked(0)
            continue
        if (no_local is None or msg.client_id != no_local) and not (
                checks and not conn.may("SUB", topic)):
            if hook:
                r.pos, r.out_at = i, _at(d)
                refused = await d._hook_refuses(topic)
                if d._stopped or s._replays is None or s._replays.get(queue) is not r:
                    return False
            else:
                refused = False
            if not refused:
                o = send(msg, qos, rap and msg.retain, sids, None, -1)
                if keep and o is not True and o is not False:
                    r.sent.append(o)
        ends[topic] = exact + 1
        if overlap and topic in overlap:
            overlap[topic] = exact + 1
        i += 1
        if keep and i >= checkpoint:
            r.pos, r.out_at = i, _at(d)
            r.checkpoint(s, queue, r.out_at, conn.out.taken)
            checkpoint = i + CHECKPOINT
            await _saved(d, queue, r)
            if d._stopped or s._replays is None or s._replays.get(queue) is not r:
                return False
            full = blocked(0)
        if i >= turn:
            conn.flush()
            r.pos, r.out_at = i, _at(d)
            await r.give_way(d.broker.stats)
            if d._stopped or s._replays is None or s._replays.get(queue) is not r:
                return False
            full = blocked(0)
            turn = i + r.pace
    r.pos, r.out_at = n, _at(d)
    conn.flush()
    return True


# -- SUBSCRIBE ------------------------------------------------------------------------------
async def take_place(broker: Host, s: Session, sub: Subscription) -> None:
    """A session reads a filter once: a subscription to F (`F`, `$replay/<since>/F`)
    takes the place of its other one to F, and starts anew."""
    old = s.subscriptions.get(sub.key)
    if old is not None and old.topic_filter != sub.topic_filter:
        await broker.unsubscribe(s, old.topic_filter)


async def subscribe(broker: Host, s: Session, sub: Subscription) -> tuple[int, str, bool]:
    """Make the replay subscription `sub`: (0 or a SUBACK failure code, why it failed,
    whether its history was cut). Raises StoreError (the store is away)."""
    assert sub.replay is not None
    queue = sub.queue
    if s.subscription(sub.topic_filter) is not None:  # the same again: it keeps its place
        await broker.subscribe(s, sub)
        return 0, "", False
    try:
        since = parse_since(sub.replay[0])
    except SinceError as exc:
        return rc.TOPIC_FILTER_INVALID, str(exc), False
    await take_place(broker, s, sub)
    r = Replay(since)
    r.opening = True
    s.replays[queue] = r  # holds F's live reading from before it is indexed
    try:
        await broker.subscribe(s, sub)
        await r.open(broker.store, s, queue, broker.replay_budget)
    except (ValueError, StoreError) as exc:
        s.replays.pop(queue, None)
        await broker.unsubscribe(s, sub.topic_filter)
        if isinstance(exc, StoreError):
            raise
        return rc.TOPIC_FILTER_INVALID, str(exc), False  # e.g. in the store's future
    finally:
        r.opening = False
    if s.persistent:
        r.checkpoint(s, queue, 0, 0)  # where it stands once it is read from the store
        await broker.flush_offsets(s)
    log.info("client %r replays %r from %s%s", s.client_id, queue, since,
             " (cut by retention)" if r.cut else "")
    return 0, "", r.cut


def parse(topic_filter: str, shared: tuple[str, str] | None) -> tuple[str, str] | None:
    """(since text, filter) of a replay subscription, None for another; ValueError (its
    text the SUBACK's reason string) for one that cannot be."""
    real = shared[1] if shared else topic_filter
    if shared and parse_replay(real) is not None:
        raise ValueError("a shared subscription cannot replay")
    replay = None if shared else parse_replay(topic_filter)
    if replay is not None and (parse_replay(replay[1]) is not None
                               or replay[1].startswith(SHARE_PREFIX)):
        raise ValueError("a replay's filter is a plain topic filter")
    return replay


# -- persistent sessions (gateway.sessions) ---------------------------------------------------
def meta(s: Session, queue: str) -> dict[str, Any] | None:
    """The saved snapshot of `queue`'s replay, for its offsets record."""
    r = s._replays.get(queue) if s._replays else None
    return None if r is None else r.saved


def let_go(s: Session) -> None:
    """The session's connection ended: the history its replays read goes (read again
    from where each stands when it is back)."""
    if s._replays:
        for r in s._replays.values():
            r.unread()


def restore(s: Session, sub: Subscription, pos: dict[str, Any] | None) -> None:
    """A replay subscription read back from the store: resume from its snapshot, or
    start over when it never got an offsets record (the gateway stopped in between).
    A record without a snapshot is one whose replay finished."""
    if sub.replay is None or (pos is not None and "replay" not in pos):
        return
    if pos is None:
        try:
            r = Replay(parse_since(sub.replay[0]))
        except SinceError:
            return
    else:
        r = Replay.from_meta(pos["replay"])
    s.replays[sub.queue] = r
