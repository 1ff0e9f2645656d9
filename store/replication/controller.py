"""The group's controller: Raft from pysyncobj, embedded in every store node (no extra
process). The replicated state is small: who is master and of which epoch, the in-sync
set, each node's last report (native address, log end, last epoch) and how many reports
each node has made. The Raft leader runs the election rule (`choose_master`, sans-IO);
every node applies the state to itself (store.replication.node).

The rules that keep acknowledged writes safe, as RocketMQ 5's controller and Kafka's
KRaft keep them:

- **Leases, in the right order.** A master acknowledges only while it holds a lease: a
  report it made as master of its epoch, committed by Raft, renews it for `lease_s`
  from the moment the report was *sent* (its own monotonic clock). The controller deems
  a master dead only `dead_s` (> `lease_s`) after it *applied* the master's last report
  (the leader's own monotonic clock). A report is applied after it was sent, so the
  master's lease always ends before anyone may be elected in its place. No wall-clock
  time taken on one node is ever compared with another's.
- **Elections are conditional on what the leader saw.** `elect` carries how many reports
  the master had made when the leader judged it dead; if another report of the master
  reached the log before the election, the election is void. A report applied after an
  election answers False: the old master learns it is deposed and renews nothing.
- **The in-sync set is the controller's.** A master changes it only through
  `set_insync`, committed before it counts (store.replication.node), and only a live
  member of the committed set may be elected.

Raft needs a majority of the group's nodes up and talking: without it no report commits,
no lease is renewed, so the master steps down and nobody is elected until a majority
meets again.

A node out of disk space (`full` in its reports) is never elected, and a master that
reports it is full has stopped acknowledging (it dropped its lease before that report
was sent), so its successor is elected at once instead of `dead_s` later. The Raft
journal is store.replication.journal's: a full disk makes its writes fail (this node
takes no part in the group's decisions until they work again), it never kills the node.

Raft messages are authenticated with the group secret (pysyncobj's `password`: every
frame is encrypted and HMAC-checked before it is deserialised) and the port binds only
the address given (store.replication.raft_transport has the connection limits)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pysyncobj import FAIL_REASON, SyncObj, SyncObjConf, replicated

from store.replication import journal, raft_transport

log = logging.getLogger("lightgate.store.controller")

HEARTBEAT_S = 0.5  # how often each node reports (and the master renews its lease)
TICK_S = 0.05  # the Raft thread's poll period
JOURNAL_FILE = "raft.journal"
HANDOVER_S = 2.0  # a Raft leader short of journal space hands over at most this often
QUIET_S = 60.0  # a warning pysyncobj repeats every tick is let through this often


class _Quieter(logging.Filter):
    """pysyncobj tries a snapshot that failed again on the next tick, with a WARNING
    each time (a full disk: ten a second): let each message through once a minute."""

    def __init__(self) -> None:
        super().__init__()
        self._last: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        now = time.monotonic()
        key = str(record.msg)
        if now - self._last.get(key, -QUIET_S) < QUIET_S:
            return False
        self._last[key] = now
        return True


_QUIETER = _Quieter()


def full(info: dict[str, Any]) -> bool:
    """Whether a node's report says its disk is full (it takes no writes)."""
    return bool(info.get("full"))


@dataclass(frozen=True)
class RaftConfig:
    """This node's place in the Raft group."""

    bind: str  # HOST:PORT the Raft port listens on
    advertise: str  # HOST:PORT peers dial (and this node's Raft identity)
    peers: list[str]  # the other nodes' advertised Raft addresses
    secret: str | None = None  # the group secret; None only on loopback


