"""MQTT listeners: TCP, TLS (optionally mutual), WebSocket and secure WebSocket.

Every listener hands `Connection` a byte stream, the peer address and, for a verified
client certificate, the identity taken from it (used as the username when configured).
Handshakes (TLS, then the WebSocket upgrade) run in the connection's own task under a
timeout, so a slow or hostile client never holds up the accept loop. On the native plane
the engine accepts TLS, WebSocket and secure WebSocket (`serve_native`): it does the
handshakes and the framing, and Python decides what it decides here (the subprotocol,
CONNECT and every rule after it) over the bytes it relays.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
from functools import partial

import trio
from wsproto import WSConnection
from wsproto.events import AcceptConnection, Request

from gateway.broker import Broker
from gateway.config import GatewayConfig, ListenerConfig
from gateway.connection import Connection
from gateway.mqtt import Decoder
from gateway.mqtt import reason as rc
from gateway.mqtt.protocol import Closing, MqttProtocol
from gateway.native_link import NativeLinks, NativeStream
from gateway.reactor import Reactor
from gateway.transports import ServerTLS, WebSocketStream, receive_upgrade, reject_upgrade
from serving.accepting import budgeted
from serving.fd_budget import client_fd_ceiling
from serving.read_budget import READ_SIZE, ReadBudget, read_fd
from serving.reload import Reload
from serving.startup import StartupError, listening
from serving.values import split_hostport

log = logging.getLogger("lightgate.gateway.listener")

BACKLOG = 4096
WS_HANDSHAKE_TIMEOUT = 10.0  # from TCP accept (after TLS, for wss) to the HTTP upgrade
WS_SUBPROTOCOLS = ("mqtt", "mqttv3.1")  # MQTT 3.1.1/5.0's name, then MQTT 3.1 clients'
WS_MESSAGE_SLACK = 64 * 1024  # a message may carry more than one packet, a little over
WS_REFUSAL = b"MQTT over WebSocket needs subprotocol mqtt\n"  # the 400's body


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
    await run_connection(Connection(broker, stream, peer, cert_identity=cert_identity))


async def run_connection(conn: Connection) -> None:
    if conn.cert_identity is not None:
        log.debug("TLS client %s: certificate identity %r", conn.peer, conn.cert_identity)
    try:
        await conn.run_stream()
    except Exception:  # contained: one connection never takes the server down
        log.exception("connection from %s failed", conn.peer)


async def serve_mqtt_tcp(
    broker: Broker, addr: str, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    """Accept MQTT over TCP on `addr` until cancelled; started with the bound host:port.
    The node's reactor accepts and reads these connections (gateway.reactor)."""
    with listening(*LISTENERS["mqtt"], addr):
        host, port = split_hostport(addr)
        sock = socket.create_server((host or "0.0.0.0", port), backlog=BACKLOG,
                                    reuse_port=False)
    bound = sock.getsockname()
    reactor = Reactor(broker)
    reactor.listen(sock, addr)
    try:
        await reactor.run(task_status=_started(task_status, f"{bound[0]}:{bound[1]}"))
    finally:
        sock.close()


class _started:
    """task_status.started with a value fixed in advance."""

    def __init__(self, status: trio.TaskStatus[str], value: str) -> None:
        self.status, self.value = status, value

    def started(self, _: object = None) -> None:
        self.status.started(self.value)


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
    await trio.serve_listeners(handle, budgeted(listeners, LISTENERS["mqtt_tls"][0]))


# The listeners the engine accepts on, on the native plane: name -> its index there.
NATIVE_LISTENERS = {"mqtt_tls": 0, "ws": 1, "wss": 2}


