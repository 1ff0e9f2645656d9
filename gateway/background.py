"""Background work of the gateway (expiry, delayed wills, shared groups, periodic
flushes): started in one nursery, and never allowed to end the gateway."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from gateway.stats import Stats
from serving.rate_limited_log import RateLimitedLog
from store.api import StoreError

log = logging.getLogger("lightgate.gateway")
_refused = RateLimitedLog(log)

Work = Callable[..., Awaitable[object]]


class Background:
    def __init__(self, stats: Stats) -> None:
        self.stats = stats
        self.nursery: trio.Nursery | None = None  # set while housekeeping runs

    @property
    def running(self) -> bool:
        return self.nursery is not None

    def spawn(self, fn: Work, *args: Any) -> None:
        """Run `fn` guarded in the housekeeping nursery. At shutdown that nursery closes
        while connections are still closing: what they would start is left to the next
        start, which restores sessions and wills from the store."""
        if self.nursery is None:
            return
        try:
            self.nursery.start_soon(self.guarded, fn, *args)
        except RuntimeError:  # "Nursery is closed to new arrivals"
            log.debug("shutting down: %s not started", _what(fn))

    def start(self, fn: Work, *args: Any) -> None:
        """Run `fn` as it is (it handles its own failures); housekeeping must run."""
        assert self.nursery is not None, "housekeeping must run before clients connect"
        self.nursery.start_soon(fn, *args)

    async def guarded(self, fn: Work, *args: Any) -> None:
        """Run background work that must not end the gateway: a store away, hung or
        refusing (or a bug) is logged and counted; whatever retries does so later (the
        loops' next round, the expiry sweep, the stored will record)."""
        try:
            await fn(*args)
        except StoreError as exc:  # each round would say it again (a full disk: 2/s)
            self.stats.store_errors += 1
            _refused.note(f"{_what(fn)} failed, tried again later: {exc}")
        except Exception:
            self.stats.store_errors += 1
            log.exception("%s failed", _what(fn))

    async def every(self, interval: float, fn: Callable[[], Awaitable[object]], *,
                    at_once: bool = False) -> None:
        """`fn` every `interval` seconds for as long as the gateway runs (guarded)."""
        if not at_once:
            await trio.sleep(interval)
        while True:
            await self.guarded(fn)
            await trio.sleep(interval)


def _what(fn: Work) -> str:
    """A background task's name for the log (`publish_sys`, not a bound method's repr)."""
    return str(getattr(fn, "__name__", fn))
