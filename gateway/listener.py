"""MQTT listeners: TCP, TLS (optionally mutual), WebSocket and secure WebSocket.

Every listener hands `Connection` a byte stream, the peer address and, for a verified
client certificate, the identity taken from it (used as the username when configured).
Handshakes (TLS, then the WebSocket upgrade) run in the connection's own task under a
timeout, so a slow or hostile client never holds up the accept loop.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
from dataclasses import dataclass

import trio
from trio_websocket import ConnectionClosed, WebSocketRequest, wrap_server_stream

from gateway.broker import Broker
from gateway.connection import Connection
from gateway.transports import ServerTLS, WatchedStream, WebSocketStream
from serving.startup import StartupError, listening, split_hostport

log = logging.getLogger("lightgate.gateway.listener")
# trio-websocket logs every socket read and frame at DEBUG; our own lines say what matters.
logging.getLogger("trio-websocket").setLevel(logging.INFO)

BACKLOG = 4096
WS_HANDSHAKE_TIMEOUT = 10.0  # from TCP accept (after TLS, for wss) to the HTTP upgrade
WS_SUBPROTOCOLS = ("mqtt", "mqttv3.1")  # MQTT 3.1.1/5.0's name, then MQTT 3.1 clients'
WS_MESSAGE_SLACK = 64 * 1024  # a message may carry more than one packet, a little over
WS_RECEIVE_BUFFER = 64 * 1024  # bytes per socket read, as Connection reads TCP


@dataclass
class ListenerConfig:
    mqtt: str | None = "0.0.0.0:1883"
    mqtt_tls: str | None = None  # on only when a certificate is given
    ws: str | None = "0.0.0.0:8083"
    wss: str | None = None  # on only when a certificate is given
    tls_cert: str | None = None  # PEM certificate chain
    tls_key: str | None = None  # PEM private key
    tls_ca: str | None = None  # CA bundle for client certificates
    tls_client_auth: str = "none"  # none | optional | required
    tls_username_from: str = "none"  # none | cn | san: client certificate -> username


def peer_of(stream: trio.SocketStream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "?"


def _nodelay(stream: trio.SocketStream) -> None:
    # Small MQTT packets (PUBACK, PINGRESP) must not wait for Nagle.
    try:
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass  # the peer already left; the first read will say so


# Listener name (as in `ready`) -> what it is and the flag that sets its address.
LISTENERS = {"mqtt": ("MQTT over TCP", "--mqtt"), "mqtt_tls": ("MQTT over TLS", "--mqtt-tls"),
             "ws": ("MQTT over WebSocket", "--ws"), "wss": ("MQTT over secure WebSocket", "--wss")}


async def _open(addr: str, name: str = "mqtt") -> tuple[list[trio.SocketListener], str]:
    """Listening sockets for `addr` and the bound host:port (port 0 picks one); a bind
    that fails is a StartupError naming listener `name` and its flag."""
    with listening(*LISTENERS[name], addr):
        host, port = split_hostport(addr)
        listeners = await trio.open_tcp_listeners(port, host=host, backlog=BACKLOG)
    bound = listeners[0].socket.getsockname()
    return listeners, f"{bound[0]}:{bound[1]}"


async def handle_connection(
    broker: Broker, stream: trio.abc.Stream, peer: str, cert_identity: str | None = None
) -> None:
    conn = Connection(broker, stream, peer, cert_identity=cert_identity)
    if conn.cert_identity is not None:
        log.debug("TLS client %s: certificate identity %r", peer, conn.cert_identity)
    try:
        await conn.run()
    except Exception:  # contained: one connection never takes the server down
        log.exception("connection from %s failed", conn.peer)


async def serve_mqtt_tcp(
    broker: Broker, addr: str, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    """Accept MQTT over TCP on `addr` until cancelled; started with the bound host:port."""

    async def handle(stream: trio.SocketStream) -> None:
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await handle_connection(broker, stream, peer_of(stream))

    listeners, bound = await _open(addr, "mqtt")
    task_status.started(bound)
    await trio.serve_listeners(handle, listeners)


async def serve_mqtt_tls(
    broker: Broker, addr: str, tls: ServerTLS, *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept MQTT over TLS on `addr` until cancelled; started with the bound host:port."""

    async def handle(stream: trio.SocketStream) -> None:
        _nodelay(stream)
        peer = peer_of(stream)
        secured = await tls.handshake(stream, peer)  # the context current at accept time
        if secured is not None:
            await handle_connection(broker, secured[0], peer, secured[1])

    listeners, bound = await _open(addr, "mqtt_tls")
    task_status.started(bound)
    await trio.serve_listeners(handle, listeners)