async def serve_native(
    broker: Broker, addr: str, name: str, cfg: ListenerConfig, *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """MQTT over TLS, WebSocket or secure WebSocket (`name`) on the native plane
    (docs/native-plane.md): this binds `addr` (its errors, port 0 and the ready line
    stay as for every listener), the engine accepts, does the TLS handshake and a
    WebSocket's upgrade (Python chooses the subprotocol: `_serve_native_websocket`),
    and relays each connection's bytes to a `Connection` here (gateway.native_link)
    until it is promoted, as a plain-TCP one is, to be carried there on the same
    link."""
    handover = broker.handover
    assert handover is not None
    engine = handover.engine
    with listening(*LISTENERS[name], addr):
        host, port = split_hostport(addr)
        sock = socket.create_server((host or "0.0.0.0", port), backlog=BACKLOG,
                                    reuse_port=False)
    bound = sock.getsockname()
    if handover.links is None:
        handover.links = NativeLinks(lambda: broker.connection_nursery, _serve_link(broker),
                                     broker.read_budget)
    tls = name != "ws"
    try:
        engine.listen(sock.fileno(), NATIVE_LISTENERS[name], LISTENERS[name][0],
                      cfg.tls_cert if tls else None, cfg.tls_key if tls else None,
                      cfg.tls_ca, cfg.tls_client_auth, cfg.tls_username_from,
                      fd_ceiling=client_fd_ceiling(), handshake_timeout=cfg.tls_handshake_timeout,
                      max_handshakes=cfg.tls_max_handshakes, websocket=name != "mqtt_tls",
                      upgrade_timeout=WS_HANDSHAKE_TIMEOUT)
    except ValueError as exc:
        sock.close()
        raise StartupError(f"--tls-cert {cfg.tls_cert} with --tls-key {cfg.tls_key} does not "
                           f"load: {exc}") from exc
    sock.detach()  # the engine's now: it closes it when it stops
    try:
        async with trio.open_nursery() as nursery:
            handover.start(nursery)
            task_status.started(f"{bound[0]}:{bound[1]}")
            await trio.sleep_forever()
    finally:
        # Shutting down: the connections the engine carries come back and are closed
        # (those relayed here close as their tasks are cancelled).
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            async with trio.open_nursery() as ending:
                await handover.release_all(None, Closing("server shutting down", True,
                                                         rc.SERVER_SHUTTING_DOWN), ending)


def _serve_link(broker: Broker):  # type: ignore[no-untyped-def]
    async def serve(stream: NativeStream, peer: str, identity: str | None,
                    upgrade: tuple[str, list[str]] | None) -> None:
        if upgrade is None:
            await run_connection(_linked_connection(broker, stream, peer, identity))
        else:
            await _serve_native_websocket(broker, stream, peer, identity, *upgrade)
    return serve


def _linked_connection(broker: Broker, stream: NativeStream, peer: str,
                       identity: str | None) -> Connection:
    """A Connection over a stream the engine relays, whose reads take what the node's
    read budget allows when their bytes are there (as `read_fd` does for a socket)."""
    conn = Connection(broker, stream, peer, cert_identity=identity)
    # (Its core, not the Connection: a cycle would keep a closed one's buffers.)
    stream.read_size = partial(_read_size, broker.read_budget, conn.core)
    return conn


def _read_size(budget: ReadBudget, core: MqttProtocol) -> int:
    decoder = core.decoder  # (None while the engine carries the connection)
    return budget.read_size(decoder.buffered if decoder is not None else 0, READ_SIZE)


async def _serve_native_websocket(broker: Broker, stream: NativeStream, peer: str,
                                  identity: str | None, target: str, offered: list[str]
                                  ) -> None:
    """A WebSocket the engine accepted and read the upgrade request of: answered as
    `_serve_websocket` answers its own, then MQTT over the engine's frames."""
    chosen = _subprotocol(peer, target, offered)
    if chosen is None:
        stream.refuse(400, WS_REFUSAL)
        return
    conn = _linked_connection(broker, stream, peer, identity)
    # (The decoder the CONNECT is read with: the limit changes once it has a version.)
    stream.message_limit = partial(_message_limit, broker.config, conn.decoder)
    stream.upgrade(chosen)
    await run_connection(conn)


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

    name = "ws" if tls is None else "wss"
    listeners, bound = await _open(addr, name)
    task_status.started(bound)
    await trio.serve_listeners(handle, budgeted(listeners, LISTENERS[name][0]))


async def _serve_websocket(
    broker: Broker, stream: trio.abc.Stream, peer: str, identity: str | None
) -> None:
    """The WebSocket upgrade (subprotocol `mqtt` required, any path), then MQTT."""
    upgrade = await _upgrade_request(stream, peer)
    if upgrade is None:
        return
    ws, request = upgrade
    chosen = _subprotocol(peer, request.target, request.subprotocols)
    if chosen is None:
        await reject_upgrade(stream, ws, 400, WS_REFUSAL)
        return
    await stream.send_all(ws.send(AcceptConnection(subprotocol=chosen)))
    ws_stream = WebSocketStream(stream, ws, peer)
    conn = Connection(broker, ws_stream, peer, cert_identity=identity)
    _attach(ws_stream, stream, conn.decoder, broker)
    await run_connection(conn)


def _subprotocol(peer: str, target: str, offered: list[str]) -> str | None:
    """The subprotocol to accept a client's upgrade with; None (said in the log) when it
    offered no MQTT one. MQTT 6.0: the server must select "mqtt"; without it this is
    not MQTT."""
    chosen = next((p for p in WS_SUBPROTOCOLS if p in offered), None)
    if chosen is None:
        log.info("websocket client %s (path %s) offered subprotocols %s, not mqtt: rejected",
                 peer, target, offered)
    return chosen


def _attach(ws_stream: WebSocketStream, transport: trio.abc.Stream, decoder: Decoder,
            broker: Broker) -> None:
    """What a WebSocket stream asks of the Connection reading it, asked of that
    Connection's decoder: a reference cycle through the Connection would keep a closed
    one's buffers until the collector's next full run."""
    ws_stream.message_limit = partial(_message_limit, broker.config, decoder)
    if type(transport) is trio.SocketStream:  # ws:// (wss:// reads through TLS)
        ws_stream.read = partial(_read_counted, transport.socket.fileno(),
                                 broker.read_budget, decoder)


async def _read_counted(fd: int, budget: ReadBudget, decoder: Decoder, max_bytes: int
                        ) -> bytes:
    """A read of a WebSocket's plain socket as Connection reads TCP (read_fd): its bytes
    count in the node's read budget until they reach the decoder, so that many
    connections reading at once cannot each see the budget as it was before the
    others' reads. Its size is the budget's (what Connection asked, `max_bytes`, comes
    from the same holding: the decoder's), taken when the data is there."""
    return await read_fd(fd, budget, decoder.buffered)


def _message_limit(cfg: GatewayConfig, decoder: Decoder) -> tuple[int, str]:
    """How large a WebSocket message may be, and the setting that says so: until a
    CONNECT is decoded no larger than that first packet may be (a message may hold the
    CONNECT and more, but nobody is authenticated yet); after it, a packet and a
    little."""
    if decoder.version is None:
        return cfg.max_connect_packet, "--max-connect-packet"
    return cfg.max_packet_size + WS_MESSAGE_SLACK, "--max-packet-size"


async def _upgrade_request(stream: trio.abc.Stream, peer: str
                           ) -> tuple[WSConnection, Request] | None:
    """The client's upgrade request; None if it takes too long or the peer goes away
    first (closed, or sent something that is not an upgrade: answered 400 already)."""
    got = None
    with trio.move_on_after(WS_HANDSHAKE_TIMEOUT) as timeout:
        got = await receive_upgrade(stream)
    if timeout.cancelled_caught:
        log.info("websocket handshake with %s timed out", peer)
    elif got is None:
        log.info("websocket handshake with %s failed: no upgrade request", peer)
    return got


def _is_disconnect(exc: BaseException) -> bool:
    """Whether `exc` (or every part of a group) is only the peer going away."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_is_disconnect(e) for e in exc.exceptions)
    return isinstance(exc, (trio.BrokenResourceError, trio.ClosedResourceError, OSError))


def _server_tls(cfg: ListenerConfig) -> ServerTLS | None:
    """The shared TLS state for mqtt_tls and wss, if either is on."""
    if not (cfg.address("mqtt_tls") or cfg.address("wss")):
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
                         cfg.tls_username_from, cfg.tls_handshake_timeout,
                         cfg.tls_max_handshakes)
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise StartupError(f"--tls-cert {cfg.tls_cert} with --tls-key {cfg.tls_key} does not "
                           f"load: {exc}") from exc


async def start_listeners(
    nursery: trio.Nursery, broker: Broker, cfg: ListenerConfig, reload: Reload | None = None
) -> dict[str, str]:
    """Start every configured listener; returns {name: bound host:port} for `ready`.
    `reload`: SIGHUP's, which re-reads the TLS files from then on."""
    tls = _server_tls(cfg)  # a bad certificate stops start-up here, before any accept
    if tls is not None and reload is not None:
        reload.add("TLS certificates", partial(_reread_tls, tls))
    bound: dict[str, str] = {}
    if addr := cfg.address("mqtt"):
        bound["mqtt"] = await nursery.start(serve_mqtt_tcp, broker, addr)
    # The native plane's engine accepts TLS and WebSocket too (gateway.native_link).
    native = broker.handover is not None
    if (addr := cfg.address("mqtt_tls")) and tls is not None:
        if native:
            bound["mqtt_tls"] = await nursery.start(serve_native, broker, addr, "mqtt_tls", cfg)
        else:
            bound["mqtt_tls"] = await nursery.start(serve_mqtt_tls, broker, addr, tls)
    if addr := cfg.address("ws"):
        if native:
            bound["ws"] = await nursery.start(serve_native, broker, addr, "ws", cfg)
        else:
            bound["ws"] = await nursery.start(serve_mqtt_ws, broker, addr, None)
    if (addr := cfg.address("wss")) and tls is not None:
        if native:
            bound["wss"] = await nursery.start(serve_native, broker, addr, "wss", cfg)
        else:
            bound["wss"] = await nursery.start(serve_mqtt_ws, broker, addr, tls)
    return bound


async def _reread_tls(tls: ServerTLS) -> list[str]:
    return [f"{path} changed: new connections get it, open ones keep theirs"
            for path in tls.contexts.reload()]
