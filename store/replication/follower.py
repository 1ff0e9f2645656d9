"""A replica's copy loop: long-poll the master's CommitLog from this node's log end
(REPL_FETCH), write the same bytes at the same offsets, dispatch them to the local index,
and apply the master's metadata changes. The first fetch of each connection sends this
node's epoch history: where it forked from the master's, the master says where to cut.

A write that fails (a full disk) is said to the master with the next fetch, which takes
the replica out of the in-sync set at once; while its disk is full the replica writes
nothing, and asks for one record a second to stay known to the master as alive.

On the native plane (unless LIGHTGATE_GROUP_NATIVE=0) the steady state (plain log bytes, one
answer after another) is copied by a Rust loop (store.replication.native_copy), which
hands back to this one whatever else an answer holds."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from store import protocol as p
from store.client import NativeClient
from store.common import StoreError
from store.replication import native_copy
from store.replication.epochs import Epoch

log = logging.getLogger("lightgate.store.follower")

# How long the master holds a fetch at its log's end (the tests' may be longer).
FETCH_WAIT_MS = int(os.environ.get("LIGHTGATE_REPL_FETCH_WAIT_MS", "1000"))
FETCH_MAX_BYTES = 4 << 20
RETRY_S = 0.3
BLOCKED_POLL_S = 1.0  # unable to write: how often it asks the master (and tries again)
BLOCKED_MAX_BYTES = 64 << 10  # and how much it asks for (a record or so, to try)
# Metadata changes applied in the event loop, as the master applied them (a session's
# in-flight state, an offset commit: a RocksDB batch of a few keys, tens of µs; a hop
# to a thread and back cost more); more in one answer go to a thread.
INLINE_OPS = 256
NATIVE_FETCH = native_copy.Fetch(FETCH_WAIT_MS, FETCH_MAX_BYTES, INLINE_OPS)


class Replica(native_copy.Node, Protocol):
    """What the copy loop uses of its node (store.replication.node.Replication): what
    the native copy does (store.replication.native_copy), and the rest."""

    lazy_fetch: trio.CancelScope | None

    def wrote(self) -> None: ...

    async def cut(self, offset: int) -> None: ...

    async def restart(self, offset: int, floors: dict[str, int], default_floor: int,
                      master_history: list[Epoch], first: bool, last: bool) -> None: ...

    async def write(self, offset: int, data: bytes, base: int) -> None: ...

    def mark_meta(self, complete: bool) -> None: ...


@dataclass
class _Position:
    """Where a copy loop stands beyond the log's end (which the log itself holds)."""

    meta: dict[str, Any] = field(default_factory=lambda: {"inc": "", "seq": 0})
    snap: list[Any] | None = None  # a snapshot being copied in pages: inc, seq, cursor
    restart: list[Any] | None = None  # starting over amid floors pages: offset, last queue
    check: bool = True  # send the epoch history (the first fetch of a connection)


async def follow(repl: Replica, master_addr: str, epoch: int) -> None:
    """Copy from `master_addr` until cancelled (reconnecting on errors)."""
    store = repl.store
    if await trio.to_thread.run_sync(store.commitlog.repair_index):
        log.warning("the index was ahead of the log (a start-over cut short): rebuilt")
    pos = _Position()
    while True:
        try:
            secret = repl.cfg.raft_secret
            async with NativeClient.open(master_addr, credentials=repl.cfg.credentials,
                                         node=(repl.node_id, secret.encode()) if secret
                                         else None,
                                         connect_timeout=2.0) as client:
                pos.check = True
                handed: tuple[dict[str, Any], bytes, int] | None = None
                while True:
                    if not repl.still_following(master_addr, epoch):
                        return
                    blocked = repl.space.full or repl.write_error
                    if handed is not None:  # the native loop's answer, Python's to take
                        header, body, offset = handed
                        handed = None
                    else:
                        offset = store.commitlog.max_offset
                        # Lazy while no reader waits here: a new read limit alone does
                        # not answer it (a reader that starts waiting cuts it short).
                        lazy = not blocked and not repl.readers_waiting()
                        with trio.CancelScope() as scope:
                            repl.lazy_fetch = scope if lazy else None
                            header, body = await client.request(p.REPL_FETCH, {
                                "node": repl.node_id, "addr": repl.native_addr,
                                "offset": offset, "epoch": epoch,
                                "epochs": repl.epochs.history if pos.check else None,
                                "meta_inc": pos.meta["inc"], "meta_seq": pos.meta["seq"],
                                "meta_complete": repl.meta_complete, "snap": pos.snap,
                                "restart": pos.restart, "confirmed": repl.master_confirmed,
                                "write_error": blocked, "lazy": lazy,
                                "wait_ms": 0 if blocked else FETCH_WAIT_MS,
                                "max_bytes": BLOCKED_MAX_BYTES if blocked else FETCH_MAX_BYTES,
                            }, timeout=FETCH_WAIT_MS / 1000 + 10)
                        repl.lazy_fetch = None
                        if scope.cancelled_caught:
                            continue  # a reader waits: the same fetch again, eager
                    # The role may have changed while the request was out (promoted, or
                    # told to follow another master): then the answer is not ours to apply.
                    if not repl.still_following(master_addr, epoch):
                        return
                    # Unable to write, it tells the master at once (the next fetch), then
                    # asks again at a slower pace; full, it writes nothing meanwhile (its
                    # readers still see what it holds, up to the master's read limit).
                    full = repl.space.full is not None
                    try:
                        await _take(repl, header, body, offset, master_addr, epoch, pos,
                                    write=not full)
                    except Exception as exc:  # noqa: BLE001 - sorted by write_failed
                        if not repl.write_failed(exc):
                            raise
                        full = True
                    if full:
                        if blocked:
                            await trio.sleep(BLOCKED_POLL_S)
                        continue
                    repl.wrote()
                    if native_copy.ready(repl, pos):  # the steady state: natively
                        handed = await native_copy.run(repl, master_addr, epoch, pos,
                                                       NATIVE_FETCH)
        except Exception as exc:  # noqa: BLE001 - sorted below
            leaf = _leaf(exc)
            if isinstance(leaf, ValueError):  # the master's bytes do not continue our log
                log.error("replication from %s: %s", master_addr, leaf)
            elif isinstance(leaf, (StoreError, p.RemoteError, OSError, trio.TooSlowError)):
                log.info("replication from %s interrupted: %s", master_addr, leaf)
            else:
                raise
        await trio.sleep(RETRY_S)


