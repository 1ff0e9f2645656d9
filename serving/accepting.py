"""Accepting connections: a listener never stops for good, never spins the CPU, and says
what goes wrong once in a while, not per accept.

What accept(2) fails with, and what a listener does about it (as trio and libuv do):

- a connection gone before it was accepted, or refused by a firewall (ECONNABORTED,
  EPROTO, EPERM, network errors): accept the next one at once;
- running out of something (EMFILE, ENFILE, ENOBUFS, ENOMEM): the listening socket stays
  readable, so trying again at once would spin; the listener rests ACCEPT_BACKOFF_S;
- anything else: rest as well, and try again. A listener that gives up is a port shut
  until the process restarts.

Client listeners also refuse a connection whose descriptor is in the node's reserve
(serving.fd_budget)."""

from __future__ import annotations

import errno
import logging
from collections.abc import Sequence

import trio

from serving.fd_budget import over_budget
from serving.rate_limited_log import RateLimitedLog, RateLimitFilter

log = logging.getLogger("lightgate.accept")

ACCEPT_BACKOFF_S = 0.1
_PER_CONNECTION = {errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.EINTR,
                   errno.ENETDOWN, errno.ENOPROTOOPT, errno.EHOSTDOWN, errno.ENONET,
                   errno.EHOSTUNREACH, errno.EOPNOTSUPP, errno.ENETUNREACH,
                   errno.ECONNRESET, errno.ETIMEDOUT}
_failures = RateLimitedLog(log, logging.ERROR)


def must_rest(exc: OSError, listener: str) -> bool:
    """What to do after accept failed with `exc`: True to rest ACCEPT_BACKOFF_S before
    the next try, False to try again at once (it was one connection's trouble)."""
    if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK) or exc.errno in _PER_CONNECTION:
        return False
    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    _failures.note(f"{listener}: accept failed with {name} ({exc.strerror}); retrying "
                   f"every {ACCEPT_BACKOFF_S} s")
    return True


def note_failure(text: str) -> None:
    """A native listener's failed accept (it rests, as `must_rest` says), said as ours."""
    _failures.note(text)


class BudgetedListener(trio.abc.Listener[trio.SocketStream]):
    """A trio socket listener that rests on accept errors instead of raising them, and
    refuses connections over the descriptor budget."""

    def __init__(self, inner: trio.SocketListener, name: str) -> None:
        self.inner = inner
        self.name = name

    @property
    def socket(self) -> trio.socket.SocketType:
        return self.inner.socket

    async def accept(self) -> trio.SocketStream:
        while True:
            try:
                stream = await self.inner.accept()
            except OSError as exc:  # not ClosedResourceError: closing still ends it
                if must_rest(exc, self.name):
                    await trio.sleep(ACCEPT_BACKOFF_S)
                continue
            if over_budget(stream.socket.fileno(), self.name):
                stream.socket.close()
                continue
            return stream

    async def aclose(self) -> None:
        await self.inner.aclose()


def budgeted(listeners: Sequence[trio.SocketListener], name: str) -> list[BudgetedListener]:
    return [BudgetedListener(listener, name) for listener in listeners]


_trio_filter = RateLimitFilter()


def quiet_trio_accept_errors() -> None:
    """trio.serve_listeners (under hypercorn) logs EMFILE with a traceback every 0.1 s
    while it lasts: once per interval is enough."""
    logger = logging.getLogger("trio.serve_listeners")
    if _trio_filter not in logger.filters:
        logger.addFilter(_trio_filter)
