"""A store group's master on the native plane: while this node is master the native
engine writes its log and the native server (native/src/server.rs, store.carried)
carries its authenticated connections, answering PUBLISH natively; as a replica it
copies as store.replication.follower says (natively: store.replication.native_copy).

- Becoming master (`Replication.on_master`): the engine takes the log's tail, a native
  server is started on it (answers held for the in-sync set in sync mode: `hold`), and
  connections authenticated from then on are carried.
- The group's rules reach the native server from `Replication`: the acknowledged offset
  (`acked`, as `confirmed` moves), whether writes are refused and why (`sync_native`:
  no lease, no in-sync quorum, a full disk, not master), and a step-down (`fail_held`,
  then `drop_clients` closes the carried connections).
- Stopping being master (`Replication.before_follow`, before the copy starts): the
  server stops, the engine stops and hands the tail back to the Python writer.

- The replicas' REPL_FETCH: the steady ones (no epoch history, snapshot, start-over or
  write error; metadata current) are answered by the native server while this node is
  master, long polls included, and their offsets release held answers there by the
  in-sync rule `Replication` pushes (`_sync_native_fetch`); Python hears of the
  replicas' positions in batches (`Replication.native_fetched`). The rest come to
  `Replication.handle_fetch` as before.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import trio

from serving import plane
from store.config import ReplicationConfig
from store.replication.node import MASTER, Replication

if TYPE_CHECKING:
    from store.server import NativeServer
    from store.service import EmbeddedStore

log = logging.getLogger("lightgate.store.replication")


def group_native(repl: ReplicationConfig | None) -> bool:
    """Whether a group's node runs natively (the master's server and writer, the
    replicas' fetches and copy): on the native plane, unless LIGHTGATE_GROUP_NATIVE=0
    keeps the group's nodes on Python's writer and server (the reference, and a way
    back should the native group misbehave)."""
    return (plane.NATIVE is not None and repl is not None
            and os.environ.get("LIGHTGATE_GROUP_NATIVE", "1") != "0")


class NativeMaster:
    def __init__(self, store: EmbeddedStore, server: NativeServer, repl: Replication,
                 nursery: trio.Nursery) -> None:
        self.store = store
        self.server = server
        self.repl = repl
        self.nursery = nursery
        self._lock = repl.engine_lock  # (the replica's native copy holds it too)
        self._scope: trio.CancelScope | None = None
        self._done: trio.Event | None = None
        self.started = 0  # masterships served natively
        repl.on_master = self._want
        repl.before_follow = self.stop

    def _want(self) -> None:
        self.nursery.start_soon(self._start)

    async def _start(self) -> None:
        async with self._lock:
            repl, store = self.repl, self.store
            if repl.role != MASTER or self._scope is not None:
                return
            await trio.to_thread.run_sync(store._start_engine)
            native = plane.NATIVE.StoreServer(store.engine)
            # Sync mode: answers wait for the in-sync set (async: at once).
            native.hold(repl.cfg.ack_timeout_s if repl.cfg.mode == "sync" else 0.0)
            native.acked(max(0, repl.confirmed))
            repl.metalog.tap = None  # (told from its position on: `_sync_native_fetch`)
            repl.native, repl._native_said = native, None
            repl._native_fetch = repl._native_rule = None
            repl.sync_native()
            self.server.carry(native)
            carrier = self.server.carrier
            assert carrier is not None
            carrier.on_appended = self._appended
            carrier.on_fetched = repl.native_fetched
            self._scope, self._done = trio.CancelScope(), trio.Event()
            self.started += 1
            await self.nursery.start(self._run, carrier, self._scope, self._done)
            log.info("master of epoch %d: the native engine writes the log and the native "
                     "server answers PUBLISH", repl.epoch)

    @staticmethod
    async def _run(carrier: Any, scope: trio.CancelScope, done: trio.Event, *,
                   task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            with scope:
                await carrier.run(task_status=task_status)
        finally:
            done.set()

    def _appended(self) -> None:
        """Native appends were made (told in asynchronous replication only, where they
        count as acknowledged at once): into the index now, so that replicas' long polls
        that Python answers (REPL_FETCH reads up to the dispatched end) wake without the
        dispatch's pause. In sync mode the dispatcher takes them after its pause, and
        readers wait for the acknowledgement anyway."""
        self.store.commitlog.catch_up()
        if self.repl.cfg.mode != "sync":
            self.repl._acked_now()  # (acknowledged at once)

    async def stop(self) -> None:
        """The native server stops and the engine hands the log back (before a copy)."""
        async with self._lock:
            if self._scope is None or self._done is None:
                return
            self.repl.native = None
            self.repl.metalog.tap = None
            self.server.carrier = None
            self._scope.cancel()
            await self._done.wait()
            self._scope = self._done = None
            self.store.native_budget.unshare()  # (Python's connections read on)
            await trio.to_thread.run_sync(self.store.commitlog.hand_back)
            self.store.recent.want = None
            log.info("not master: the Python writer has the log again")
