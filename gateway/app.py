"""The gateway process of the separated mode: `lightgate gateway --store HOST:PORT
--notify redis://...`, the same gateway code as `lightgate serve` runs (see
lightgate/embedded.py) over the native-protocol client."""

from __future__ import annotations

import logging
import math
import os
import signal
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import trio

from gateway.admin import gateway_routes
from gateway.broker import Broker
from gateway.config import GatewayOptions
from gateway.listener import start_listeners
from gateway.store_link import StoreLink
from gateway.takeover import release_ask
from notify import open_bus
from serving import plane
from serving.gc_tuning import tune_for_serving
from serving.http import serve_http
from serving.reload import Reload
from serving.startup import Signals, StartupError, shutdown_signals, stop_on_signal
from serving.values import split_credentials
from store.api import (
    AuthConfig,
    AuthFailed,
    AuthManager,
    NativeClient,
    RemoteStore,
    StoreUnavailable,
    audit_to_file,
    auth_app,
)

log = logging.getLogger("lightgate.serve")

STORE_QUIET_S = 1.0  # a store that answers within this at start: nothing to log
GATEWAY_COST = ("MQTT over plain TCP and the appends to the store run in Python: ~50-90 "
                "us of interpreter per device message on this node")


@contextmanager
def remote_engine(opts: GatewayOptions) -> Iterator[Any]:
    """The native engine of a gateway node (serving.lightgate_native.Engine.start_remote),
    or None on the Python plane: reactors that carry quiet plain-TCP publishers and send
    their publishes to the store as native-protocol PUBLISH frames (its own connection
    to the store's master, beside the Python client's), each PUBACK once stored."""
    native = plane.NATIVE
    if plane.writer() != "native" or not hasattr(getattr(native, "Engine", None),
                                                  "start_remote"):
        yield None
        return
    creds = _credentials(opts.store_auth)
    user, password = creds if creds is not None else (None, None)
    threads = opts.gateway.io_threads or os.cpu_count() or 1
    engine = native.Engine.start_remote(opts.store, threads, user, password)
    try:
        yield engine
    finally:
        engine.stop()


def _credentials(spec: str | None) -> tuple[str, str] | None:
    if not spec:
        return None
    try:
        return split_credentials(spec, "--store-auth")
    except ValueError as exc:
        raise StartupError(str(exc)) from None


async def _replica_auth(store: RemoteStore, hello: dict, opts: GatewayOptions) -> AuthManager:
    """The gateway follows the store: auth is on when the store says so, and then this
    gateway must have joined as a node (an unauthenticated process cannot). Its own
    MQTT backends (jwt, http) turn it on for its MQTT clients as well."""
    if hello.get("auth") and not hello.get("node"):
        raise StartupError(
            "the store has authentication on and did not accept this gateway as "
            "a node: give --store-auth NAME:PASSWORD of a node user (lightgate user add "
            "NAME --node) or a Super user")
    if opts.audit_log:
        audit_to_file(opts.audit_log)
    auth = AuthManager(store, enabled=bool(hello.get("auth")) or opts.auth_backends.external,
                       allow_anonymous=bool(hello.get("allow_anonymous")),
                       strategy=opts.auth_strategy or AuthConfig.strategy)
    if auth.enabled:
        await auth.load()
        log.info("MQTT authentication backends %s", ",".join(opts.auth_backends.chain))
    return auth


def ready_line(bound: dict[str, str]) -> str:
    """The line a server prints once every listener accepts."""
    return "ready " + " ".join(f"{name}={addr}" for name, addr in bound.items())


async def _announce(store: RemoteStore, gateway_id: str, info: dict) -> None:
    """Tell the store this gateway exists: gateways find each other there, with no
    static node list to keep in step."""
    while True:
        try:
            await store.gateway_heartbeat(gateway_id, info)
        except Exception as exc:
            log.debug("gateway heartbeat failed: %s", exc)
        await trio.sleep(5)


async def run_gateway(opts: GatewayOptions, reload: Reload | None = None) -> None:
    """`reload`: what SIGHUP re-reads beside what the gateway adds (the config file)."""
    with shutdown_signals() as signals:
        await _gateway(opts, signals, reload or Reload())


async def _gateway(opts: GatewayOptions, signals: Signals, reload: Reload) -> None:
    if not opts.notify:
        log.warning("no --notify: this gateway polls the store for new messages")
    async with NativeClient.open(opts.store, credentials=_credentials(opts.store_auth),
                                 wait=False) as client:
        if not await _wait_for_store(client, opts, signals):
            return
        with remote_engine(opts) as engine:
            await _serve(opts, signals, reload, client, engine)


