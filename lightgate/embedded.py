"""`lightgate serve`, the embedded mode: the store, its native server, an in-process
notify bus, the MQTT gateway and HTTP in one process. Wiring only: the store's engine
and the gateway meet here, on the command line's side, so that neither room needs the
other's insides (a separated gateway imports no storage engine at all)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from functools import partial

import trio

from gateway.admin import gateway_routes
from gateway.app import ready_line
from gateway.auth.chain import BackendConfig
from gateway.broker import Broker
from gateway.config import GatewayConfig, ListenerConfig
from gateway.listener import start_listeners
from notify import LocalBus
from serving import plane
from serving.gc_tuning import tune_for_serving
from serving.http import serve_http
from serving.reload import Reload
from serving.startup import Signals, StartupError, shutdown_signals, stop_on_signal
from serving.values import HTTP_ADDR, NATIVE_ADDR
from store.api import AuthConfig, auth_app, store_routes
from store.app import store_node
from store.config import StoreConfig

log = logging.getLogger("lightgate.serving")

# What `lightgate serve` gives up on the Python plane (docs/benchmarks.md, the native data
# plane against the Python plane, each against Mosquitto on the same machine, 2026-11-28).
SERVE_COST = ("MQTT over plain TCP and the log's writes run in Python: 0.1-0.45x the "
              "native plane's messages a second, at 3-4.5x its CPU a message")

@dataclass
class ServeOptions:
    store: StoreConfig = field(default_factory=StoreConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    listeners: ListenerConfig = field(default_factory=ListenerConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    auth_backends: BackendConfig = field(default_factory=BackendConfig)  # MQTT's: jwt, http
    native: str = NATIVE_ADDR
    http: str = HTTP_ADDR




async def run_serve(opts: ServeOptions, reload: Reload | None = None) -> None:
    """`reload`: what SIGHUP re-reads beside what the server adds (the config file)."""
    with shutdown_signals() as signals:
        await _serve(opts, signals, reload or Reload())


def io_threads(gateway: GatewayConfig) -> int:
    """The native plane's I/O threads: as many as asked, else one per core."""
    return gateway.io_threads or os.cpu_count() or 1


async def _serve(opts: ServeOptions, signals: Signals, reload: Reload) -> None:
    if plane.writer() == "native":  # the engine writes the log (store.service)
        if not all(hasattr(plane.NATIVE.Engine, name) for name in ("append_messages",
                                                                   "release",
                                                                   "set_not_stored",
                                                                   "take_batch")):
            raise StartupError("the native data plane installed is older than this "
                               "Lightgate (its engine cannot write the log or carry "
                               "connections): reinstall it (cargo on PATH, then `pip "
                               "install .`)")
        opts.store.engine_threads = io_threads(opts.gateway)
    async with (
        LocalBus(window=0) as bus,  # the store appends in batches: nothing to wait for
        store_node(opts.store, opts.native, bus.publish_from_thread, opts.auth) as node,
        trio.open_nursery() as nursery,
    ):
        broker = Broker(node.store, opts.gateway, node.auth, opts.auth_backends)
        if node.store.engine is not None:  # quiet plain-TCP clients go native after CONNACK
            broker.use_engine(node.store.engine)
        nursery.start_soon(broker.run_notify, bus)
        await nursery.start(broker.run_connections)
        await nursery.start(broker.run_housekeeping)
        if node.auth.enabled:
            reload.add("users and policies", node.auth.reread)
        bound = await start_listeners(nursery, broker, opts.listeners, reload)
        app = auth_app([*store_routes(node.store), *gateway_routes(broker, opts.store)],
                       node.auth)
        bound["native"] = node.native_addr
        bound["http"] = await nursery.start(
            partial(serve_http, max_body=opts.gateway.http_max_body,
                    allowed_hosts=opts.gateway.http_allowed_hosts), app, opts.http)
        bound["plane"] = plane.writer()
        plane.warn_if_python(log, SERVE_COST)
        tune_for_serving()
        print(ready_line(bound), flush=True)
        await stop_on_signal(signals, nursery, reload)
