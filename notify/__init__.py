"""Notify: topic-name events ("queue X has new data"), merged per short window and
broadcast to every gateway, so that sessions reading a queue are woken instead of
polling it. In-process (`LocalBus`) for one node, Redis pub/sub (`RedisBus`) across
nodes; `open_bus(url)` picks one.

`open_bus` lives here, the one module that knows every transport: `bus.py` defines what
a transport is and the transports build on it, so none of them imports another's user.
"""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from notify.bus import RESYNC, Bus, Counters, Grown, Subscription
from notify.local import LocalBus
from notify.redis_transport import CHANNEL, RedisBus

__all__ = ["CHANNEL", "RESYNC", "Bus", "Counters", "Grown", "LocalBus", "RedisBus", "Subscription",
           "open_bus"]


@asynccontextmanager
async def open_bus(url: str | None = None, **options: Any) -> AsyncIterator[Bus]:
    """None, "" or "local": in-process (LocalBus); "redis://HOST:PORT[/DB]" (or rediss://,
    unix://): across nodes via Redis pub/sub (RedisBus). `options` go to the bus;
    `receive=False` (Redis): a node that only publishes (a store) reads no events."""
    if url in (None, "", "local"):
        options.pop("receive", None)  # in-process: nothing to read that is not asked for
        async with LocalBus(**options) as bus:
            yield bus
    elif url.startswith(("redis://", "rediss://", "unix://")):
        async with RedisBus(url, **options) as rbus:
            yield rbus
    else:
        raise ValueError(f"unknown notify transport {url!r}: use 'local' or redis://HOST:PORT")
