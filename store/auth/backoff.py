"""Slow down password guessing: each failed login from a source address doubles the
delay before its next answer (up to a cap); a success or a quiet spell resets it."""

from __future__ import annotations

import time
from collections import OrderedDict

BASE_DELAY = 0.2
MAX_DELAY = 5.0
FORGET_AFTER = 300.0  # seconds without failures
MAX_TRACKED = 100_000


class FailureBackoff:
    def __init__(self, base: float = BASE_DELAY, cap: float = MAX_DELAY) -> None:
        self.base = base
        self.cap = cap
        self._fails: OrderedDict[str, tuple[int, float]] = OrderedDict()

    def delay(self, source: str) -> float:
        """Seconds to wait before answering a login attempt from `source`."""
        entry = self._fails.get(source)
        if entry is None:
            return 0.0
        count, last = entry
        if time.monotonic() - last > FORGET_AFTER:
            del self._fails[source]
            return 0.0
        return min(self.base * (2 ** (count - 1)), self.cap)

    def failed(self, source: str) -> None:
        count = self._fails.pop(source, (0, 0.0))[0]
        self._fails[source] = (count + 1, time.monotonic())
        while len(self._fails) > MAX_TRACKED:
            self._fails.popitem(last=False)

    def succeeded(self, source: str) -> None:
        self._fails.pop(source, None)
