"""A well-behaved client's round trips, timed in a thread while a test attacks the
server: the median and the longest, to hold against the same client's before the attack."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable


class Prober:
    """Calls `round_trip` again and again (every `pause` s) in a thread while in its
    `with` block, for at most `limit` s, timing each call."""

    def __init__(self, round_trip: Callable[[], object], pause: float = 0.02,
                 limit: float = 120.0) -> None:
        self.round_trip = round_trip
        self.pause = pause
        self.limit = limit
        self.times: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        until = time.monotonic() + self.limit
        while not self._stop.is_set() and time.monotonic() < until:
            started = time.monotonic()
            try:
                self.round_trip()
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                self.error = exc
                return
            self.times.append(time.monotonic() - started)
            self._stop.wait(self.pause)

    def __enter__(self) -> Prober:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    @property
    def p50(self) -> float:
        return statistics.median(self.times)

    @property
    def longest(self) -> float:
        return max(self.times)

    def __str__(self) -> str:
        if not self.times:
            return f"no round trip ({self.error!r})"
        failed = f", then {self.error!r}" if self.error is not None else ""
        return (f"{len(self.times)} round trips, p50 {self.p50 * 1000:.1f} ms, "
                f"longest {self.longest * 1000:.0f} ms{failed}")


def assert_unhurt(before: Prober, during: Prober, floor: float = 0.005) -> None:
    """During the attack: a median within twice the one before (or `floor`, as a
    loaded test machine's noise), and no round trip over 500 ms."""
    assert before.error is None and during.error is None, (before.error, during.error)
    assert len(during.times) >= 10, f"too few round trips during the attack: {during}"
    assert during.p50 <= max(2 * before.p50, floor), f"before: {before}; during: {during}"
    assert during.longest < 0.5, f"a stall: {during}"
