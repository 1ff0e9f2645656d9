"""`lightgate store`: a storage node (CommitLog, index, metadata, native protocol, HTTP).

`store_node` is shared with `lightgate serve`, which adds a gateway in the same process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from functools import partial

import trio

from serving import plane
from serving.gc_tuning import tune_for_serving
from serving.http import serve_http
from serving.reload import Reload
from serving.startup import StartupError, shutdown_signals, stop_on_signal
from store.auth import AuthConfig, AuthManager
from store.config import StoreConfig
from store.cursor_key import group_key
from store.http import store_routes
from store.http_auth import auth_app
from store.protocol import REPL_FETCH
from store.replication.native_master import NativeMaster, group_native
from store.replication.node import META_CODES, REPLICA, Replication, ReplicationConfig
from store.server import NativeServer
from store.service import EmbeddedStore

log = logging.getLogger("lightgate.store.app")

# What a store gives up without the extension (docs/native-plane.md#status).
STORE_COST = "each record is encoded in Python (2.36 µs against 0.49 natively)"


@dataclass
class StoreNode:
    store: EmbeddedStore
    server: NativeServer
    native_addr: str
    auth: AuthManager


def native_carries(repl: ReplicationConfig | None) -> bool:
    """Whether `lightgate store` runs the engine as its log's writer and carries its
    authenticated native connections natively (store.carried): on the native plane, in
    no group (no replica of another node, no controller, asynchronous acks). A group's
    node does so while it is master (store.replication.native_master)."""
    return (plane.NATIVE is not None and repl is not None and repl.replica_of is None
            and not repl.raft and not repl.group_peers and repl.mode != "sync")


@asynccontextmanager
async def store_node(
    cfg: StoreConfig, native: str, publish: Callable[[set[str]], bool | None] | None = None,
    auth_cfg: AuthConfig | None = None, repl_cfg: ReplicationConfig | None = None,
) -> AsyncIterator[StoreNode]:
    """The store and its native server. `publish` (called from whichever thread appended:
    the CommitLog writer thread, or this one) carries the names of grown queues to
    gateways: an in-process bus or Redis."""
    token = trio.lowlevel.current_trio_token()
    trio_thread = threading.get_ident()
    server: NativeServer | None = None
    repl: Replication | None = None
    carry = native_carries(repl_cfg)
    if carry and not cfg.engine_threads:
        cfg = replace(cfg, engine_threads=1)  # (no MQTT connection: one is plenty)

    def readable(names: set[str] | dict[str, int]) -> bool:
        """Readers of these queues may read more: wake the pulls waiting here and tell
        gateways. False if nobody here heard (the engine's dispatch may take its time)."""
        told = False
        if server is not None:  # wake long-polling pulls in this process
            if threading.get_ident() == trio_thread:  # an inline append: no hop
                server.waiters.wake(names)
            elif server.waiters.any_waiting(names):  # else a wake-up for nobody
                told = True
                try:
                    token.run_sync_soon(server.waiters.wake, names)
                except trio.RunFinishedError:
                    pass
        # Gateways read from the master: a replica's copy is news to nobody there.
        if (publish is not None and (repl is None or repl.role != REPLICA)
                and publish(names) is not False):
            told = True
        return told

    def on_dispatched(names: set[str] | dict[str, int]) -> bool:
        """The log grew (called from whichever thread appended). In a group, replicas
        long-polling the log are woken; readers are told once they may read it: at once,
        or where readers see acknowledged messages only (sync mode, and the replicas of a
        master in sync mode), once acknowledged (`repl.notify`)."""
        if repl is not None:
            repl.grew()
            if repl.read_limit() is not None:
                if repl.native is not None:  # native appends: told once acknowledged
                    repl.dispatched(set(names))  # (names, or names with their ends)
                elif repl.copier is not None:  # a native copy: once the master says;
                    return repl.copied(set(names))  # heard if a reader waits here
                return True
        return readable(names)

    async with EmbeddedStore.open(cfg, notify=on_dispatched) as store, \
            trio.open_nursery() as nursery:
        rec = store.recovery
        if rec is not None:
            log.info("store at %s: log end %d, %d records verified, %d re-dispatched in %.3fs",
                     cfg.data_dir, rec.end, rec.records_verified, rec.redispatched,
                     rec.seconds)
        try:
            auth = await AuthManager.start(store, auth_cfg or AuthConfig(), publish)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        server = NativeServer(store, auth)
        if carry and store.engine is not None and plane.NATIVE is not None:
            server.carry(plane.NATIVE.StoreServer(store.engine))
        store.commitlog.waiting = server.waiters.any  # no lazy dispatch while a pull waits
        if repl_cfg is not None:  # `lightgate store`: a master others may copy
            # In place before the port opens: a replica never takes a client's write.
            repl = Replication(store, repl_cfg, native)
            store.replication = repl
            store.auth_reload = auth.load
            auth.reload_on_copy(store.meta)  # a replica: as users and policies arrive
            nursery.start_soon(auth.run_copy_reloads)
            server.register(REPL_FETCH, repl.handle_fetch)
            if repl_cfg.raft_secret:  # replicas prove they hold it to fetch the log
                server.node_secret = repl_cfg.raft_secret.encode()
                # A cursor one master gave out is good on the next after a failover.
                store.history_reader.key = group_key(server.node_secret)
            server.write_refusal = repl.write_refusal
            server.hello_extra = repl.hello
            server.read_limit = repl.read_limit
            repl.notify = readable
            repl.readers_waiting = server.waiters.any
            server.waiters.on_wait = repl.reader_waits
            repl.drop_clients = server.drop_clients
            for code in META_CODES:  # sync mode: answered once replicated
                server.wrap(code, repl.synced)
            if not carry and group_native(repl_cfg):  # master: native engine and server
                NativeMaster(store, server, repl, nursery)
                repl.native_copy = True  # replica: the steady-state copy natively
        native_addr = await nursery.start(server.serve, native)
        store.native_addr = native_addr
        if repl is not None:
            repl.bind(native_addr)
            await nursery.start(repl.run)
        yield StoreNode(store, server, native_addr, auth)
        nursery.cancel_scope.cancel()


async def run_store(
    cfg: StoreConfig, native: str, http: str, publish: Callable[[set[str]], bool | None] | None,
    auth_cfg: AuthConfig | None = None, repl_cfg: ReplicationConfig | None = None,
    reload: Reload | None = None,
) -> None:
    """`reload`: what SIGHUP re-reads beside the users and policies (the config file)."""
    reload = reload or Reload()
    with shutdown_signals() as signals:
        async with store_node(cfg, native, publish, auth_cfg, repl_cfg) as node, \
                trio.open_nursery() as nursery:
            if node.auth.enabled:
                reload.add("users and policies", node.auth.reread)
            app = auth_app(store_routes(node.store), node.auth)
            http_addr = await nursery.start(
                partial(serve_http, max_body=cfg.http_max_body,
                        allowed_hosts=cfg.http_allowed_hosts), app, http)
            # The native engine writes the log in `lightgate serve` and in a store of no
            # group (native_carries; docs/native-plane.md#status); a group's node runs it
            # once it is master, or copies natively as a replica (group_native).
            where = ("native" if node.store.engine is not None or group_native(repl_cfg)
                     else "python")
            plane.warn_if_python(log, STORE_COST)
            tune_for_serving()
            print(f"ready native={node.native_addr} http={http_addr} plane={where}",
                  flush=True)
            await stop_on_signal(signals, nursery, reload)
