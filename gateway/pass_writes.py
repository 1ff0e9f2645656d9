"""Socket writes deferred to the end of the scheduler pass.

A delivery written the moment it is made wakes the subscriber's process while this one
still has the rest of its step to run (the publisher's ack, the store's bookkeeping, the
next read): on two cores the woken process preempts the broker about once per message
(1,500-1,800 involuntary context switches a second at 2,000 msg/s), and the broker
resumes with cold caches. Written just before trio waits for I/O, after every task of
the pass has run, a delivery costs one write per connection per pass, whatever the
number of publishers that fed it, and the broker is about to sleep anyway.

trio has no "end of pass" callback for tasks; an Instrument's `before_io_wait` is
exactly that point (called once per pass of the run loop), so this is one.
"""

from __future__ import annotations

import logging
from typing import Protocol

import trio

log = logging.getLogger("lightgate.gateway.writes")


class Writer(Protocol):
    def write_deferred(self) -> None: ...


class PassWrites(trio.abc.Instrument):
    """Connections with deliveries waiting for the end of this pass."""

    def __init__(self) -> None:
        self._due: dict[Writer, None] = {}  # insertion order: first come, first written

    def defer(self, conn: Writer) -> None:
        self._due[conn] = None

    def before_io_wait(self, timeout: float) -> None:
        while self._due:  # a write may start a writer task; nothing adds to _due here
            due, self._due = self._due, {}
            for conn in due:
                try:
                    conn.write_deferred()
                except Exception:  # an instrument that raises is removed by trio
                    log.exception("deferred write failed")

    def flush(self) -> None:
        """Write everything now (the instrument is being removed)."""
        self.before_io_wait(0.0)
