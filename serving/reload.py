"""SIGHUP: what a running server reads again (its config file, users and policies, TLS
certificates), as Mosquitto and EMQX reload on it. Each part is a step that says what it
found changed, logged one line per thing; one that finds nothing is said in one line,
and one that fails keeps what is in effect and says why in one line: a reload never
stops the server."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

log = logging.getLogger("lightgate.reload")

# A step that reads over the network (a gateway's users and policies from its store)
# gives up after this: the next SIGHUP, or the periodic refresh, tries again.
STEP_TIMEOUT_S = 10.0

# A step: re-read one thing, and say what changed, one line each.
Step = Callable[[], Awaitable[list[str]]]


class Reload:
    """The steps of one server's SIGHUP, run in order, one reload at a time."""

    def __init__(self) -> None:
        self._steps: list[tuple[str, Step]] = []
        self._lock = trio.Lock()  # a second SIGHUP waits for the first's end

    def add(self, what: str, step: Step) -> None:
        self._steps.append((what, step))

    async def run(self) -> None:
        async with self._lock:
            log.info("SIGHUP: re-reading %s", ", ".join(w for w, _ in self._steps) or
                     "nothing (no config file, users or certificates here)")
            for what, step in self._steps:
                await self._one(what, step)

    @staticmethod
    async def _one(what: str, step: Step) -> None:
        said: list[str] = []
        try:
            with trio.move_on_after(STEP_TIMEOUT_S) as late:
                said = await step()
        except Exception as exc:  # noqa: BLE001 - the one line, and the server goes on
            log.error("SIGHUP: %s not re-read, those in effect are kept: %s", what, exc)
            return
        if late.cancelled_caught:
            log.error("SIGHUP: %s not re-read within %g s, those in effect are kept",
                      what, STEP_TIMEOUT_S)
        elif not said:
            log.info("SIGHUP: %s unchanged", what)
        for line in said:
            log.info("SIGHUP: %s: %s", what, line)
