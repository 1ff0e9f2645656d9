"""A replica's copy loop: long-poll the master's CommitLog from this node's log end
(REPL_FETCH), write the same bytes at the same offsets, dispatch them to the local index,
and apply the master's metadata changes. The first fetch of each connection sends this
node's epoch history: where it forked from the master's, the master says where to cut."""

from __future__ import annotations

import logging
from typing import Any, Protocol

import trio

from store import protocol as p
from store.client import NativeClient
from store.common import StoreError
from store.replication.epochs import Epoch, EpochFile

log = logging.getLogger("lightgate.store.follower")

FETCH_WAIT_MS = 1000
FETCH_MAX_BYTES = 4 << 20
RETRY_S = 0.3


class Replica(Protocol):
    """What the copy loop uses of its node (store.replication.node.Replication)."""

    store: Any
    cfg: Any
    node_id: str
    native_addr: str
    epochs: EpochFile
    master_end: int
    meta_complete: bool
    master_confirmed: int | None

    def still_following(self, master_addr: str, epoch: int) -> bool: ...

    async def cut(self, offset: int) -> None: ...

    async def restart(self, offset: int, floors: dict[str, int], default_floor: int,
                      master_history: list[Epoch], first: bool, last: bool) -> None: ...

    async def write(self, offset: int, data: bytes, base: int) -> None: ...

    def confirm(self, upto: int | None) -> None: ...

    def adopt_epochs(self, master_history: list[Epoch]) -> None: ...

    def mark_meta(self, complete: bool) -> None: ...


async def follow(repl: Replica, master_addr: str, epoch: int) -> None:
    """Copy from `master_addr` until cancelled (reconnecting on errors)."""
    store = repl.store
    if await trio.to_thread.run_sync(store.commitlog.repair_index):
        log.warning("the index was ahead of the log (a start-over cut short): rebuilt")
    meta_pos: dict[str, Any] = {"inc": "", "seq": 0}
    snap: list[Any] | None = None  # a snapshot being copied in pages: inc, seq, cursor
    restart: list[Any] | None = None  # starting over amid floors pages: offset, last queue
    while True:
        try:
            secret = repl.cfg.raft_secret
            async with NativeClient.open(master_addr, credentials=repl.cfg.credentials,
                                         node=(repl.node_id, secret.encode()) if secret
                                         else None,
                                         connect_timeout=2.0) as client:
                check = True
                while True:
                    if not repl.still_following(master_addr, epoch):
                        return
                    offset = store.commitlog.max_offset
                    header, body = await client.request(p.REPL_FETCH, {
                        "node": repl.node_id, "addr": repl.native_addr, "offset": offset,
                        "epoch": epoch, "epochs": repl.epochs.history if check else None,
                        "meta_inc": meta_pos["inc"], "meta_seq": meta_pos["seq"],
                        "meta_complete": repl.meta_complete, "snap": snap,
                        "restart": restart, "confirmed": repl.master_confirmed,
                        "wait_ms": FETCH_WAIT_MS, "max_bytes": FETCH_MAX_BYTES,
                    }, timeout=FETCH_WAIT_MS / 1000 + 10)
                    # The role may have changed while the request was out (promoted, or
                    # told to follow another master): then the answer is not ours to apply.
                    if not repl.still_following(master_addr, epoch):
                        return
                    if "truncate_to" in header:
                        await repl.cut(int(header["truncate_to"]))
                        continue
                    if "restart_at" in header:
                        at, nxt = int(header["restart_at"]), header["next"]
                        await repl.restart(at, header["floors"], int(header["default_floor"]),
                                           [(int(e), int(s)) for e, s in header["epochs"]],
                                           bool(header["first"]), nxt is None)
                        restart = None if nxt is None else [at, nxt]
                        continue
                    if int(header.get("epoch") or 0) < epoch:
                        raise StoreError(f"{master_addr} answers as master of epoch "
                                         f"{header.get('epoch')}, before epoch {epoch}")
                    check = False
                    repl.master_end = int(header["end"])
                    if body:
                        await repl.write(offset, body, int(header["base"]))
                    repl.confirm(header.get("confirmed"))
                    meta = header.get("meta") or {}
                    if "page" in meta:
                        snap = await _copy_page(repl, meta)
                        if snap is None:  # the last page: the changes since it began next
                            meta_pos["inc"], meta_pos["seq"] = meta["inc"], int(meta["seq"])
                    elif meta:
                        if meta.get("ops"):
                            await trio.to_thread.run_sync(store.meta.apply, meta["ops"])
                        meta_pos["inc"], meta_pos["seq"] = meta["inc"], int(meta["seq"])
                    if repl.still_following(master_addr, epoch):
                        repl.adopt_epochs([(int(e), int(s)) for e, s in header["epochs"]])
        except Exception as exc:  # noqa: BLE001 - sorted below
            leaf = _leaf(exc)
            if isinstance(leaf, ValueError):  # the master's bytes do not continue our log
                log.error("replication from %s: %s", master_addr, leaf)
            elif isinstance(leaf, (StoreError, p.RemoteError, OSError, trio.TooSlowError)):
                log.info("replication from %s interrupted: %s", master_addr, leaf)
            else:
                raise
        await trio.sleep(RETRY_S)


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


def _leaf(exc: BaseException) -> BaseException:
    """The one exception inside nested single-member groups (trio nurseries wrap)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
