"""Where a replay subscription stands (gateway.replay runs it): the history cursor
and the current batch, what of it was handed out per topic, the overlap with live
reading, the snapshot a persistent session keeps, and the pace it goes at beside live
traffic. Reads the store through the Store face; sends nothing itself."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from typing import Any, Protocol

import trio

from gateway.mqtt import protocol as mp
from gateway.replay_budget import MIN_READ, Lease, ReplayBudget, batch_bytes
from lightqueue.since import TIME, Since
from store.api import HistoryBatch, Message, Store, StoreError

log = logging.getLogger("lightgate.gateway.replay")

FIRST_BATCH = 256  # read during SUBSCRIBE: small, so the first message goes out soon
BATCH = 4096  # the store's largest
BATCH_BYTES = 4 << 20
QUIET = 300e-6  # CPU s other tasks of this thread may take in one turn: more is live load
GIVE_WAY = 8  # turns a replay lets go by while the other tasks keep having work
TURN = 1024  # messages handed out between turns of the other tasks (and socket writes)
# With publishes coming in, a replay reads smaller batches and none ahead (a read holds
# the interpreter, which live messages then wait for) and hands out fewer per turn;
# fewer still while the gateway is busy.
LIVE_BATCH, LIVE_TURN, BUSY_TURN = 512, 256, 128


class Session(Protocol):
    """A session, as a replay's state reads and marks it (gateway.session.Session, which
    holds its replays: this keeps the two modules from importing each other)."""

    client_id: str
    persistent: bool

    @property
    def cursors(self) -> dict[str, int]: ...

    @property
    def outgoing(self) -> OrderedDict[int, mp.Outgoing]: ...

    @property
    def offsets_dirty(self) -> set[str]: ...

    @property
    def replays(self) -> dict[str, Replay]: ...


class Stats(Protocol):
    """The gateway's counters (gateway.stats.Stats), as a replay reads them."""

    messages_in: int  # publishes taken: live traffic is coming in while it grows


