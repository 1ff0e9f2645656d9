"""Notify: topic-name events ("queue X has new data"), merged per short window and
broadcast to every gateway (DESIGN.md step 5). In-process (`LocalBus`) for one node,
Redis pub/sub (`RedisBus`) across nodes; `open_bus(url)` picks one."""

from notify.bus import RESYNC, Bus, Counters, Subscription, open_bus
from notify.local import LocalBus
from notify.redis_transport import CHANNEL, RedisBus

__all__ = ["CHANNEL", "RESYNC", "Bus", "Counters", "LocalBus", "RedisBus", "Subscription",
           "open_bus"]