async def serve_mqtt_ws(
    broker: Broker, addr: str, tls: ServerTLS | None = None, *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept MQTT over WebSocket (over TLS: `tls` given) on `addr` until cancelled;
    started with the bound host:port."""

    async def handle(stream: trio.SocketStream) -> None:
        _nodelay(stream)
        peer = peer_of(stream)
        identity = None
        transport: trio.abc.Stream = stream
        if tls is not None:
            secured = await tls.handshake(stream, peer)
            if secured is None:
                return
            transport, identity = secured
        try:
            await _serve_websocket(broker, transport, peer, identity)
        except Exception as exc:  # contained, as in handle_connection
            if _is_disconnect(exc):
                log.info("websocket client %s went away: %r", peer, exc)
            else:
                log.exception("websocket connection from %s failed", peer)
        finally:
            await trio.aclose_forcefully(transport)

    listeners, bound = await _open(addr, "ws" if tls is None else "wss")
    task_status.started(bound)
    await trio.serve_listeners(handle, listeners)


async def _serve_websocket(
    broker: Broker, stream: trio.abc.Stream, peer: str, identity: str | None
) -> None:
    """One WebSocket connection, with trio-websocket's reader task kept apart: it runs
    shielded until the session is over, so that Connection's close handshake (which
    needs the reader to see the peer's answer) completes even while the server shuts
    down, instead of waiting out its timeout; it is cancelled right after."""
    finished = trio.Event()

    async def session(reader: trio.Nursery) -> None:
        try:
            await _websocket_session(broker, reader, stream, peer, identity)
        finally:
            finished.set()

    async with trio.open_nursery() as tasks, trio.open_nursery() as reader:
        reader.cancel_scope.shield = True
        tasks.start_soon(session, reader)
        await finished.wait()  # always set: session() sets it on every way out
        reader.cancel_scope.cancel()


async def _websocket_session(
    broker: Broker, reader: trio.Nursery, stream: trio.abc.Stream, peer: str,
    identity: str | None,
) -> None:
    """The WebSocket upgrade (subprotocol `mqtt` required, any path), then MQTT."""
    request = await _upgrade_request(reader, WatchedStream(stream), broker, peer)
    if request is None:
        return
    offered = request.proposed_subprotocols
    chosen = next((p for p in WS_SUBPROTOCOLS if p in offered), None)
    if chosen is None:
        # MQTT 6.0: the server must select "mqtt"; without it this is not MQTT.
        log.info("websocket client %s (path %s) offered subprotocols %s, not mqtt: rejected",
                 peer, request.path, list(offered))
        await request.reject(400, body=b"MQTT over WebSocket needs subprotocol mqtt\n")
        return
    ws = await request.accept(subprotocol=chosen)
    await handle_connection(broker, WebSocketStream(ws), peer, identity)


async def _upgrade_request(
    nursery: trio.Nursery, stream: WatchedStream, broker: Broker, peer: str
) -> WebSocketRequest | None:
    """The client's upgrade request; None if it takes too long or the peer goes away
    first (closed, or sent something that is not an upgrade: answered 400 already)."""
    got: list[WebSocketRequest] = []

    async def upgrade() -> None:
        got.append(await wrap_server_stream(
            nursery, stream,
            # Bounded memory: no message larger than the largest packet we accept.
            max_message_size=broker.config.max_packet_size + WS_MESSAGE_SLACK,
            receive_buffer_size=WS_RECEIVE_BUFFER,
        ))
        race.cancel_scope.cancel()

    async def gone() -> None:
        await stream.ended.wait()
        race.cancel_scope.cancel()

    with trio.move_on_after(WS_HANDSHAKE_TIMEOUT) as timeout:
        async with trio.open_nursery() as race:
            race.start_soon(upgrade)
            race.start_soon(gone)
    if timeout.cancelled_caught:
        log.info("websocket handshake with %s timed out", peer)
    elif not got:
        log.info("websocket handshake with %s failed: no upgrade request", peer)
    return got[0] if got else None


def _is_disconnect(exc: BaseException) -> bool:
    """Whether `exc` (or every part of a group) is only the peer going away."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_is_disconnect(e) for e in exc.exceptions)
    return isinstance(exc, (trio.BrokenResourceError, trio.ClosedResourceError,
                            ConnectionClosed, OSError))


def _server_tls(cfg: ListenerConfig) -> ServerTLS | None:
    """The shared TLS state for mqtt_tls and wss, if either is on."""
    if not (cfg.mqtt_tls or cfg.wss):
        return None
    if not (cfg.tls_cert and cfg.tls_key):
        raise StartupError("the TLS listeners (--mqtt-tls, --wss) need --tls-cert and --tls-key")
    files = [("--tls-cert", cfg.tls_cert), ("--tls-key", cfg.tls_key)]
    if cfg.tls_client_auth != "none":
        files.append(("--tls-ca", cfg.tls_ca))
    for flag, path in files:
        if path and not os.access(path, os.R_OK):  # one line now, not an SSLError later
            why = "cannot be read" if os.path.exists(path) else "does not exist"
            raise StartupError(f"{flag} {path}: the file {why}")
    try:
        return ServerTLS(cfg.tls_cert, cfg.tls_key, cfg.tls_ca, cfg.tls_client_auth,
                         cfg.tls_username_from)
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise StartupError(f"--tls-cert {cfg.tls_cert} with --tls-key {cfg.tls_key} does not "
                           f"load: {exc}") from exc


async def start_listeners(
    nursery: trio.Nursery, broker: Broker, cfg: ListenerConfig
) -> dict[str, str]:
    """Start every configured listener; returns {name: bound host:port} for `ready`."""
    tls = _server_tls(cfg)  # a bad certificate stops start-up here, before any accept
    bound: dict[str, str] = {}
    if cfg.mqtt:
        bound["mqtt"] = await nursery.start(serve_mqtt_tcp, broker, cfg.mqtt)
    if cfg.mqtt_tls and tls is not None:
        bound["mqtt_tls"] = await nursery.start(serve_mqtt_tls, broker, cfg.mqtt_tls, tls)
    if cfg.ws:
        bound["ws"] = await nursery.start(serve_mqtt_ws, broker, cfg.ws, None)
    if cfg.wss and tls is not None:
        bound["wss"] = await nursery.start(serve_mqtt_ws, broker, cfg.wss, tls)
    return bound
