"""A replica's steady-state copy on the native plane (unless LIGHTGATE_GROUP_NATIVE=0): once
the copy loop (store.replication.follower) has made its first fetch of a connection
(the fork check) and has no cut, start-over or metadata snapshot under way, the native
engine takes the log's tail and a Rust loop (serving.lightgate_native.ReplicaCopy,
native/src/replica.rs) fetches and writes each answer's bytes at the master's offset,
with no interpreter per answer. The engine's dispatch feeds the index as it does a
master's appends (store.engine_tail), and the producers' table follows the records of
idempotent producers it hands over.

Python keeps everything rare, handed up as events: metadata changes (applied here; the
loop reports the new change sequence only after), the master's epoch history, the read
limit reaching what readers wait for, an answer only Python takes (a cut, a start-over
page, a snapshot page: returned to the copy loop, which takes it with the Python writer
back), and every failure. The engine is the replica's writer only between `run`'s start
and its end, under `Replication.engine_lock`, which the master's engine
(store.replication.native_master) takes too: the two roles never overlap."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
import trio

from serving import plane
from store.common import StoreError
from store.replication.epochs import Epoch, EpochFile

log = logging.getLogger("lightgate.store.follower")

EVENT_WAIT_S = 1.0  # a thread waits this long in Rust for the next event, then again


class Node(Protocol):
    """What the native copy uses of its node (store.replication.node.Replication)."""

    store: Any
    cfg: Any
    node_id: str
    native_addr: str
    epochs: EpochFile
    master_end: int
    meta_complete: bool
    master_confirmed: int | None
    space: Any
    write_error: str | None
    native_copy: bool
    copier: Any
    native_copied: list[int]
    native_events: dict[str, int]
    engine_lock: trio.Lock

    def readers_waiting(self) -> bool: ...

    def still_following(self, master_addr: str, epoch: int) -> bool: ...

    def confirm(self, upto: int | None) -> None: ...

    def confirmed_natively(self) -> None: ...

    def adopt_epochs(self, master_history: list[Epoch]) -> None: ...

    def write_failed(self, exc: BaseException) -> bool: ...


@dataclass(frozen=True)
class Fetch:
    """What the copy loop's fetches ask (store.replication.follower's constants)."""

    wait_ms: int
    max_bytes: int
    inline_ops: int  # metadata changes applied in the event loop, more in a thread


def ready(repl: Node, pos: Any) -> bool:
    """Whether the native loop may take over the copy now."""
    return (repl.native_copy and plane.NATIVE is not None
            and hasattr(plane.NATIVE, "ReplicaCopy")
            and not pos.check and pos.snap is None and pos.restart is None
            and repl.space.full is None and repl.write_error is None)


async def run(repl: Node, master_addr: str, epoch: int, pos: Any, fetch: Fetch
              ) -> tuple[dict[str, Any], bytes, int] | None:
    """Copy natively until the loop stops: an answer for Python to take (header, body,
    the offset it was fetched at), or None (halted, or writing failed: said to the
    master by the next fetch, Python's). A connection lost raises StoreError."""
    store, log_ = repl.store, repl.store.commitlog
    async with repl.engine_lock:
        if not repl.still_following(master_addr, epoch):
            return None
        engine = await trio.to_thread.run_sync(log_.start_engine, 1,
                                               store.config.default_partitions)
        log_.copying = True
        copier = None
        try:
            # The role may have changed while the engine started: from here to the
            # loop's start nothing else runs in the event loop (`_stop_following` halts
            # a loop that runs; one that has not started must not start after it).
            if not repl.still_following(master_addr, epoch):
                return None
            secret = repl.cfg.raft_secret
            copier = plane.NATIVE.ReplicaCopy(
                engine, master_addr, repl.node_id, repl.native_addr, epoch,
                secret.encode() if secret else None, repl.cfg.credentials,
                orjson.dumps(repl.epochs.history).decode(), pos.meta["inc"],
                int(pos.meta["seq"]), repl.meta_complete, repl.master_confirmed,
                fetch.wait_ms, fetch.max_bytes)
            repl.copier = copier
            copier.set_readers(repl.readers_waiting())
            log.info("copying from %s natively from log offset %d", master_addr,
                     engine.write_pos)
            return await _events(repl, copier, master_addr, epoch, pos, fetch)
        finally:
            with trio.CancelScope(shield=True):
                await _stop(repl, copier, master_addr, epoch)


async def _stop(repl: Node, copier: Any, master_addr: str, epoch: int) -> None:
    """Halt the loop (nothing written after), hand the log back to the Python writer."""
    log_ = repl.store.commitlog
    if copier is not None:
        await trio.to_thread.run_sync(copier.halt)
        answers, copied = copier.copied
        repl.native_copied[0] += answers
        repl.native_copied[1] += copied
    await trio.to_thread.run_sync(log_.hand_back)
    log_.copying = False
    if copier is None:
        return
    if repl.copier is copier:
        repl.copier = None
    if repl.still_following(master_addr, epoch):
        repl.master_end = copier.master_end
        repl.confirm(copier.confirmed)


async def _events(repl: Node, copier: Any, master_addr: str, epoch: int, pos: Any,
                  fetch: Fetch) -> tuple[dict[str, Any], bytes, int] | None:
    store = repl.store
    while True:
        ev = await trio.to_thread.run_sync(copier.next_event, EVENT_WAIT_S,
                                           abandon_on_cancel=True)
        if ev is None:
            continue
        kind = ev[0]
        repl.native_events[kind] = repl.native_events.get(kind, 0) + 1
        if kind == "confirmed":
            repl.confirmed_natively()
        elif kind == "ops":
            meta = orjson.loads(ev[1])["meta"]
            ops = meta["ops"]
            try:
                if len(ops) <= fetch.inline_ops:  # as the master wrote them: inline
                    store.meta.apply(ops)
                else:
                    await trio.to_thread.run_sync(store.meta.apply, ops)
            except Exception as exc:  # noqa: BLE001 - sorted by write_failed
                if not repl.write_failed(exc):  # (a full disk: RocksDB's plain errors)
                    raise
                return None  # not applied: Python's copy asks for them again
            pos.meta["inc"], pos.meta["seq"] = meta["inc"], int(meta["seq"])
            copier.meta_applied(pos.meta["inc"], pos.meta["seq"])
        elif kind == "epochs":
            history = orjson.loads(ev[1])["epochs"]
            store.commitlog.catch_up()  # (the log's end as far as the loop wrote it)
            if repl.still_following(master_addr, epoch):
                repl.adopt_epochs([(int(e), int(s)) for e, s in history])
        elif kind == "handover":
            return orjson.loads(ev[2]), ev[3], int(ev[1])
        else:  # "stopped"
            _, why, write, errno = ev
            if write:
                repl.write_failed(OSError(errno or 0, why))
                return None
            if why == "stopped":
                return None
            raise StoreError(why)
