"""A condition that recurs (an accept that fails, a connection refused) logged once in a
while, with how often it recurred in between, instead of once per occurrence: a node
under attack must not also fill its disk and its operator's screen."""

from __future__ import annotations

import logging
import time

INTERVAL_S = 10.0


class RateLimitedLog:
    """`note(message)` logs `message` at most once per `interval` seconds (per distinct
    message; callers keep the variable parts out of it)."""

    def __init__(self, logger: logging.Logger, level: int = logging.WARNING,
                 interval: float = INTERVAL_S) -> None:
        self.logger = logger
        self.level = level
        self.interval = interval
        self._seen: dict[str, tuple[float, int]] = {}  # message -> (logged at, since)

    def note(self, message: str, exc_info: BaseException | None = None) -> bool:
        """Log `message` unless it was logged within the interval; True if logged."""
        now = time.monotonic()
        last, since = self._seen.get(message, (-self.interval, 0))
        if now - last < self.interval:
            self._seen[message] = (last, since + 1)
            return False
        more = f" (and {since} more times in the last {now - last:.0f} s)" if since else ""
        self.logger.log(self.level, "%s%s", message, more, exc_info=exc_info)
        self._seen[message] = (now, 0)
        return True


class RateLimitFilter(logging.Filter):
    """The same for another library's log lines (trio's accept loop logs a failed accept
    every 0.1 s, with a traceback): a record passes once per interval per message
    template, without its traceback."""

    def __init__(self, interval: float = INTERVAL_S) -> None:
        super().__init__()
        self.interval = interval
        self._last: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        key = str(record.msg)
        if now - self._last.get(key, -self.interval) < self.interval:
            return False
        self._last[key] = now
        record.exc_info = None
        record.exc_text = None
        return True
