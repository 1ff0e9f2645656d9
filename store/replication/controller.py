"""The group's controller: Raft from pysyncobj, embedded in every store node (no extra
process). The replicated state is small: who is master, its epoch, the in-sync set, and
each node's last report (native address, log end, last epoch, wall-clock time). The Raft
leader runs the election rule (`choose_master`, sans-IO); every node applies the state
to itself (store.replication.node).

Raft needs a majority of the group's nodes up and talking: without it no election
happens, and the master keeps serving as long as its replicas keep fetching from it
(see Replication._fence)."""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pysyncobj import FAIL_REASON, SyncObj, SyncObjConf, replicated

log = logging.getLogger("lightgate.store.controller")

HEARTBEAT_S = 0.5


class GroupState(SyncObj):
    """{master, epoch, in-sync set, nodes}, replicated by Raft."""

    def __init__(self, self_addr: str, partners: list[str], data_dir: Path | None) -> None:
        host, _, port = self_addr.rpartition(":")
        conf = SyncObjConf(
            # A host name (a pod's DNS name): listen on every interface at its port.
            bindAddress=None if _is_ip(host) else f"0.0.0.0:{port}",
            autoTick=True, commandsWaitLeader=False, dynamicMembershipChange=False,
            useFork=False, raftMinTimeout=0.4, raftMaxTimeout=1.2,
            connectionRetryTime=1.0, connectionTimeout=2.0,
            journalFile=str(data_dir / "raft.journal") if data_dir else None,
            fullDumpFile=str(data_dir / "raft.dump") if data_dir else None,
        )
        self.master = ""
        self.epoch = 0
        self.insync: list[str] = []
        self.nodes: dict[str, dict[str, Any]] = {}
        super().__init__(self_addr, partners, conf)

    @replicated
    def report(self, node: str, native: str, offset: int, last_epoch: int, ts: float) -> None:
        self.nodes[node] = {"native": native, "offset": offset, "last_epoch": last_epoch,
                            "ts": ts}

    @replicated
    def elect(self, expected_epoch: int, node: str, epoch: int) -> bool:
        """Make `node` master of `epoch`, if nobody changed the state since the caller
        looked (`expected_epoch`)."""
        if self.epoch != expected_epoch or epoch <= self.epoch:
            return False
        self.master, self.epoch, self.insync = node, epoch, [node]
        return True

    @replicated
    def set_insync(self, epoch: int, node: str, members: list[str]) -> bool:
        """The master of `epoch` reports its in-sync set (itself included)."""
        if epoch != self.epoch or node != self.master:
            return False
        self.insync = list(members)
        return True

    def view(self) -> dict[str, Any]:
        return {"master": self.master, "epoch": self.epoch, "insync": list(self.insync),
                "nodes": {k: dict(v) for k, v in self.nodes.items()}}


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def choose_master(view: dict[str, Any], now: float, dead_s: float, group_size: int
                  ) -> tuple[str, int] | None:
    """The election rule, run by the Raft leader. A master whose last report is older
    than `dead_s` is dead; its successor is the live node of the in-sync set with the
    longest log (a node that reported after the master stopped: its log end is final).
    The first master (none yet) waits for a majority of nodes to report. Returns (node,
    new epoch) or None (no election now)."""
    nodes = view["nodes"]
    alive = {n for n, info in nodes.items() if now - info["ts"] <= dead_s}
    master = view["master"]
    if master and master in alive:
        return None
    if not master:
        if len(alive) < group_size // 2 + 1:
            return None
        candidates = alive
    else:
        candidates = {n for n in view["insync"] if n in alive and n != master}
    if not candidates:
        return None
    best = max(candidates, key=lambda n: (nodes[n]["offset"], n))
    epoch = max([view["epoch"], *(info.get("last_epoch", 0) for info in nodes.values())]) + 1
    return best, epoch


class Controller:
    """This node's handle on the group state: reports, and elections when leader."""

    def __init__(self, node_id: str, peers: list[str], data_dir: Path | None,
                 dead_s: float) -> None:
        self.node_id = node_id
        self.peers = [x for x in peers if x != node_id]
        self.dead_s = dead_s
        self.group_size = len(self.peers) + 1
        self.state = GroupState(node_id, self.peers, data_dir)
        self.last_commit = 0.0  # monotonic time our last report was committed
        self._electing = threading.Event()
        self.isolated = False  # fault injection: behave as cut off from the controller
        self._closed = False

    def report(self, native: str, offset: int, last_epoch: int) -> None:
        if self.isolated:
            return

        def done(_: Any, err: int) -> None:
            if err == FAIL_REASON.SUCCESS:
                self.last_commit = time.monotonic()

        try:
            self.state.report(self.node_id, native, offset, last_epoch, time.time(),
                              callback=done)
        except Exception as exc:  # noqa: BLE001 - the queue is full: try next time
            log.debug("controller report not sent: %s", exc)

    def view(self) -> dict[str, Any]:
        return self.state.view()

    @property
    def leader(self) -> str | None:
        leader = self.state._getLeader()
        return None if leader is None else str(getattr(leader, "address", leader))

    def is_leader(self) -> bool:
        return not self.isolated and self.state._isLeader()

    def step(self, on_elect: Callable[[str, int], None] | None = None) -> None:
        """The Raft leader's duty: elect a master when there is none alive."""
        if not self.is_leader() or self._electing.is_set():
            return
        view = self.view()
        choice = choose_master(view, time.time(), self.dead_s, self.group_size)
        if choice is None:
            return
        node, epoch = choice
        log.warning("controller: master %r is gone; electing %s for epoch %d",
                    view["master"] or None, node, epoch)
        self._electing.set()

        def done(result: Any, err: int) -> None:
            self._electing.clear()
            if err == FAIL_REASON.SUCCESS and result and on_elect is not None:
                on_elect(node, epoch)

        self.state.elect(view["epoch"], node, epoch, callback=done)

    def set_insync(self, epoch: int, members: list[str]) -> None:
        if self.isolated:
            return
        try:
            self.state.set_insync(epoch, self.node_id, members, callback=lambda *_: None)
        except Exception as exc:  # noqa: BLE001 - reported again on the next change
            log.debug("in-sync report not sent: %s", exc)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.state.destroy()
