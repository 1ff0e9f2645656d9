"""Rate limits of the gateway: token buckets per client and per source address."""

from __future__ import annotations

import time
from collections import OrderedDict

MAX_TRACKED_SOURCES = 100_000


class TokenBucket:
    """`rate` tokens a second, bursts up to `burst` (default: one second's worth)."""

    def __init__(self, rate: float, burst: float | None = None) -> None:
        self.rate = rate
        self.burst = burst if burst is not None else max(rate, 1.0)
        self.tokens = self.burst
        self.stamp = time.monotonic()

    def take(self, n: float = 1.0) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < n:
            return False
        self.tokens -= n
        return True


class SourceRateLimiter:
    """Connects per second per source IP (0 = unlimited), memory bounded (LRU)."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def allow(self, source: str) -> bool:
        if self.rate <= 0:
            return True
        bucket = self._buckets.pop(source, None) or TokenBucket(self.rate)
        self._buckets[source] = bucket
        while len(self._buckets) > MAX_TRACKED_SOURCES:
            self._buckets.popitem(last=False)
        return bucket.take()


class PublishLimits:
    """Per-client publish rate in messages and bytes per second (0 = unlimited)."""

    def __init__(self, msgs_per_s: float, bytes_per_s: float) -> None:
        self._msgs = TokenBucket(msgs_per_s) if msgs_per_s > 0 else None
        self._bytes = TokenBucket(bytes_per_s) if bytes_per_s > 0 else None

    def exceeded(self, size: int) -> str | None:
        """None while within limits, else which limit was crossed."""
        if self._msgs is not None and not self._msgs.take():
            return f"more than {self._msgs.rate:g} publishes/s"
        if self._bytes is not None and not self._bytes.take(size):
            return f"more than {self._bytes.rate:g} bytes/s of publishes"
        return None