class GroupState(SyncObj):
    """{master, epoch, in-sync set, nodes, report counts}, replicated by Raft. Methods
    marked @replicated run in the Raft thread, in log order, on every node."""

    def __init__(self, cfg: RaftConfig, data_dir: Path | None) -> None:
        conf = SyncObjConf(
            bindAddress=cfg.bind, password=cfg.secret,
            autoTick=False, commandsWaitLeader=False, dynamicMembershipChange=False,
            useFork=False, raftMinTimeout=0.4, raftMaxTimeout=1.2,
            connectionRetryTime=1.0, connectionTimeout=2.0, maxBindRetries=1,
            # A leader that has not heard from a majority for this long steps down, so
            # the status of a cut-off node does not name itself leader for 30 s.
            leaderFallbackTimeout=2.0,
            tcp_keepalive=(1, 1, raft_transport.LINK_DEAD_S),
            journalFile=str(data_dir / JOURNAL_FILE) if data_dir else None,
            fullDumpFile=str(data_dir / "raft.dump") if data_dir else None,
        )
        # Set before SyncObj.__init__: pysyncobj leaves these out of its snapshots.
        self._lock = threading.Lock()
        self.seen: dict[str, float] = {}  # node -> when this process applied its report
        super().__init__(cfg.advertise, cfg.peers, conf,
                         transportClass=raft_transport.GuardedTransport)
        # Set after: the replicated state, which pysyncobj's snapshots carry.
        self.master = ""
        self.epoch = 0
        self.insync: list[str] = []
        self.nodes: dict[str, dict[str, Any]] = {}
        self.reports: dict[str, int] = {}

    @replicated
    def report(self, node: str, info: dict[str, Any], master_epoch: int) -> bool:
        """A node's heartbeat: its native address, log end (`offset`), last epoch and, in
        sync mode as master, the offset it acknowledged up to (`acked`). True if the
        node is the master of `master_epoch`: its lease is renewed."""
        with self._lock:
            self.nodes[node] = dict(info)
            self.reports[node] = self.reports.get(node, 0) + 1
            self.seen[node] = time.monotonic()  # local: this process's clock only
            return bool(master_epoch) and self.master == node and self.epoch == master_epoch

    @replicated
    def elect(self, expected_epoch: int, master_reports: int, node: str, epoch: int) -> bool:
        """Make `node` master of `epoch`, if nothing changed since the leader judged:
        same epoch, and the old master made no report since (it was alive after all)."""
        with self._lock:
            if self.epoch != expected_epoch or epoch <= self.epoch:
                return False
            if full(self.nodes.get(node, {})):
                return False
            if self.master:
                # A master that reports it is full has stepped down: its reports since
                # do not void the election, unless one says it has room again.
                if (self.reports.get(self.master, 0) != master_reports
                        and not full(self.nodes.get(self.master, {}))):
                    return False
                if node not in self.insync:
                    return False
            self.master, self.epoch, self.insync = node, epoch, [node]
            return True

    @replicated
    def set_insync(self, epoch: int, node: str, members: list[str]) -> bool:
        """The master of `epoch` changes its in-sync set (itself included)."""
        with self._lock:
            if epoch != self.epoch or node != self.master or node not in members:
                return False
            self.insync = sorted(members)
            return True

    def view(self) -> dict[str, Any]:
        """A copy of the state, with `ages`: seconds since this process applied each
        node's last report (its own monotonic clock; a node it has not heard from since
        it started counts from its start)."""
        with self._lock:
            return {"master": self.master, "epoch": self.epoch, "insync": list(self.insync),
                    "nodes": {k: dict(v) for k, v in self.nodes.items()},
                    "reports": dict(self.reports), "seen": dict(self.seen)}


def choose_master(view: dict[str, Any], ages: dict[str, float], dead_s: float,
                  group_size: int) -> tuple[str, int] | None:
    """The election rule, run by the Raft leader. `ages`: seconds since the leader
    applied each node's last report. A master silent for `dead_s` is dead (its lease,
    shorter, ended before), and one that reports its disk full has stepped down; its
    successor is the live member of the committed in-sync set with the longest log and
    room on its disk, never one whose log ends before what the master last said it had
    acknowledged. The first master (none yet) waits for a majority of nodes to report.
    Returns (node, new epoch) or None (no election now)."""
    nodes = view["nodes"]
    alive = {n for n in nodes if ages.get(n, float("inf")) <= dead_s}
    master = view["master"]
    if master and master in alive and not full(nodes[master]):
        return None
    if not master:
        if len(alive) < group_size // 2 + 1:
            return None
        candidates = {n for n in alive if not full(nodes[n])}
    else:
        acked = int(nodes.get(master, {}).get("acked", 0))
        candidates = {n for n in view["insync"] if n in alive and n != master
                      and not full(nodes[n]) and int(nodes[n].get("offset", 0)) >= acked}
    if not candidates:
        return None
    best = max(candidates, key=lambda n: (int(nodes[n].get("offset", 0)), n))
    epoch = max([view["epoch"], *(int(i.get("last_epoch", 0)) for i in nodes.values())]) + 1
    return best, epoch