async def _serve(opts: GatewayOptions, signals: Signals, reload: Reload,
                 client: NativeClient, engine: Any) -> None:
    async with open_bus(opts.notify) as bus, trio.open_nursery() as nursery:
        store = RemoteStore(client)
        auth = await _replica_auth(store, client.hello, opts)
        broker = Broker(store, opts.gateway, auth, opts.auth_backends)
        gateway_id = f"gw-{uuid.uuid4().hex[:12]}"
        broker.registry.gateway_id = gateway_id  # (a session it holds says so)
        broker.shared.lease_with(gateway_id, store)
        nursery.start_soon(broker.shared.keep_leases)
        if engine is not None:  # quiet plain-TCP publishers go native after CONNACK
            broker.use_engine(engine)
        if auth.enabled:
            nursery.start_soon(broker.run_auth_refresh)
            reload.add("users and policies", auth.reread)
        if opts.notify:
            nursery.start_soon(broker.run_notify, bus)
            broker.registry.ask_release = (  # (gateway.takeover)
                lambda *ask: bus.publish({release_ask(*ask)}))
        nursery.start_soon(broker.run_poll_fallback, bus if opts.notify else None)
        await nursery.start(broker.run_connections)
        await nursery.start(broker.run_housekeeping)
        link = StoreLink(client, opts.peers, opts.master_unreachable_s,
                         None if engine is None else engine.give_up_held)
        nursery.start_soon(link.run, broker)
        bound = await start_listeners(nursery, broker, opts.listeners, reload)
        app = auth_app([*link.routes(), *gateway_routes(broker)], auth,
                       manage_auth=False)
        bound["http"] = await nursery.start(
            partial(serve_http, max_body=opts.gateway.http_max_body,
                    allowed_hosts=opts.gateway.http_allowed_hosts), app, opts.http)
        nursery.start_soon(_announce, store, gateway_id, dict(bound))
        bound["store"] = opts.store
        bound["plane"] = "native" if engine is not None else "python"
        plane.warn_if_python(log, GATEWAY_COST)
        tune_for_serving()
        print(ready_line(bound), flush=True)
        await stop_on_signal(signals, nursery, reload)


async def _wait_for_store(client: NativeClient, opts: GatewayOptions, signals: Signals
                          ) -> bool:
    """Wait for the store (a group: its master) before listening; False if a signal
    came first. A store not there yet is a normal moment (a group electing, a compose
    file starting everything at once), so the gateway waits, saying so once and then
    every few seconds (NativeClient), rather than exit.

    Why not listen at once and refuse CONNECTs with 0x88 (Server unavailable)? Without
    its store a gateway knows neither whether authentication is on nor any session:
    every CONNECT could only be refused. Closed ports say the same to clients, which
    retry with their own backoff as they do while a broker restarts, and to load
    balancers and readiness probes, which send clients to a gateway that serves. The
    ready line comes once this one can serve. (A store lost later, once serving, is
    another moment: the listeners stay, CONNECTs get 0x88 until it is back.)"""
    limit = opts.store_wait_s or math.inf
    failure: StartupError | None = None
    stopped = False
    async with trio.open_nursery() as race:

        async def on_signal() -> None:
            nonlocal stopped
            async for signum in signals:
                if signum == signal.SIGHUP:  # nothing read yet to read again
                    log.info("SIGHUP while waiting for the store: nothing to re-read yet")
                    continue
                log.info("signal %s while waiting for the store: stopping",
                         signal.Signals(signum).name)
                stopped = True
                race.cancel_scope.cancel()
                return

        race.start_soon(on_signal)
        try:
            with trio.move_on_after(min(STORE_QUIET_S, limit)) as quiet:
                await client.ready(math.inf)
            if quiet.cancelled_caught:
                log.warning("waiting for the store at %s before listening (%s)%s", opts.store,
                            client.last_failure or "no answer yet",
                            f"; giving up after {limit:g} s" if limit < math.inf else "")
                await client.ready(max(0.0, limit - STORE_QUIET_S))
        except AuthFailed as exc:
            failure = StartupError(f"the store refused this gateway: {exc.message} "
                                   "(check --store-auth)")
        except StoreUnavailable as exc:  # not found within --store-wait-s
            failure = StartupError(f"{exc}: start `lightgate store` there, point --store at "
                                   "it or wait longer (--store-wait-s)")
        race.cancel_scope.cancel()
    if failure is not None:
        raise failure  # outside the race: one error, not a group
    return not stopped
