"""MQTT listeners: plain TCP now (TLS and WebSocket come with the security issue)."""

from __future__ import annotations

import logging
import socket

import trio

from gateway.broker import Broker
from gateway.connection import Connection
from store.http import split_hostport

log = logging.getLogger("lightgate.gateway.listener")


def _peer(stream: trio.SocketStream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "?"


async def serve_mqtt_tcp(
    broker: Broker, addr: str, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    """Accept MQTT over TCP on `addr` until cancelled; started with the bound host:port."""
    host, port = split_hostport(addr)

    async def handle(stream: trio.SocketStream) -> None:
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = Connection(broker, stream, _peer(stream))
        try:
            await conn.run()
        except Exception:  # contained: one connection never takes the server down
            log.exception("connection from %s failed", conn.peer)

    listeners = await trio.open_tcp_listeners(port, host=host, backlog=4096)
    bound = listeners[0].socket.getsockname()
    task_status.started(f"{bound[0]}:{bound[1]}")
    await trio.serve_listeners(handle, listeners)
