"""A persistent session on the native plane (docs/native-plane.md, "Persistent
sessions"): what the handover keeps for it beside the connection. Its delivery waits for
its promotion (`Deferred`); the engine holds each batch of its QoS 1 sends until their one
record is in the store, reports where its queues resume and which batches completed, and
hands back its sends in flight, each with its queue and offset (`Records`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio

from gateway import offline_bound
from gateway.mqtt import protocol as mp
from gateway.native_link import NativeStream
from gateway.session import Session, batch_key, batch_prefix, offset_key, out_key
from serving.rate_limited_log import RateLimitedLog

log = logging.getLogger("lightgate.gateway.handover")
_not_kept = RateLimitedLog(log)  # a store that refuses writes refuses each batch's

Op = tuple[str, str, str, Any]
# A persistent session whose delivery waits for its promotion gets it from Python after
# all if it is still not promoted after this long.
DEFER_S = 2.0


def carried(conn: Any) -> bool:
    """Whether a persistent session's connection may go to the engine (given a store in
    this process): plain TCP, or a TLS or WebSocket connection the engine accepted (not
    Python's own listeners'), no replay, and no QoS 0 subscription (a persistent session
    resumes at the first QoS 0 message its socket did not take, which Python's delivery
    keeps track of; a QoS 0 message for a QoS 1 subscription hands the connection back
    before it, too)."""
    s = conn.session
    ours = conn.reactor is not None and conn.stream is None \
        or type(conn.stream) is NativeStream
    return ours and not s._replays \
        and all(sub.options.qos > 0 for sub in s.subscriptions.values())


def settled(s: Session) -> bool:
    """Nothing of a persistent session's is under way in Python: what was in flight was
    resent and acknowledged, its QoS 2 exchanges are complete, and where it resumes is
    in the store before the engine reports its own progress."""
    return not (s._outgoing or s._incoming_qos2 or s.has_dirty_offsets())


def from_positions(s: Session) -> None:
    """At the promotion of a persistent session restored with nothing in flight: every
    offset up to its restored bound was acknowledged (one that was not has a record,
    and Python resent it), so each queue starts past it; the queues with news are read
    from the positions."""
    for queue, upto in (s._restored_upto or {}).items():
        if s.cursors.get(queue, upto + 1) <= upto:
            s.cursors[queue] = upto + 1
    s._restored_upto = None
    s._dirty = None


class Deferred:
    """Connections whose session's delivery waits for their promotion: since when. The
    offline bound (--max-offline-messages, --max-offline-bytes) moves their cursors
    first, as Python's resume does, and is in the store before it is promoted."""

    def __init__(self, looked_at: Callable[[Any], None]) -> None:
        self._since: dict[Any, float] = {}
        self._bounding: set[Any] = set()
        self._looked_at = looked_at  # (the handover's `consider`)

    def add(self, conn: Any) -> None:
        self._since[conn] = trio.current_time()
        conn.delivery.waits = True
        self._bounding.add(conn)
        conn.spawn(self._bound, conn)

    def bounding(self, conn: Any) -> bool:
        """Its offline bound is not applied yet (not to be promoted)."""
        return conn in self._bounding

    async def _bound(self, conn: Any) -> None:
        s, broker = conn.session, conn.broker
        try:
            await offline_bound.apply(s, broker)
            if s.has_dirty_offsets():
                await broker.flush_offsets(s)
        finally:
            self._bounding.discard(conn)
            self._looked_at(conn)

    def forget(self, conn: Any) -> None:
        """Promoted, or gone: nothing to start."""
        self._since.pop(conn, None)
        self._bounding.discard(conn)

    def overdue(self, conn: Any, now: float) -> bool:
        return now - self._since.get(conn, now) > DEFER_S

    def start(self, conn: Any) -> None:
        """Not promoted: its delivery starts in Python (the connection stays here)."""
        if self._since.pop(conn, None) is not None and conn.native is None \
                and conn.delivery is not None and conn.alive:
            log.debug("client %r not promoted: Python delivers its session's backlog",
                      conn.session.client_id)
            conn.delivery.waits = False
            conn.delivery.start(resume=True)