async def _take(repl: Replica, header: dict[str, Any], body: bytes, offset: int,
                master_addr: str, epoch: int, pos: _Position, *, write: bool = True
                ) -> None:
    """Apply one answer of the master's: a cut, a start-over page, or log bytes and
    metadata changes. `write=False`: only what needs no disk (the master's read limit)."""
    store = repl.store
    if "truncate_to" in header:
        if write:
            await repl.cut(int(header["truncate_to"]))
        return
    if "restart_at" in header and not write:
        return
    if "restart_at" in header:
        at, nxt = int(header["restart_at"]), header["next"]
        await repl.restart(at, header["floors"], int(header["default_floor"]),
                           [(int(e), int(s)) for e, s in header["epochs"]],
                           bool(header["first"]), nxt is None)
        pos.restart = None if nxt is None else [at, nxt]
        return
    if int(header.get("epoch") or 0) < epoch:
        raise StoreError(f"{master_addr} answers as master of epoch "
                         f"{header.get('epoch')}, before epoch {epoch}")
    pos.check = False  # this log does not fork from the master's: its reads are safe
    repl.master_end = int(header["end"])
    if body and write:
        await repl.write(offset, body, int(header["base"]))
    repl.confirm(header.get("confirmed"))
    if not write:
        return
    meta = header.get("meta") or {}
    if "page" in meta:
        pos.snap = await _copy_page(repl, meta)
        if pos.snap is None:  # the last page: the changes since it began next
            pos.meta["inc"], pos.meta["seq"] = meta["inc"], int(meta["seq"])
    elif meta:
        ops = meta.get("ops")
        if ops and len(ops) <= INLINE_OPS:  # as the master wrote them: inline
            store.meta.apply(ops)
        elif ops:
            await trio.to_thread.run_sync(store.meta.apply, ops)
        pos.meta["inc"], pos.meta["seq"] = meta["inc"], int(meta["seq"])
    if repl.still_following(master_addr, epoch):
        repl.adopt_epochs([(int(e), int(s)) for e, s in header["epochs"]])


async def _copy_page(repl: Replica, meta: dict[str, Any]) -> list[Any] | None:
    """Apply one page of the master's metadata snapshot; what to ask for next (None:
    that was the last). Until then the metadata is incomplete (see mark_meta)."""
    last = meta["next"] is None
    if not (meta["first"] and last):  # one page alone is applied atomically
        repl.mark_meta(False)
    await trio.to_thread.run_sync(repl.store.meta.load_page, meta["page"], meta["first"])
    if last:
        repl.mark_meta(True)
        return None
    return [meta["inc"], int(meta["seq"]), *meta["next"]]


@contextmanager
def moot_when_stopped() -> Iterator[None]:
    """Around `follow` in a scope that stops it: a stop (a new role, a new master) that
    comes as the master's connection fails leaves trio a group of the cancellation and
    the failure. The scope takes the cancellation and the failure went on up: it ended
    the store node. Stopped, the failure is moot; it is logged, and the stop goes on."""
    try:
        yield
    except BaseExceptionGroup as group:
        cancelled, rest = group.split(trio.Cancelled)
        if cancelled is None:
            raise
        log.info("replication stopped as it failed: %r", rest and _leaf(rest))
        raise cancelled from None


def _leaf(exc: BaseException) -> BaseException:
    """The one exception inside nested single-member groups (trio nurseries wrap)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