class Replay:
    """One replay subscription's history, as far as it has gone."""

    __slots__ = ("since", "cursor", "batch", "pos", "ends", "w2", "overlap", "done", "cut",
                 "saved", "pending", "sent", "started", "opening", "ahead",
                 "busy", "live", "seen", "out_at", "_lease", "_ahead_lease")

    def __init__(self, since: Since) -> None:
        self.since = since  # resolved: a duration is a time by now
        self.cursor: str | None = None  # where the current batch starts (None: at since)
        self.batch: HistoryBatch | None = None  # the current batch, once read
        self.pos = 0  # messages of it looked at
        self.ends: dict[str, int] = {}  # topic -> its queue offset after the last handed out
        #                                 (of the current batch: it is re-read from cursor)
        self.w2: int | None = None  # F's end once the history's end was fixed
        self.overlap: dict[str, int] = {}  # topics of F's [w, w2) -> offset after the last
        #                                    of theirs the history handed out
        self.done = False  # the history is over: F is read live (overlap dropped)
        self.cut = False  # retention removed part of it
        self.saved: dict[str, Any] = self.to_meta()  # the acknowledged snapshot (persistent)
        # Snapshots not saved yet: (sends awaiting acknowledgement, the snapshot, the
        # output's position after it).
        self.pending: deque[tuple[list[mp.Outgoing], dict[str, Any], int]] = deque()
        self.sent: list[mp.Outgoing] = []  # QoS 1/2 sends since the last snapshot
        self.started = False  # a first batch was read (the first is the smaller)
        self.opening = False  # its SUBSCRIBE reads the first batch: not the task
        self.ahead: tuple[str, HistoryBatch] | None = None  # the next batch, read early
        self.busy = False  # live traffic kept the gateway's loop busy at the last turn
        self.live = False  # publishes came in since the turn before the last
        self.seen = 0  # publishes the gateway had taken by the last turn
        self.out_at = 0  # the output's position after the last message handed out
        self._lease: Lease | None = None  # `batch`'s bytes in the replay budget
        self._ahead_lease: Lease | None = None  # `ahead`'s

    # -- the snapshot a persistent session keeps --------------------------------------------
    def to_meta(self) -> dict[str, Any]:
        since = self.since.ms if self.since.kind == TIME else self.since.kind
        return {"since": since, "cursor": self.cursor, "ends": dict(self.ends),
                "w2": self.w2, "overlap": dict(self.overlap), "done": self.done}

    @classmethod
    def from_meta(cls, d: dict[str, Any]) -> Replay:
        since = d["since"]
        r = cls(Since(TIME, since) if isinstance(since, int) else Since(since))
        r.cursor, r.ends, r.w2 = d.get("cursor"), dict(d.get("ends") or {}), d.get("w2")
        r.overlap, r.done = dict(d.get("overlap") or {}), bool(d.get("done"))
        r.saved = d
        return r

    def checkpoint(self, s: Session, queue: str, mark: int, taken: int) -> None:
        """A snapshot of where the replay stands, saved once what was sent before it is
        acknowledged (QoS 1/2) and taken by the socket (QoS 0: up to `mark`, the output's
        position after it; the socket has taken `taken`). Persistent sessions only:
        nothing else survives the connection."""
        if not s.persistent:
            return
        outgoing = s.outgoing
        unacked = [o for o in self.sent if outgoing.get(o.packet_id) is o]
        self.sent = []
        self.pending.append((unacked, self.to_meta(), mark))
        self.settle(s, queue, taken)

    def settle(self, s: Session, queue: str, taken: int) -> None:
        """Move the saved snapshot on past every acknowledged one the socket took."""
        outgoing, moved = s.outgoing, False
        while self.pending and self.pending[0][2] <= taken and not any(
                outgoing.get(o.packet_id) is o for o in self.pending[0][0]):
            self.saved = self.pending.popleft()[1]
            moved = True
        if moved:
            s.offsets_dirty.add(queue)

    def back_to_saved(self) -> None:
        """Where the saved snapshot stands (what was handed out since may not have
        reached the client: the connection ended with it unwritten)."""
        d = self.saved
        self.unread()
        self.cursor, self.ends, self.w2 = d.get("cursor"), dict(d.get("ends") or {}), d.get("w2")
        self.overlap, self.done = dict(d.get("overlap") or {}), bool(d.get("done"))
        self.pending.clear()
        self.sent = []

    def taken_by_socket(self) -> None:
        """The connection ended with everything handed out taken by its socket: the
        snapshots still waiting wait for their acknowledgements alone. (Their marks are
        positions on that connection's output; the next one counts from 0 again, and
        a snapshot marked past what it writes before the replay's next would never be
        saved: the replay stopped.)"""
        self.pending = deque((sent, meta, 0) for sent, meta, _ in self.pending)
        self.out_at = 0

    def finish(self, s: Session, queue: str, cursor: int) -> None:
        """Gone, once live reading is past the overlap and every snapshot is saved."""
        if (self.done and not self.pending and self.w2 is not None and cursor >= self.w2
                and s.replays.get(queue) is self):
            del s.replays[queue]
            s.offsets_dirty.add(queue)  # its record loses the snapshot

    # -- what it holds (gateway.replay_budget) ------------------------------------------------
    @property
    def held(self) -> int:
        """Bytes of history read for it and not handed out (the budget's count)."""
        return ((self._lease.n if self._lease is not None else 0)
                + (self._ahead_lease.n if self._ahead_lease is not None else 0))

    def keep(self, batch: HistoryBatch, lease: Lease | None = None) -> None:
        """`batch` is the current one (counted in `lease`, reserved for its read)."""
        self._release()
        self.batch, self.pos = batch, 0
        if lease is not None:
            lease.resize(batch_bytes(batch))
            self._lease = lease

    def advance(self, cursor: str) -> None:
        """The current batch is handed out: the next starts at `cursor`."""
        self._release()
        self.cursor, self.batch, self.ends = cursor, None, {}

    def unread(self, started: bool = True) -> None:
        """Give back what was read for it and is not being handed out: the batch read
        ahead, and the current one (all of it unless `started`, when one it began
        handing out is kept). Read again in its turn: from `cursor`, skipping what
        `ends` says went out (the first batch: from `since`, its overlap noted anew)."""
        self._drop_ahead()
        if self.batch is not None and (started or (not self.pos and not self.ends)):
            self._release()
            self.batch = None

    def _drop_ahead(self) -> None:
        if self._ahead_lease is not None:
            self._ahead_lease.release()
            self._ahead_lease = None
        self.ahead = None

    def _release(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    # -- reading the store -------------------------------------------------------------------
    async def open(self, store: Store, s: Session, queue: str, budget: ReplayBudget
                   ) -> None:
        """SUBSCRIBE's read of the first batch, within the room the budgets leave; with
        none, one message (it answers the SUBSCRIBE: a start the store refuses, a cut by
        retention), given back at once: the history is read in the replay's turn."""
        room = min(BATCH_BYTES, budget.room(held_by(s)))
        lease = budget.lease(room) if room >= MIN_READ else None
        try:
            batch = await store.history(queue, self.since,
                                        max_count=FIRST_BATCH if lease else 1,
                                        max_bytes=max(1, room))
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        self.started = True
        if lease is None:
            budget.cut += 1
        else:
            self.keep(batch, lease)
        await self._note_overlap(store, s, queue)
        self._note_cut(batch, s, queue)

    async def fetch(self, store: Store, s: Session, queue: str, budget: ReplayBudget
                    ) -> None:
        """The batch at `cursor` (the first: at `since`, then the overlap is noted),
        within the room the budgets leave: short of a full batch, the session's other
        replays give back what they read and did not begin to hand out; at least
        MIN_READ whatever the budgets say, so that the replay goes on."""
        if self.ahead is not None and self.ahead[0] == self.cursor and self.cursor:
            batch, self.ahead = self.ahead[1], None
            self._release()
            self._lease, self._ahead_lease = self._ahead_lease, None
            self.batch, self.pos = batch, 0
            return
        self._drop_ahead()  # read for another cursor
        room = budget.room(held_by(s))
        if room < BATCH_BYTES:
            for other in s.replays.values():
                if other is not self:
                    other.unread(started=False)
            room = budget.room(held_by(s))
        if room < BATCH_BYTES:
            budget.cut += 1
        max_bytes = max(MIN_READ, min(BATCH_BYTES, room))
        lease = budget.lease(max_bytes)
        try:
            if self.cursor is None:
                size = BATCH if self.started else FIRST_BATCH
                batch = await store.history(queue, self.since, max_count=size,
                                            max_bytes=max_bytes)
                self.started = True
                await self._note_overlap(store, s, queue)
            else:
                batch = await store.history(queue, cursor=self.cursor,
                                            max_count=LIVE_BATCH if self.live else BATCH,
                                            max_bytes=max_bytes)
        except BaseException:
            lease.release()
            raise
        self._note_cut(batch, s, queue)
        self.keep(batch, lease)

    def _note_cut(self, batch: HistoryBatch, s: Session, queue: str) -> None:
        if batch.cut and not self.cut:
            log.info("replay of %r for %r: retention removed part of its history",
                     queue, s.client_id)
        self.cut = self.cut or batch.cut

    async def give_way(self, stats: Stats) -> None:
        """A turn for the other tasks (the reactor's live traffic, other sessions), and
        more while they keep having work: a replay takes what live traffic leaves of
        the gateway. Their work is this thread's CPU time while this task waits (a wall
        clock would also count the store's thread holding the GIL, and other processes).
        Whether live traffic comes in, the gateway's count of publishes tells."""
        took = stats.messages_in
        self.live, self.seen = took != self.seen, took
        for _ in range(GIVE_WAY):
            before = time.thread_time()
            await trio.lowlevel.checkpoint()
            if time.thread_time() - before < QUIET:
                self.busy = False
                return
        self.busy = True

    @property
    def pace(self) -> int:
        """Messages to hand out before the next turn."""
        return BUSY_TURN if self.busy else LIVE_TURN if self.live else TURN

    async def read_ahead(self, store: Store, s: Session, queue: str, cursor: str,
                         budget: ReplayBudget) -> None:
        """The batch after the current one, read while the current one goes out: a
        remote store works meanwhile instead of waiting for the next request. Only
        with room in the budgets: the client has yet to take the current one."""
        room = min(BATCH_BYTES, budget.room(held_by(s)))
        if room < MIN_READ:
            return
        lease = budget.lease(room)
        try:
            batch = await store.history(queue, cursor=cursor, max_count=BATCH,
                                        max_bytes=room)
        except (ValueError, StoreError):
            lease.release()
            return  # read again in its turn, which tells what is wrong
        except BaseException:
            lease.release()
            raise
        self._drop_ahead()
        lease.resize(batch_bytes(batch))
        self.ahead, self._ahead_lease = (cursor, batch), lease

    async def _note_overlap(self, store: Store, s: Session, queue: str) -> None:
        """F's end now that the history's end is fixed, and the topics of its entries
        since `w` (the live cursor, held there while the history lasts)."""
        w2 = await store.queue_end(queue)
        w = s.cursors.get(queue)
        if w is None:  # (restored without an offsets record) live goes on from here
            s.cursors[queue] = w = w2
        w_start = w
        topics: set[str] = set()
        while w < w2:
            res = await store.pull(queue, w, min(256, w2 - w))
            topics.update(m.topic for m in res.messages if m.offset_in(queue) < w2)
            if res.next_offset <= w:
                break
            w = res.next_offset
        self.w2 = w2
        self.overlap = {t: self.ends.get(t, 0) for t in topics}
        log.debug("replay of %r for %r: live from %d, %d messages over %d topics may also "
                  "be in its history", queue, s.client_id, s.cursors[queue], w2 - w_start,
                  len(topics))

    # -- live, after the history ---------------------------------------------------------------
    def replayed(self, s: Session, queue: str, offset: int, msg: Message) -> bool:
        """Whether a live message of F (at `offset`) was handed out by the history."""
        w2 = self.w2
        if w2 is None or offset >= w2:
            self.finish(s, queue, offset + 1)
            return False
        last = self.overlap.get(msg.topic)
        if last is None:
            return False
        try:
            return msg.offset_in(msg.topic) < last
        except KeyError:  # in no exact-topic queue: never in a history
            return False


def held_by(s: Session) -> int:
    """Bytes of history the replays of `s` hold."""
    return sum(r.held for r in s.replays.values()) if s.replays else 0