class Records:
    """The records of persistent sessions' native sends, gathered from one take of the
    engine's reports and written in one metadata write (`write`), in the order the
    engine reported them; `meta_now` writes in the caller's thread (an embedded store's;
    None: no persistent session is carried)."""

    def __init__(self, engine: Any, meta_now: Callable[[list[Op]], None] | None) -> None:
        self.engine = engine
        self._meta_now = meta_now
        self.ops: list[Op] = []
        self.kept: list[tuple[int, int]] = []  # (conn, batch) to let go once written

    @property
    def enabled(self) -> bool:
        return self._meta_now is not None

    def take(self, row: tuple[Any, ...], promoted: dict[int, Any]) -> None:
        """A report of a promoted connection's: ("keep", conn, batch, runs) or
        ("progress", conn, positions, done)."""
        conn = promoted.get(row[1])
        if conn is None or conn.session is None or self._meta_now is None:
            return
        if row[0] == "keep":
            self.keep(conn.session, *row[1:])
        else:
            self.progress(conn.session, *row[2:])

    def keep(self, s: Session, conn_id: int, batch: int,
             runs: list[tuple[int, str, int, int]]) -> None:
        """The engine holds a batch of sends until their record is in the store: one
        record for the batch, its sends in runs (first packet id, queue, first offset,
        count: consecutive ids and offsets)."""
        self.ops.append(("put", "inflight", batch_key(s.client_id, batch),
                         {"runs": runs, "qos": 1}))
        self.kept.append((conn_id, batch))

    def progress(self, s: Session, positions: dict[str, tuple[int, int]],
                 done: list[int]) -> None:
        """Where the queues resume, and the batches completed: their records go in the
        same write (else a crash after the one and before the other would bring
        acknowledged messages back as new ones)."""
        for queue, (acked, nxt) in positions.items():
            if queue in s.subscriptions:
                self.ops.append(("put", "offsets", offset_key(s.client_id, queue),
                                 {"acked": acked, "next": nxt}))
                if s.cursors.get(queue, -1) < nxt:  # what was sent, as a demotion says
                    s.cursors[queue] = nxt  # it (the admin API shows it meanwhile)
        self.ops.extend(("delete", "inflight", batch_key(s.client_id, b), None)
                        for b in done)

    def write(self) -> None:
        """What was gathered, in one write; then the batches kept go out. A write that
        fails (a full disk, the store away) hands the connections of the batches back:
        what was not sent is Python's to send, as its own records allow. Progress not
        written leaves batch records behind, which after a crash only resend with DUP
        (as Python's completed sends whose records were not removed do)."""
        if not self.ops or self._meta_now is None:
            return
        ops, kept = self.ops, self.kept
        self.ops, self.kept = [], []
        try:
            self._meta_now(ops)
        except Exception as exc:  # noqa: BLE001 - the batches' connections go back
            _not_kept.note(f"in-flight records of native sends not written (their "
                           f"connections go back to Python): {exc}")
            for conn_id in {c for c, _ in kept}:
                self.engine.release(conn_id)
            return
        for conn_id, batch in kept:
            self.engine.kept(conn_id, batch)

    def handed_back(self, s: Session, outgoing: list[mp.Outgoing]) -> None:
        """A session back from the engine: its sends in flight get the records Python's
        plane keeps, and its batch records go, in one write."""
        if self._meta_now is None:
            return
        ops: list[Op] = [("delete_prefix", "inflight", batch_prefix(s.client_id), None)]
        ops.extend(("put", "inflight", out_key(s.client_id, o.packet_id),
                    {"queue": o.queue, "offset": o.offset, "state": o.state, "qos": o.qos})
                   for o in outgoing if o.queue is not None)
        try:
            self._meta_now(ops)
        except Exception as exc:  # noqa: BLE001 - the batch records stay, and hold
            # every send in flight: a restart rewrites them (resent with DUP)
            _not_kept.note(f"in-flight records of sends handed back from the native "
                           f"plane not rewritten (their batch records stay): {exc}")
