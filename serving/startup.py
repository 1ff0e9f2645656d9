"""Starting and stopping a server process: addresses, start-up failures, signals.

A start-up failure the user fixes is a `StartupError`: one line on stderr, exit status 2
(lightgate.cli). Raised where the condition is found, worded with the flag (or config
key) that fixes it, so the command line prints it as it is instead of a trio traceback.
The store, the gateway and the command line all raise or catch it, hence this room.
"""

from __future__ import annotations

import errno
import logging
import signal
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TypeVar

import trio

from serving.reload import Reload
from serving.values import split_hostport

log = logging.getLogger("lightgate.serving")

E = TypeVar("E", bound=BaseException)


class StartupError(Exception):
    """A server cannot start, for a reason named in one line with the setting to change."""


class CommandError(Exception):
    """A client command (`lightgate simulate`, ...) failed for a reason the user fixes,
    said in one line with the flag to change: status 1 (lightgate.cli)."""


# What a failed bind means to someone starting a server, by errno.
_BIND_REASONS = {
    errno.EADDRINUSE: "the address is already in use (another process listens there)",
    errno.EADDRNOTAVAIL: "no local interface has that address",
    errno.EACCES: "permission denied (ports below 1024 need root or CAP_NET_BIND_SERVICE)",
}


@contextmanager
def listening(what: str, flag: str, addr: str) -> Iterator[None]:
    """Around opening the listener `what` (e.g. "MQTT over WebSocket") configured by `flag`
    at `addr`: a bad address or a failed bind becomes a StartupError naming both."""
    try:
        yield
    except ValueError as exc:  # split_hostport: not HOST:PORT
        raise StartupError(f"{flag} {addr!r} is not HOST:PORT ({exc})") from exc
    except (OSError, BaseExceptionGroup) as exc:  # a server's nursery may wrap it (hypercorn)
        failed = first_of(exc, OSError)
        if failed is None:
            raise
        raise StartupError(_cannot_listen(_bind_reason(failed), [(what, flag, addr)])) \
            from exc


def _bind_reason(failed: OSError) -> str:
    return _BIND_REASONS.get(failed.errno or 0) or failed.strerror or str(failed)


def _cannot_listen(reason: str, listeners: list[tuple[str, str, str]]) -> str:
    """"X cannot listen on A, Y on B: reason; choose others with --x and --y HOST:PORT"."""
    where = [f"{what} on {addr}" for what, _, addr in listeners]
    where[0] = where[0].replace(" on ", " cannot listen on ", 1)
    flags = [flag for _, flag, _ in listeners]
    return (f"{_and(where)}: {reason}; choose {'another' if len(flags) == 1 else 'others'} "
            f"with {_and(flags)} HOST:PORT (port 0 picks a free one)")


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def check_ports(listeners: list[tuple[str, str, str | None]]) -> None:
    """Before anything opens, try to bind each (what, flag, addr) listener's address and
    let it go: ports in use are then reported at once, every one in the one line (not
    one a run), and not after the store's recovery (which logs, and may take long). The
    real bind later still reports a port taken in between. Port 0 and disabled
    listeners are skipped."""
    failed: dict[str, list[tuple[str, str, str]]] = {}  # reason -> the listeners
    first: OSError | None = None  # (the traceback --log-level debug shows)
    for what, flag, addr in listeners:
        if not addr:
            continue
        with listening(what, flag, addr):
            host, port = split_hostport(addr)
        if port == 0:
            continue
        try:
            for family, kind, proto, _, sockaddr in socket.getaddrinfo(
                    host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE):
                with socket.socket(family, kind, proto) as probe:
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    probe.bind(sockaddr)
        except OSError as exc:
            failed.setdefault(_bind_reason(exc), []).append((what, flag, addr))
            first = first or exc
    if failed:
        raise StartupError("; and ".join(_cannot_listen(reason, taken)
                                         for reason, taken in failed.items())) from first


NATIVE_LISTENER = ("the native protocol", "--native")
HTTP_LISTENER = ("HTTP (dashboard, admin API, metrics)", "--http")


def first_of(exc: BaseException, kind: type[E]) -> E | None:
    """`exc` itself if it is a `kind`, else the first `kind` inside its groups."""
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = first_of(inner, kind)
            if found is not None:
                return found
    return None


# SIGTERM/SIGINT (and SIGHUP) as they arrive (signal numbers), from `shutdown_signals`.
Signals = AsyncIterator[int]


def shutdown_signals() -> AbstractContextManager[Signals]:
    """Catch SIGTERM/SIGINT from the very start, so that one arriving while the server
    starts (before `ready`) still ends in a clean stop, not a kill; and SIGHUP, whose
    default would kill the process too: it asks for a reload (`stop_on_signal`)."""
    return trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


async def stop_on_signal(signals: Signals, nursery: trio.Nursery,
                         reload: Reload | None = None) -> None:
    """Cancel `nursery` on SIGTERM or SIGINT; on SIGHUP run `reload` (serving.reload)
    beside the server, which goes on."""
    async for signum in signals:
        if signum == signal.SIGHUP:
            if reload is None:
                log.info("SIGHUP: nothing to re-read")
            else:
                nursery.start_soon(reload.run)
            continue
        log.info("signal %s: shutting down", signal.Signals(signum).name)
        nursery.cancel_scope.cancel()
        return


def read_secret(value: str, flag: str) -> str:
    """A secret given as VALUE or @FILE (the file's contents, one trailing newline
    dropped, as editors add one); a missing or empty file is a StartupError."""
    if not value.startswith("@"):
        return value
    try:
        data = Path(value[1:]).read_text()
    except OSError as exc:
        raise StartupError(f"{flag}: cannot read {value[1:]!r} ({exc.strerror})") from exc
    secret = data[:-1] if data.endswith("\n") else data
    if not secret:
        raise StartupError(f"{flag}: {value[1:]!r} is empty")
    return secret
