"""One store node's part in its group: its role (master, replica, fenced), the master's
side of replication (REPL_FETCH, the in-sync set, acknowledgements held until
`min_insync` nodes have the bytes), the replica's copy loop (store.replication.follower)
and, with --group-peers, the controller that says who is master.

A node out of disk space (store.replication.space) stays up: it refuses writes with the
reason, serves reads, steps down if it is master (the controller elects a node with
room), and takes writes or copies again by itself once there is room."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from store import protocol as p
from store.common import DISK_FULL, StoreClosedError, StoreError, StoreFullError
from store.config import ReplicationConfig
from store.record import dumps_json
from store.replication.controller import HEARTBEAT_S, Controller, RaftConfig
from store.replication.epochs import Epoch, EpochFile, fork_point, implicit
from store.replication.follower import follow, moot_when_stopped
from store.replication.insync import InSync
from store.replication.metalog import MetaLog
from store.replication.space import Space, no_space
from store.segment import fsync_dir

if TYPE_CHECKING:
    from store.record import Message
    from store.service import EmbeddedStore

log = logging.getLogger("lightgate.store.replication")

MASTER, REPLICA, FENCED = "master", "replica", "fenced"
MAX_WAIT_MS = 5000
# Queues' index floors in one answer (about 5 MB); the HA tests make pages of a few.
FLOORS_PAGE = int(os.environ.get("LIGHTGATE_REPL_FLOORS_PAGE", "100000"))
SNAPSHOT_PAGE_BYTES = 8 << 20  # of metadata keys and values in one answer (frames: 64 MiB)
META_INCOMPLETE_FILE = "metadata.incomplete"  # a replica amid a paged snapshot
# An in-sync proposal the controller has not answered within this long is sent again.
PROPOSAL_RETRY_S = 2.0
# Appends whose readers wait to be told, kept apart at most (then merged, names and all).
UNTOLD_MAX = 1024
# Native requests a replica refuses: they change the log or the metadata.
WRITE_CODES = frozenset({
    p.SEND, p.PUBLISH, p.COMMIT, p.NACK, p.TOPIC_CREATE, p.META_PUT, p.META_DELETE,
    p.META_WRITE, p.WILDCARD_ADD, p.HEARTBEAT, p.USER_ADD, p.USER_UPDATE, p.USER_DELETE,
    p.ACL_ADD, p.ACL_DELETE, p.PRODUCER_INIT,
})


# Native requests that change metadata: in sync mode answered once replicated.
META_CODES = (p.COMMIT, p.TOPIC_CREATE, p.META_PUT, p.META_DELETE, p.META_WRITE,
              p.WILDCARD_ADD, p.USER_ADD, p.USER_UPDATE, p.USER_DELETE, p.ACL_ADD,
              p.ACL_DELETE, p.PRODUCER_INIT)


class Replication:
    def __init__(self, store: EmbeddedStore, cfg: ReplicationConfig, native_addr: str) -> None:
        self.store = store
        self.cfg = cfg
        self.native_addr = native_addr
        self.node_id = cfg.node_id or cfg.raft_advertise or cfg.raft or native_addr
        self.epochs = EpochFile(Path(store.config.data_dir))
        self.role = REPLICA
        self.epoch = 0  # the epoch this node is master of (when master)
        self.became_master = 0.0  # monotonic time it did
        self.master_addr: str | None = cfg.replica_of
        self.followed_epoch = 0  # as a replica: the epoch of the master it follows
        self.master_end = 0  # as a replica: the master's log end at the last fetch
        self.insync = self._new_insync()
        self.metalog = MetaLog(self._wake_soon)
        self.space = Space()
        self.write_error: str | None = None  # as a replica: why its last copy failed
        self._unsaved_epoch: tuple[int, int] | None = None  # mastered, not yet recorded
        self.controller: Controller | None = None
        self.drop_clients: Callable[[], None] = lambda: None  # set by the native server
        # While master on the native plane: the native server that answers PUBLISH
        # (serving.lightgate_native.StoreServer, store.replication.native_master). It
        # is told the acknowledged offset, the refusals and the step-downs.
        self.native: Any = None
        self._native_said: tuple[int, str] | None = None  # its last refusal (0: none)
        # What it was last told of the fetches it answers and of the in-sync rule.
        self._native_fetch: tuple[Any, ...] | None = None
        self._native_rule: tuple[Any, ...] | None = None
        self.on_master: Callable[[], None] = lambda: None  # (became master)
        self.before_follow: Callable[[], Awaitable[None]] | None = None  # (a replica now)
        self.truncated_bytes = 0
        self.restarted_bytes = 0  # dropped starting over after the master's retention
        self._incomplete = Path(store.config.data_dir) / META_INCOMPLETE_FILE
        self.meta_complete = not self._incomplete.exists()
        self.confirmed = 0  # sync mode: every node of the in-sync set holds the log to here
        # As a replica: the master's read limit (None: none); 0 until its first answer.
        self.master_confirmed: int | None = 0
        self._held: deque[tuple[int, set[str]]] = deque()  # copied, not yet readable
        # As master in sync mode: appended, readers not yet told (they are once the
        # in-sync set holds it, acknowledged or not: an ack that timed out is still read).
        self._untold: deque[tuple[int, set[str]]] = deque()
        self.notify: Callable[[set[str]], None] = lambda names: None  # readers: queues grew
        self._follow_scope: trio.CancelScope | None = None
        self._grew = trio.Event()
        self._token = trio.lowlevel.current_trio_token()
        self._trio_thread = threading.get_ident()
        self._nursery: trio.Nursery | None = None
        self._meta_waiters: list[tuple[int, trio.Event]] = []
        self.fetches = 0  # as master: fetches answered
        self._eager = 0  # as master: fetches waiting that a new read limit answers
        # As a replica: whether a reader waits here (the native server's pulls), and the
        # scope of a lazy fetch a reader that starts waiting cuts short (`reader_waits`).
        self.readers_waiting: Callable[[], bool] = lambda: True
        self.lazy_fetch: trio.CancelScope | None = None
        # As a replica on the native plane (store.replication.native_copy): whether the
        # steady-state copy may be native, the Rust loop while it runs, and what such
        # loops copied (answers, bytes); the answers Python's writer took meanwhile.
        self.native_copy = False
        self.copier: Any = None
        self.native_copied = [0, 0]
        self.native_events: dict[str, int] = {}  # what the native loops handed up, by kind
        self.python_writes = 0
        # Held while the native engine writes the log in one role or the other (the
        # replica's copy, the master's appends): they never overlap.
        self.engine_lock = trio.Lock()
        # Per epoch this node was master of: monotonic times of its first and last
        # acknowledgement (nodes on one host compare them: never two at once).
        self.ack_times: dict[int, list[float]] = {}

    def _new_insync(self) -> InSync:
        return InSync(self.node_id, self.cfg.min_insync, self.cfg.max_lag_bytes,
                      self.cfg.max_lag_s)

    def bind(self, native_addr: str) -> None:
        """The native address the server bound (what clients and replicas dial)."""
        native_addr = self.cfg.advertise or native_addr
        if self.node_id == self.native_addr:
            self.node_id = native_addr
            self.insync = self._new_insync()
        self.native_addr = native_addr

    # -- the lease ----------------------------------------------------------------------
    def has_lease(self) -> bool:
        """Whether this node may acknowledge writes now: it is master and (in a group
        with a controller) its lease from the controller has not run out."""
        if self.role != MASTER:
            return False
        ctl = self.controller
        return ctl is None or ctl.lease_left(self.epoch, self.cfg.lease_s) > 0

    def _check_lease(self) -> None:
        """Step down when the lease runs out (no report of ours committed for lease_s:
        cut off from a majority, or deposed); take writes again once renewed."""
        ctl = self.controller
        if ctl is None:
            return
        left = ctl.lease_left(self.epoch, self.cfg.lease_s)
        if (self.role == FENCED and left > 0 and self.space.full is None
                and self._epoch_saved()):
            log.warning("lease from the controller again: master of epoch %d takes writes",
                        self.epoch)
            self.role = MASTER
        elif (self.role == MASTER and left <= 0
              and time.monotonic() - self.became_master > self.cfg.lease_s):
            log.error("no lease from the controller for %.1f s (its reports are not "
                      "committed: a majority is out of reach, or another master was "
                      "elected): stepping down as master of epoch %d", ctl.silent_s(),
                      self.epoch)
            self.role = FENCED
            self._fail_pending("this store node lost its lease as master: the write may "
                               "or may not be kept; send it again")
            self.drop_clients()

    # -- disk space ----------------------------------------------------------------------
    def _check_space(self) -> None:
        try:
            st = os.statvfs(self.store.config.data_dir)
        except OSError:
            return
        changed = self.space.measured(st.f_bavail * st.f_frsize)
        if changed is True:
            self._now_full()
        elif changed is False:
            log.warning("room on this store node's disk again (%d MiB free): it takes "
                        "writes and copies again", st.f_bavail * st.f_frsize >> 20)
            if self.role == FENCED and self.controller is None and self._epoch_saved():
                self.role = MASTER

    def _epoch_saved(self) -> bool:
        """Record the epoch this node became master of on a full disk; False while it
        still cannot (it takes no write before)."""
        if self._unsaved_epoch is None:
            return True
        epoch, start = self._unsaved_epoch
        try:
            self.epochs.start(epoch, start, self.store.commitlog.max_offset)
        except Exception as exc:
            if not no_space(exc):
                raise
            self.disk_failed(exc)
            return False
        self._unsaved_epoch = None
        return True

    def disk_failed(self, exc: BaseException) -> None:
        """A write of this node failed (any thread): if for want of space, it is full."""
        if threading.get_ident() != self._trio_thread:
            try:
                self._token.run_sync_soon(self.disk_failed, exc)
            except trio.RunFinishedError:
                pass
            return
        if self.space.failed(exc):
            self._now_full()

    def _now_full(self) -> None:
        """Out of space: refuse writes, and as master step down, giving up the lease
        before the report that says so leaves, so a successor may be elected at once."""
        stepping_down = self.role in (MASTER, FENCED)
        log.error("no space left on this store node's disk (%s): it refuses writes%s, "
                  "until %d MiB are free", self.space.full,
                  f" and steps down as master of epoch {self.epoch}" if stepping_down
                  else "", self.space.room_again >> 20)
        if stepping_down:
            self.role = FENCED
            if self.controller is not None:
                self.controller.drop_lease()
            # Its clients stay, told why their writes are refused, until the controller
            # elects a master with room: becoming a replica then sends them there.
            self._fail_pending("no space left on the store node's disk: the write may "
                               "or may not be kept; send it again")
        self.sync_native()
        if self.controller is not None:  # now, not at the next tick: elect another, or
            self.controller.report(self._report_info(), 0)  # not this one

    def write_failed(self, exc: BaseException) -> bool:
        """As a replica: writing what it copied failed. Said to the master with the next
        fetch (it leaves the in-sync set at once). False if `exc` is no write failure
        (a log that does not continue the master's: the copy loop's own business)."""
        if not (no_space(exc) or isinstance(exc, (OSError, StoreClosedError))
                or type(exc) is Exception):  # RocksDB's errors are plain Exceptions
            return False
        if self.write_error is None:
            log.error("this replica cannot write what it copies (%s): it leaves the in-sync "
                      "set until it can", exc)
        self.write_error = str(exc) or type(exc).__name__
        self.disk_failed(exc)
        return True

    def wrote(self) -> None:
        if self.write_error is not None:
            log.warning("this replica writes what it copies again")
            self.write_error = None

    def _watch(self, fut: Any) -> None:
        def done(f: Any) -> None:
            exc = f.exception()
            if exc is not None and no_space(exc):
                self.disk_failed(exc)
        fut.add_done_callback(done)

    def _fail_pending(self, why: str) -> None:
        if self.native is not None:
            self.native.fail_held(why)
        for outer, _ in self.insync.drain():
            if not outer.done():
                outer.set_exception(StoreError(why))

    def _acked_now(self) -> None:
        now = time.monotonic()
        span = self.ack_times.setdefault(self.epoch, [now, now])
        span[1] = now

    # -- hooks the store and the native server call -----------------------------------
    def refused(self) -> StoreError | None:
        """Why this node takes no write now (None: it does)."""
        if self.role == REPLICA:
            where = f"the master at {self.master_addr}" if self.master_addr else "the master"
            return StoreError(f"this store node is a replica: writes go to {where}")
        if self.space.full is not None:
            return StoreFullError(f"{DISK_FULL} ({self.space.full}): "
                                  "writes are refused until space is freed")
        if not self.has_lease():
            return StoreError("this store node holds no lease from the group's controller "
                              "(cut off, or just elected): writes are refused until it does")
        if self.cfg.mode == "sync" and not self.insync.enough():
            out = self.insync.why_out()
            return StoreError(
                f"only {len(self.insync.committed)} of the {self.cfg.min_insync} in-sync "
                "nodes --min-insync asks for are up" + (f" ({out})" if out else "")
                + ": writes are refused")
        return None

    def sync_native(self) -> None:
        """Tell the native server whether it takes PUBLISH now (as `refused` says)."""
        if self.native is None:
            return
        why = self.refused()
        said = (0, "") if why is None else (
            507 if isinstance(why, StoreFullError) else 503, str(why))
        if said != self._native_said:  # (called per fetch report: said on change)
            self._native_said = said
            self.native.refuse_writes(*said)
        self._sync_native_fetch()

    def _sync_native_fetch(self, force: bool = False) -> tuple[int, dict[str, int]]:
        """Tell the native server what it answers replicas' fetches with (while master)
        and the in-sync rule it releases held answers by (as `_release` computes
        `confirmed`); `force`: the rule (the lease's time left) though it did not change.
        Returns the acknowledged offset the native side had when the rule took effect,
        and the required replicas' offsets as it knows them ({} if not told)."""
        native = self.native
        if native is None:
            return self.confirmed, {}
        if self.metalog.tap is None:  # (a new mastership's change log: from its start)
            native.meta(self.metalog.incarnation, self.metalog.seq)
            self.metalog.tap = native.meta_ops
        log_ = self.store.commitlog
        history = implicit(self.epochs.history, log_.max_offset)
        fetch = (self.role == MASTER, self.epoch, tuple(history))
        if fetch != self._native_fetch:
            self._native_fetch = fetch
            if self.role == MASTER:
                native.fetching(self.epoch, dumps_json([list(x) for x in history]).decode(),
                                str(log_.dir), self.cfg.mode == "sync")
            else:  # (a full master that stepped down still feeds them: Python does)
                native.stop_fetching()
        isr = self.insync
        rule = (tuple(sorted(isr.required())), isr.enough(), self.has_lease())
        if rule == self._native_rule and not force:
            return max(self.confirmed, native.acked_offset()), {}
        self._native_rule = rule
        return native.insync(list(rule[0]), rule[1], self._lease_left())

    def _lease_left(self) -> float:
        if not self.has_lease():
            return 0.0
        ctl = self.controller
        return math.inf if ctl is None else ctl.lease_left(self.epoch, self.cfg.lease_s)

    def native_fetched(self, reports: list[tuple[str, str, int, str, int]]) -> None:
        """Fetches the native server answered (each replica's last): the replicas'
        positions, reported as `handle_fetch` reports them."""
        if self.role != MASTER and self.role != FENCED:
            return
        for node, addr, offset, meta_inc, meta_seq in reports:
            self._report(node, addr, offset)
            self.insync.replicas[node].meta = (meta_seq if meta_inc == self.metalog.incarnation
                                               else -1)
        self._release_meta()

    def write_refusal(self, code: int) -> StoreError | None:
        if code not in WRITE_CODES:
            return None
        why = self.refused()
        return None if why is None or self.role == MASTER else why

    def acked(self, fut: Any) -> Any:
        """The future a caller awaits for an append: in sync mode, settled once every
        node of the in-sync set holds the bytes (or failed after ack_timeout_s)."""
        self._watch(fut)
        if self.cfg.mode != "sync":
            if self.controller is not None:
                fut.add_done_callback(lambda _: self._acked_now())
            return fut
        outer: Future = Future()

        def stored(inner: Any) -> None:
            if threading.get_ident() == self._trio_thread:
                self._settle(inner, outer)
            else:
                self._token.run_sync_soon(self._settle, inner, outer)

        fut.add_done_callback(stored)
        return outer

    def _settle(self, inner: Any, outer: Future) -> None:
        exc = inner.exception()
        if exc is not None:
            outer.set_exception(exc)
            return
        msgs: list[Message] = inner.result()
        end = msgs[-1].phys_offset + msgs[-1].size if msgs else 0
        self.insync.wait(end, time.monotonic() + self.cfg.ack_timeout_s, (outer, msgs))
        self._untell(end, {name for m in msgs for name, _ in m.queues})
        self._release()

    def _untell(self, end: int, names: set[str]) -> None:
        """Readers of `names` are told once the log is acknowledged to `end`."""
        untold = self._untold
        if untold and len(untold) >= UNTOLD_MAX:  # (replicas away: merged, not grown)
            _, more = untold.pop()
            names = names | more
        untold.append((end, names))

    def dispatched(self, names: set[str]) -> None:
        """(Any thread.) The native engine's appends were dispatched, to the log's end
        now: as master in sync mode their readers are told once acknowledged."""
        self._on_trio(self._native_untold, self.store.commitlog.max_offset, names)

    def _on_trio(self, fn: Callable[..., None], *args: Any) -> None:
        """Call `fn` in the event loop: now from its thread, soon from another."""
        if threading.get_ident() == self._trio_thread:
            fn(*args)
        else:
            try:
                self._token.run_sync_soon(fn, *args)
            except trio.RunFinishedError:
                pass

    def _native_untold(self, end: int, names: set[str]) -> None:
        if self.role == REPLICA or self.cfg.mode != "sync":
            return
        self._untell(end, names)
        # The log's end moved here (`_release` acknowledges no further than it): what the
        # replicas last said they hold may be acknowledged now, with no fetch to come.
        self._release()
        self._tell_readers()

    def _release(self) -> None:
        """Acknowledge what every required node holds, while the lease lasts."""
        if not self.has_lease():
            return
        end = self.store.commitlog.max_offset
        before = self.confirmed
        self.confirmed = max(self.confirmed, self.insync.ack_offset(end))
        if self.confirmed > before and self._eager and self.read_limit() is not None:
            self._wake_soon()  # replicas' readers may see more: answer their long polls
        if self.native is not None:
            if self.confirmed > before:  # the native appends held to here go out (if
                self._acked_now()          # the native side did not release them itself)
                if self.confirmed > self.native.acked_offset():
                    self.native.acked(self.confirmed)
            self.sync_native()
        ready = self.insync.ready(self.confirmed)
        for outer, msgs in ready:
            if not outer.done():
                outer.set_result(msgs)
        if ready:
            self._acked_now()
        self._tell_readers()

    def _tell_readers(self) -> None:
        """Readers held back at the read limit may go on to the acknowledged offset."""
        names: set[str] = set()
        untold = self._untold
        while untold and untold[0][0] <= self.confirmed:
            names |= untold.popleft()[1]
        if names:  # readers held back at the read limit may go on
            self.notify(names)

    def _release_meta(self) -> None:
        if not self._meta_waiters or not self.has_lease():
            return
        done = self.insync.meta_quorum(self.metalog.seq)
        keep = []
        for target, ev in self._meta_waiters:
            if target <= done:
                ev.set()
            else:
                keep.append((target, ev))
        self._meta_waiters = keep

    async def meta_synced(self) -> None:
        """Sync mode: wait until every node of the in-sync set applied every metadata
        change made so far (a session, an offset commit, a subscription), or raise
        StoreError after ack_timeout_s."""
        if self.cfg.mode != "sync" or self.role != MASTER:
            return
        target = self.metalog.seq
        if self.has_lease() and self.insync.meta_quorum(target) >= target:
            return
        ev = trio.Event()
        self._meta_waiters.append((target, ev))
        with trio.move_on_after(self.cfg.ack_timeout_s):
            await ev.wait()
        if not ev.is_set():
            raise StoreError(f"metadata not replicated to the in-sync set within "
                             f"{self.cfg.ack_timeout_s:g} s")

    def synced(self, handler: Callable[[p.Frame, Any], Awaitable[tuple[dict, bytes]]]
               ) -> Callable[[p.Frame, Any], Awaitable[tuple[dict, bytes]]]:
        """A native handler that changes metadata, answering once it is replicated. A
        write that finds the disk full makes this node full (RocksDB's errors are plain
        Exceptions: answered 507 with the reason, not a connection ended)."""
        async def run(f: p.Frame, ctx: Any) -> tuple[dict, bytes]:
            try:
                out = await handler(f, ctx)
            except Exception as exc:
                if not no_space(exc):
                    raise
                self.disk_failed(exc)
                raise StoreFullError(f"{DISK_FULL} ({exc})") from exc
            await self.meta_synced()
            return out
        return run

    def read_limit(self) -> int | None:
        """Sync mode, on the master: readers see the log up to the acknowledged offset
        only, so no reader ever sees a message (and its queue offset) that a failover may
        cut; on a replica, up to what its master last said (see `confirm`). None: no
        limit."""
        if self.role == REPLICA:
            return self.master_confirmed
        if self.cfg.mode != "sync":
            return None
        return self.confirmed

    def _expire(self) -> None:
        for outer, _ in self.insync.expired(time.monotonic()):
            if not outer.done():
                outer.set_exception(StoreError(
                    f"not replicated to the in-sync set within {self.cfg.ack_timeout_s:g} s"))

    def grew(self) -> None:
        """The log grew (any thread)."""
        self._wake_soon()

    def _wake_soon(self) -> None:
        if threading.get_ident() == self._trio_thread:
            self._wake()
        else:
            try:
                self._token.run_sync_soon(self._wake)
            except trio.RunFinishedError:
                pass

    def _wake(self) -> None:
        self._grew.set()
        self._grew = trio.Event()
        if self.native is not None:  # its waiting fetches: new bytes, or metadata moved
            self.native.meta(self.metalog.incarnation, self.metalog.seq)

    def hello(self) -> dict[str, Any]:
        return {"role": self.role, "master": self.master_addr, "epoch": self.epochs.last_epoch}

    # -- the master's side: REPL_FETCH --------------------------------------------------
    async def handle_fetch(self, f: p.Frame, ctx: Any) -> tuple[dict[str, Any], bytes]:
        h = f.header
        # A master that stepped down for want of space still feeds its replicas (it is
        # the controller's master until another is elected): their readers see on.
        if self.role != MASTER and not (self.role == FENCED and self.space.full):
            raise StoreError(f"not the master (role {self.role}); the master is "
                             f"{self.master_addr}")
        if int(h.get("epoch") or 0) > self.epoch:  # the replica knows of a later master
            raise StoreError(f"this node was master of epoch {self.epoch}; the group has "
                             f"moved on to epoch {h['epoch']}")
        log_ = self.store.commitlog
        end = log_.max_offset
        engine = log_.engine
        if self.native is not None and engine is not None:
            # The native server answers bytes the dispatch may not have taken yet: a
            # replica holding them is not ahead of this log (the read below waits).
            end = max(end, engine.write_pos)
        offset = int(h["offset"])
        node = str(h["node"])
        history = implicit(self.epochs.history, log_.max_offset)
        if h.get("epochs") is not None:
            theirs = implicit([(int(e), int(s)) for e, s in h["epochs"]], offset)
            keep = fork_point(history, end, theirs, offset)
            if keep < offset:
                log.warning("replica %s forked from this log: it cuts %d bytes from offset "
                            "%d", node, offset - keep, keep)
                return {"truncate_to": keep}, b""
        if offset > end:
            return {"truncate_to": end}, b""
        if offset < log_.min_offset:
            return await self._restart_point(node, offset, h.get("restart"))
        self._report(node, str(h.get("addr", "")), offset, bool(h.get("meta_complete", True)),
                     h.get("write_error"))
        meta_inc, meta_seq = str(h.get("meta_inc", "")), int(h.get("meta_seq", 0))
        self.insync.replicas[node].meta = meta_seq if meta_inc == self.metalog.incarnation else -1
        self._release_meta()
        wait_ms = min(int(h.get("wait_ms", 0)), MAX_WAIT_MS)
        # A lazy replica (no reader waits there) is not answered for a new read limit
        # alone: the next bytes carry it. One answer per append, not two.
        lazy = bool(h.get("lazy"))
        limit = self.read_limit()
        if (offset >= log_.max_offset and wait_ms > 0 and self._meta_current(meta_inc, meta_seq)
                and (limit is None or lazy or h.get("confirmed") == limit)):
            await self._park(offset, meta_inc, meta_seq, lazy, wait_ms)
        self.fetches += 1
        data, base = log_.read_raw(offset, max(1, int(h.get("max_bytes", 1 << 20))))
        changes = self.metalog.since(meta_inc, meta_seq)
        if changes is None:
            meta = await self._snapshot_page(h.get("snap"))
        else:
            ops, seq = changes
            meta = {"inc": self.metalog.incarnation, "seq": seq, "ops": ops}
        return {"end": log_.max_offset, "base": base, "epoch": self.epoch,
                "confirmed": self.read_limit(),
                "epochs": [list(x) for x in history], "meta": meta}, data

    def _meta_current(self, inc: str, seq: int) -> bool:
        return inc == self.metalog.incarnation and seq >= self.metalog.seq

    async def _park(self, offset: int, meta_inc: str, meta_seq: int, lazy: bool,
                    wait_ms: int) -> None:
        """A fetch at the log's end waits for what it is to be answered for: new bytes,
        metadata changes, a new read limit (not a lazy one), or this node's role."""
        if not lazy:
            self._eager += 1
        try:
            with trio.move_on_after(wait_ms / 1000):
                while True:
                    await self._grew.wait()
                    if (not lazy or self.store.commitlog.max_offset > offset
                            or not self._meta_current(meta_inc, meta_seq)
                            or self.role != MASTER):
                        return
        finally:
            if not lazy:
                self._eager -= 1

    async def _snapshot_page(self, snap: list[Any] | None) -> dict[str, Any]:
        """The next page of a metadata snapshot for a replica that needs one: pages as
        big as a frame allows, read at different times, so the replica then replays every
        change after `seq`, the change log's position when the first page was read (ops
        are whole values: applied again over a page that saw them, they change nothing).
        A replica that names a snapshot still valid here carries on with it; else, or
        once the changes since its `seq` are gone from the log, it starts again."""
        inc = self.metalog.incarnation
        if snap and snap[0] == inc and self.metalog.since(inc, int(snap[1]), 0) is not None:
            seq, cursor = int(snap[1]), (str(snap[2]), str(snap[3]))
        else:
            seq, cursor = self.metalog.seq, None
        items, nxt = await trio.to_thread.run_sync(self.store.meta.page, cursor,
                                                   SNAPSHOT_PAGE_BYTES)
        return {"inc": inc, "seq": seq, "page": items, "first": cursor is None,
                "next": list(nxt) if nxt else None}

    async def _restart_point(self, node: str, offset: int, cursor: list[Any] | None
                             ) -> tuple[dict[str, Any], bytes]:
        """A replica whose log ends before this one's start (retention removed what would
        follow it) starts over at this log's start, with the index floors that give each
        queue this node's end, in pages of FLOORS_PAGE queues. A page goes on from the
        replica's cursor while the start stays where it was; once retention moves it, the
        floors start again (floors only rise when retention passes the start)."""
        start = self.store.commitlog.min_offset
        after = str(cursor[1]) if cursor and int(cursor[0]) == start else None
        index = self.store.index
        floors, nxt = await trio.to_thread.run_sync(index.floors_page, after, FLOORS_PAGE)
        if after is None:
            log.warning("replica %s needs offset %d, before this log's start %d (retention "
                        "removed it): it starts over from %d", node, offset, start, start)
        history = implicit(self.epochs.history, self.store.commitlog.max_offset)
        return {"restart_at": start, "floors": floors, "first": after is None, "next": nxt,
                "default_floor": index.default_floor,
                "epochs": [list(x) for x in history]}, b""

    def _report(self, node: str, addr: str, offset: int, meta_complete: bool = True,
                write_error: str | None = None) -> None:
        rep = self.insync.replicas.get(node)
        if write_error and (rep is None or rep.failed is None):
            log.warning("replica %s cannot write what it copies (%s): out of the in-sync "
                        "set", node, write_error)
        elif not write_error and rep is not None and rep.failed is not None:
            log.info("replica %s writes again", node)
        self.insync.report(node, addr, offset, time.monotonic(),
                           self.store.commitlog.max_offset, meta_complete,
                           str(write_error) if write_error else None)
        self._propose_insync()
        self._release()

    def _propose_insync(self) -> None:
        """Ask the controller for the in-sync set this master wants, one proposal at a
        time (sent again if unanswered). Until committed a change does not count:
        joiners are already waited for, leavers still are (see store.replication.insync).
        Without a controller (a fixed --replica-of pair) the master's word is final.
        None while full: the set stays as it is for the election of a successor."""
        if self.space.full is not None:
            return
        isr = self.insync
        want = isr.desired(self.confirmed if self.cfg.mode == "sync" else 0)
        now = time.monotonic()
        if isr.proposed is not None:
            if now - isr.proposed_at < PROPOSAL_RETRY_S:
                return
            want = isr.proposed  # unanswered: the same again (a new one could drop a joiner)
        elif want == isr.committed:
            return
        if self.native is not None and self.cfg.mode == "sync" and not self._native_waits(want):
            return
        if self.controller is None:
            self._insync_committed(self.epoch, want, True)
            return
        isr.proposed, isr.proposed_at = want, now
        epoch = self.epoch

        def done(ok: bool) -> None:  # in the Raft thread
            try:
                self._token.run_sync_soon(self._insync_committed, epoch, want, ok)
            except trio.RunFinishedError:
                pass

        self.controller.set_insync(epoch, sorted(want), done)

    def _native_waits(self, want: set[str]) -> bool:
        """Whether the native server waits for `want`'s joiners from now on, each of them
        holding every byte it acknowledged so far. It releases by the replicas' fetches
        on its own: one it acknowledged past while this was decided joins later."""
        isr = self.insync
        before = isr.proposed
        isr.proposed = want  # (what it waits for: committed | proposed)
        acked, held = self._sync_native_fetch(force=True)
        if any(max(isr._offset_of(n), held.get(n, 0)) < acked
               for n in want - isr.committed):
            isr.proposed = before
            self._sync_native_fetch()
            return False
        return True

    def _insync_committed(self, epoch: int, want: set[str], ok: bool) -> None:
        isr = self.insync
        if epoch != self.epoch or (isr.proposed is not None and isr.proposed != want):
            return  # an answer for another mastership or proposal
        isr.proposed = None
        if ok and want != isr.committed:
            isr.committed = set(want)
            log.info("in-sync set: %s", sorted(want))
        self._release()
        self._release_meta()
        self.sync_native()

    # -- the replica's side ------------------------------------------------------------
    def still_following(self, master_addr: str, epoch: int) -> bool:
        """Whether the copy loop started for (master_addr, epoch) is still wanted: an
        answer that arrives after a change of role or master is dropped unread."""
        return (self.role == REPLICA and self.master_addr == master_addr
                and self.followed_epoch == epoch)

    async def cut(self, offset: int) -> None:
        cut = await trio.to_thread.run_sync(self.store.commitlog.truncate_to, offset)
        self.truncated_bytes += cut
        self.store.recent.clear()
        self.epochs.save([e for e in self.epochs.history if e[1] <= offset])
        log.warning("cut %d bytes of a forked log tail at offset %d (kept in quarantine)",
                    cut, offset)

    async def restart(self, offset: int, floors: dict[str, int], default_floor: int,
                      master_history: list[Epoch], first: bool, last: bool) -> None:
        """Drop this replica's whole log, older than anything the master still holds, and
        start over empty at the master's start: the index first, reset to the master's
        floors page by page, then the log with the last page (a crash in between leaves
        an index ahead of the log, which recovery rebuilds, and the master asks again).
        The epochs that began by then are the master's: a log with bytes before its start
        and no history of its own would read as epoch 0 from 0, forked from everything."""
        store = self.store
        if first:
            self.epochs.save([e for e in master_history if e[1] <= offset])
            await trio.to_thread.run_sync(store.index.reset, offset, floors, default_floor)
        else:
            await trio.to_thread.run_sync(store.index.set_floors, floors)
        if not last:
            return
        dropped = await trio.to_thread.run_sync(store.commitlog.restart_at, offset)
        store.recent.clear()
        self.restarted_bytes += dropped
        log.warning("the master's log starts at %d, after this replica's end: dropped this "
                    "log's %d bytes (past retention) and start over from there", offset,
                    dropped)

    def mark_meta(self, complete: bool) -> None:
        """Amid a snapshot copied in pages the metadata lacks some of the master's: said
        to the master (such a replica is not in sync, so never elected), and kept in a
        file, for a replica killed amid one is still missing them."""
        if complete == self.meta_complete:
            return
        if complete:
            self._incomplete.unlink(missing_ok=True)
        else:
            self._incomplete.touch()
        fsync_dir(self._incomplete.parent)
        self.meta_complete = complete

    async def write(self, offset: int, data: bytes, base: int) -> None:
        self.python_writes += 1
        if self.store.config.flush == "sync":
            msgs = await trio.to_thread.run_sync(self.store.commitlog.write_raw, offset, data,
                                                 base)
        else:
            msgs = self.store.commitlog.write_raw(offset, data, base)
        if self.master_confirmed is not None:  # readers wait for the master's word
            self._held.append((offset + len(data), {q for m in msgs for q, _ in m.queues}))

    def confirm(self, upto: int | None) -> None:
        """The master's read limit: readers of this replica see no more than readers of
        the master do (in sync mode, acknowledged messages only, so none that a failover
        may cut). Readers waiting on queues that became readable are woken."""
        if upto is not None:
            upto = min(upto, self.store.commitlog.max_offset)
            if self.master_confirmed is not None and upto <= self.master_confirmed:
                return
        self.master_confirmed = upto
        names: set[str] = set()
        while self._held and (upto is None or self._held[0][0] <= upto):
            names |= self._held.popleft()[1]
        if names:
            self.notify(names)

    def reader_waits(self) -> None:
        """A pull starts waiting here: if this replica holds bytes its readers may not
        see yet while its fetch is lazy (the master does not answer it for a new read
        limit alone), that fetch is cut short and sent again, eager."""
        if self.copier is not None:  # (the native loop looks at the bytes it holds)
            self.copier.reader_waits()
            return
        scope = self.lazy_fetch
        if (scope is not None and self.role == REPLICA and self.master_confirmed is not None
                and self.master_confirmed < self.store.commitlog.max_offset):
            scope.cancel()

    def copied(self, names: set[str]) -> bool:
        """(Any thread.) The native copy's records were dispatched, to the log's end
        now: their readers are told once the master's read limit passes it. Whether a
        reader waits here: if not, the next dispatch may wait (store.engine_tail's
        lazy pause; a reader that comes dispatches first), at a low rate a wake-up of
        the interpreter a batch of a few messages cost the copy more than the copy."""
        self._on_trio(self._copied, self.store.commitlog.max_offset, names)
        return self.readers_waiting()

    def _copied(self, end: int, names: set[str]) -> None:
        copier = self.copier
        if copier is None or self.role != REPLICA:
            return
        if self.master_confirmed is not None:  # readers wait for the master's word
            self._held.append((end, names))
        copier.set_readers(self.readers_waiting())
        self.master_end = copier.master_end
        self.confirmed_natively()

    def confirmed_natively(self) -> None:
        """The native loop's read limit moved: readers of what became readable are
        told, and the loop says when the next held bytes become readable."""
        copier = self.copier
        if copier is None:
            return
        self.confirm(copier.confirmed)
        copier.watch(self._held[0][0] if self._held else None)

    def adopt_epochs(self, master_history: list[Epoch]) -> None:
        end = self.store.commitlog.max_offset
        self.epochs.save([e for e in master_history if e[1] <= end])

    # -- roles ---------------------------------------------------------------------------
    def become_master(self, epoch: int) -> None:
        """Take writes as master of `epoch` (once its lease comes): stop copying, record
        the epoch's start, and rebuild what a master keeps in memory from the copied
        metadata."""
        self._stop_following()
        store = self.store
        log_end = store.commitlog.max_offset
        self._unsaved_epoch = None
        if self.epochs.last_epoch != epoch:
            try:
                self.epochs.start(epoch, log_end, log_end)
            except Exception as exc:
                if not no_space(exc):
                    raise
                # Elected with a full disk (before it said so): master, fenced, until
                # there is room to record the epoch, before any write is taken.
                self._unsaved_epoch = (epoch, log_end)
                self.space.failed(exc)
        store._load_routes()
        store._keep_readers_ahead()
        store.index.forget_allocations()
        self.metalog = MetaLog(self._wake_soon)
        store.meta.on_change = self.metalog.record
        self._fail_pending("this node's mastership changed")
        self._untold.clear()
        self.insync = self._new_insync()
        self.confirmed = log_end  # what it holds at its election is the group's log
        self.epoch, self.role, self.master_addr = epoch, MASTER, self.native_addr
        self.became_master = time.monotonic()
        log.warning("this node is master of epoch %d from log offset %d", epoch, log_end)
        if self.space.full is not None:
            self._now_full()
        self.on_master()
        if self._nursery is not None and store.auth_reload is not None:
            self._nursery.start_soon(store.auth_reload)

    def become_replica(self, master_addr: str, epoch: int) -> None:
        was = self.role
        self._stop_following()
        self.role, self.master_addr, self.followed_epoch = REPLICA, master_addr, epoch
        self.master_confirmed, self._held = 0, deque()  # until the new master's answer
        self._untold.clear()
        self.store.meta.on_change = None
        self.sync_native()
        self._fail_pending("this node stopped being master")
        if was != REPLICA:
            log.warning("this node is now a replica of %s (epoch %d)", master_addr, epoch)
            self.store.recent.clear()  # it may hold a tail the new master cuts
            self.drop_clients()
        assert self._nursery is not None
        self._nursery.start_soon(self._follow, master_addr, epoch)

    async def _follow(self, master_addr: str, epoch: int) -> None:
        with trio.CancelScope() as scope:
            self._follow_scope = scope
            if self.before_follow is not None:  # the native writer hands the log back
                with trio.CancelScope(shield=True):
                    await self.before_follow()
            with moot_when_stopped():
                await follow(self, master_addr, epoch)

    def _stop_following(self) -> None:
        copier = self.copier
        if copier is not None:  # nothing is copied from here on, and the log's end
            copier.halt()  # is where its copies ended (a new epoch starts there)
            self.store.commitlog.catch_up()
        if self._follow_scope is not None:
            self._follow_scope.cancel()
            self._follow_scope = None

    # -- the node's loop -----------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            cfg = self.cfg
            if cfg.group_peers:
                assert cfg.raft is not None
                raft = RaftConfig(bind=cfg.raft, advertise=cfg.raft_advertise or cfg.raft,
                                  peers=cfg.group_peers, secret=cfg.raft_secret)
                data = Path(self.store.config.data_dir)
                # Built in a thread of its own that lives as long as the node.
                self.controller = await trio.to_thread.run_sync(
                    Controller, self.node_id, raft, data, cfg.dead_s)
            elif cfg.replica_of:
                self.become_replica(cfg.replica_of, 0)
            else:
                self.become_master(max(1, self.epochs.last_epoch))
            task_status.started()
            try:
                while True:
                    self._tick()
                    await trio.sleep(HEARTBEAT_S if self.controller else 0.25)
            finally:
                if self.controller is not None:
                    await trio.to_thread.run_sync(self.controller.close)

    def _tick(self) -> None:
        self._check_space()
        if self.copier is not None:  # the native copy's writes into the log's end here
            self.store.commitlog.catch_up()  # (what the controller hears: elections)
        ctl = self.controller
        if ctl is not None:
            # Full, a master renews no lease: its reports say it stepped down.
            mastering = self.role in (MASTER, FENCED) and self.space.full is None
            ctl.report(self._report_info(), self.epoch if mastering else 0)
            ctl.step()
            if ctl.fresh:  # the journal read at start may be old: wait for the group's word
                try:
                    self._apply(ctl.view())
                except Exception as exc:  # a full disk (the epoch file): next tick
                    if not no_space(exc):
                        raise
                    self.disk_failed(exc)
        if self.role == MASTER or self.role == FENCED:
            self._check_lease()
            self.insync.refresh(time.monotonic(), self.store.commitlog.max_offset)
            self._propose_insync()
            self._release()
            self._release_meta()
            self._expire()
            self.sync_native()
            self._sync_native_fetch(force=True)  # (the lease's time left)

    def _report_info(self) -> dict[str, Any]:
        mastering = self.role in (MASTER, FENCED)
        acked = self.confirmed if mastering and self.cfg.mode == "sync" else 0
        return {"native": self.native_addr, "offset": self.store.commitlog.max_offset,
                "last_epoch": self.epochs.last_epoch, "acked": acked,
                "full": self.space.full or ""}

    def _apply(self, view: dict[str, Any]) -> None:
        """Take the role the controller's state gives this node."""
        master, epoch = view["master"], view["epoch"]
        if not master:
            return
        if master == self.node_id:
            if self.role == REPLICA or self.epoch != epoch:
                self.become_master(epoch)
            isr = self.insync
            committed = set(view["insync"])
            if committed != isr.committed and self.node_id in committed:
                isr.committed = committed  # the controller's word (an answer went astray)
                if isr.proposed == committed:
                    isr.proposed = None
            return
        addr = view["nodes"].get(master, {}).get("native")
        if addr and (self.role != REPLICA or self.master_addr != addr
                     or self.followed_epoch < epoch):
            self.become_replica(addr, epoch)

    # -- ops -------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        log_ = self.store.commitlog
        end = log_.max_offset
        out: dict[str, Any] = {
            "node": self.node_id, "role": self.role, "epoch": self.epochs.last_epoch,
            "master": self.master_addr, "mode": self.cfg.mode, "min_insync": self.cfg.min_insync,
            "log_end": end, "epochs": [list(x) for x in self.epochs.history],
            "truncated_bytes": self.truncated_bytes,
            "restarted_bytes": self.restarted_bytes,
            "disk_full": self.space.full,  # why it takes no writes for want of space
            # monotonic seconds (this host's clock): first and last ack per epoch mastered
            "acked_at": {str(e): [round(a, 3), round(b, 3)]
                         for e, (a, b) in self.ack_times.items()},
        }
        if self.role == MASTER or self.role == FENCED:
            out["insync"] = sorted(self.insync.committed)
            out["insync_proposed"] = (sorted(self.insync.proposed)
                                      if self.insync.proposed is not None else None)
            out["replicas"] = [{"node": r.node, "addr": r.addr, "offset": r.offset,
                                "lag_bytes": end - r.offset,
                                "insync": r.node in self.insync.committed,
                                "write_error": r.failed}
                               for r in self.insync.replicas.values()]
            out["pending_acks"] = self.insync.pending()
            out["fetches"] = self.fetches
            out["native_fetches"] = self.native.fetches if self.native is not None else 0
            out["replicated_offset"] = max(0, self.confirmed)
            if self.controller is not None:
                out["lease_s_left"] = round(
                    max(0.0, self.controller.lease_left(self.epoch, self.cfg.lease_s)), 2)
        else:
            out["lag_bytes"] = max(0, self.master_end - end)
            out["write_error"] = self.write_error
            out["read_limit"] = self.master_confirmed  # what its readers may see (None: all)
            answers, copied = self.native_copied
            if self.copier is not None:
                now = self.copier.copied
                answers, copied = answers + now[0], copied + now[1]
            # answers the native loop wrote, and those Python's writer took
            out["copied"] = {"native_answers": answers, "native_bytes": copied,
                             "python_answers": self.python_writes,
                             "native_events": dict(self.native_events)}
        if self.controller is not None:
            ctl = self.controller
            view = ctl.view()
            out["controller"] = {"leader": ctl.leader, "master": view["master"],
                                 "epoch": view["epoch"], "insync": view["insync"],
                                 "nodes": view["nodes"],
                                 "report_ages_s": {n: round(a, 2)
                                                   for n, a in view["ages"].items()},
                                 "silent_s": round(ctl.silent_s(), 2)}
        return out

    def lag_bytes(self) -> int:
        if self.role == REPLICA:
            return max(0, self.master_end - self.store.commitlog.max_offset)
        end = self.store.commitlog.max_offset
        return max((end - r.offset for r in self.insync.replicas.values()), default=0)