class Controller:
    """This node's handle on the group state: reports and the lease they renew,
    elections when leader, in-sync proposals. pysyncobj runs in a thread of its own that
    lives as long as the node (ticking by hand: its own tick thread would stop with the
    thread that built it)."""

    def __init__(self, node_id: str, cfg: RaftConfig, data_dir: Path | None,
                 dead_s: float) -> None:
        self.node_id = node_id
        self.dead_s = dead_s
        self.group_size = len(cfg.peers) + 1
        self.started = time.monotonic()
        self.last_commit: float | None = None  # when our last committed report was sent
        self.lease_epoch = 0  # the epoch of the lease held ...
        self.lease_from = 0.0  # ... and when the report that renewed it was sent
        self.lease_void_before = 0.0  # reports sent before this renew nothing (dropped)
        self._lease_lock = threading.Lock()  # the Raft thread renews, the node drops
        self.deposed_epoch = 0  # a report as master of this epoch answered False
        self.journal_error: str | None = None  # why the Raft journal cannot be written
        self._journal_path = str(data_dir / JOURNAL_FILE) if data_dir else None
        self._handover_at = 0.0
        self._electing = threading.Event()
        self._closed = threading.Event()
        self._built = threading.Event()
        self._error: BaseException | None = None
        self.state: GroupState | None = None
        raft_transport.install()
        journal.install()
        logging.getLogger("pysyncobj").addFilter(_QUIETER)
        logging.getLogger("pysyncobj.syncobj").addFilter(_QUIETER)
        self._thread = threading.Thread(target=self._run, args=(cfg, data_dir),
                                        name="raft", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._error is not None:
            raise self._error

    def _run(self, cfg: RaftConfig, data_dir: Path | None) -> None:
        try:
            self.state = GroupState(cfg, data_dir)
        except BaseException as exc:  # noqa: BLE001 - raised in the constructing thread
            self._error = exc
            return
        finally:
            self._built.set()
        state = self.state
        while not self._closed.is_set():
            try:
                state.doTick(TICK_S)
            except OSError as exc:  # its journal: a full disk, say (pysyncobj retries)
                self._journal_failed(exc)
                time.sleep(TICK_S)
                continue
            except Exception:  # noqa: BLE001 - one bad tick must not end the controller
                log.exception("controller tick failed")
                time.sleep(TICK_S)
                continue
            if self.journal_error is not None and not self._journal_short():
                log.warning("controller: its Raft journal is written again")
                self.journal_error = None
            self._hand_over()
        state.destroy()

    def _journal(self) -> journal.ReservedJournal | None:
        return None if self._journal_path is None else journal.opened(self._journal_path)

    def _journal_short(self) -> bool:
        j = self._journal()
        return j is not None and j.short is not None

    def _journal_failed(self, exc: OSError) -> None:
        """Said once: until its journal takes writes again, this node's Raft makes no
        promise (no vote, no entry), as if it were down; the others go on without it."""
        if self.journal_error is None:
            log.error("controller: cannot write its Raft journal (%s): this node takes no "
                      "part in the group's decisions until it can", exc)
        self.journal_error = str(exc)

    def _hand_over(self) -> None:
        """A Raft leader whose journal has no room left to grow hands leadership to a
        node with room (pysyncobj's TimeoutNow), before its reserve runs out and no
        report of any node can commit."""
        if not self._journal_short() or time.monotonic() - self._handover_at < HANDOVER_S:
            return
        state = self.state
        if state is None or not state._isLeader():
            return
        if all(full(info) for n, info in self.view()["nodes"].items() if n != self.node_id):
            return  # every other node is full too: no better leader
        self._handover_at = time.monotonic()
        log.warning("controller: its Raft journal is short of space: handing Raft "
                    "leadership to another node")
        state.transferLeadership()

    # -- what this node says, and the lease it gets back ------------------------------
    def report(self, info: dict[str, Any], master_epoch: int) -> None:
        """Report this node (any thread); as master of `master_epoch`, renew the lease."""
        sent = time.monotonic()

        def done(result: Any, err: int) -> None:  # in the Raft thread
            if err != FAIL_REASON.SUCCESS:
                return
            self.last_commit = max(self.last_commit or 0.0, sent)
            if master_epoch and not result:
                self.deposed_epoch = max(self.deposed_epoch, master_epoch)
            with self._lease_lock:  # one sent before the lease was dropped renews nothing
                if (result and master_epoch and sent > self.lease_void_before
                        and (master_epoch != self.lease_epoch or sent > self.lease_from)):
                    self.lease_epoch, self.lease_from = master_epoch, sent

        assert self.state is not None
        try:
            self.state.report(self.node_id, info, master_epoch, callback=done)
        except Exception as exc:  # noqa: BLE001 - the queue is full: try next time
            log.debug("controller report not sent: %s", exc)

    def drop_lease(self) -> None:
        """Give up the lease now (a master stepping down by itself): no report sent
        until now renews it, even one committed later."""
        with self._lease_lock:
            self.lease_void_before = time.monotonic()
            self.lease_epoch, self.lease_from = 0, 0.0

    @property
    def fresh(self) -> bool:
        """Whether the state this node reads is at least as new as a report it made
        since it started (its own journal, read at start, may be old: a master killed
        and restarted may have been replaced meanwhile)."""
        return self.last_commit is not None

    def lease_left(self, epoch: int, lease_s: float, now: float | None = None) -> float:
        """Seconds left of this node's lease as master of `epoch` (<= 0: none)."""
        if self.lease_epoch != epoch or epoch == 0:
            return 0.0
        return self.lease_from + lease_s - (time.monotonic() if now is None else now)

    def silent_s(self, now: float | None = None) -> float:
        """Seconds since the report of ours that the controller last committed was sent
        (since this node started, if none yet)."""
        now = time.monotonic() if now is None else now
        return now - (self.last_commit if self.last_commit is not None else self.started)

    # -- the state -------------------------------------------------------------------
    def view(self) -> dict[str, Any]:
        assert self.state is not None
        view = self.state.view()
        now = time.monotonic()
        seen = view.pop("seen")
        view["ages"] = {n: now - max(seen.get(n, self.started), self.started)
                        for n in view["nodes"]}
        return view

    @property
    def leader(self) -> str | None:
        assert self.state is not None
        leader = self.state._getLeader()
        return None if leader is None else str(getattr(leader, "address", leader))

    def is_leader(self) -> bool:
        assert self.state is not None
        return bool(self.state._isLeader())

    def step(self, on_elect: Callable[[str, int], None] | None = None) -> None:
        """The Raft leader's duty: elect a master when there is none alive."""
        if not self.is_leader() or self._electing.is_set():
            return
        view = self.view()
        choice = choose_master(view, view["ages"], self.dead_s, self.group_size)
        if choice is None:
            return
        node, epoch = choice
        master = view["master"]
        if master and full(view["nodes"].get(master, {})):
            log.warning("controller: master %r stepped down, its disk full; electing %s "
                        "for epoch %d", master, node, epoch)
        else:
            log.warning("controller: master %r silent for %.1f s; electing %s for epoch "
                        "%d", master or None, view["ages"].get(master, 0.0), node, epoch)
        self._electing.set()

        def done(result: Any, err: int) -> None:
            self._electing.clear()
            if err == FAIL_REASON.SUCCESS and result and on_elect is not None:
                on_elect(node, epoch)

        assert self.state is not None
        try:
            self.state.elect(view["epoch"], view["reports"].get(master, 0), node, epoch,
                             callback=done)
        except Exception as exc:  # noqa: BLE001 - no leader any more: next tick
            self._electing.clear()
            log.debug("election not sent: %s", exc)

    def set_insync(self, epoch: int, members: list[str],
                   done: Callable[[bool], None]) -> None:
        """Propose the in-sync set; `done(committed)` is called in the Raft thread."""
        def cb(result: Any, err: int) -> None:
            done(err == FAIL_REASON.SUCCESS and bool(result))

        assert self.state is not None
        try:
            self.state.set_insync(epoch, self.node_id, members, callback=cb)
        except Exception as exc:  # noqa: BLE001 - proposed again on the next tick
            log.debug("in-sync proposal not sent: %s", exc)
            done(False)

    def close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self._thread.join(5)
