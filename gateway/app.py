"""`lightgate serve`: the embedded mode, every part in one process: the store, the
in-process notify bus, the MQTT gateway and the HTTP endpoints."""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass, field

import trio

from gateway.admin import gateway_routes
from gateway.broker import Broker, GatewayConfig
from gateway.listener import serve_mqtt_tcp
from notify import open_bus
from store.http import make_app, serve_http, store_routes
from store.service import EmbeddedStore, StoreConfig

log = logging.getLogger("lightgate.serve")


@dataclass
class ServeOptions:
    store: StoreConfig = field(default_factory=StoreConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    mqtt: str = "0.0.0.0:1883"
    http: str = "127.0.0.1:18083"
    notify: str | None = None  # None: in-process; redis://host:port for several nodes


async def wait_for_shutdown_signal() -> int:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            return signum
    return 0


async def run_serve(opts: ServeOptions) -> None:
    async with (
        open_bus(opts.notify) as bus,
        EmbeddedStore.open(opts.store, notify=bus.publish_from_thread) as store,
        trio.open_nursery() as nursery,
    ):
        rec = store.recovery
        if rec is not None:
            log.info(
                "store at %s: log end %d, %d records verified, %d re-dispatched in %.3fs",
                opts.store.data_dir, rec.end, rec.records_verified, rec.redispatched, rec.seconds,
            )
        broker = Broker(store, opts.gateway)
        nursery.start_soon(broker.run_notify, bus)
        await nursery.start(broker.run_housekeeping)
        mqtt_addr = await nursery.start(serve_mqtt_tcp, broker, opts.mqtt)
        app = make_app([*store_routes(store), *gateway_routes(broker)])
        http_addr = await nursery.start(serve_http, app, opts.http)
        print(f"ready mqtt={mqtt_addr} http={http_addr}", flush=True)
        signum = await wait_for_shutdown_signal()
        log.info("signal %s: shutting down", signal.Signals(signum).name)
        nursery.cancel_scope.cancel()
