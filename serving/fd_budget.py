"""File descriptors: room for the node's own work, whatever its clients do.

A process out of file descriptors fails where it hurts: not only a listener's accept
(EMFILE), but the CommitLog rolling a segment, RocksDB opening a table, the controller
dialling a Raft peer. So:

- at start the soft RLIMIT_NOFILE is raised to the hard limit (`raise_fd_limit`): the
  soft one is often 1,024, and the hard one what the administrator meant;
- a client connection (MQTT, native, HTTP) is refused, closed as soon as it is accepted,
  when its descriptor is at or above the *ceiling*: the limit less a reserve of a
  quarter of it, at least 128 and at most 1,024 descriptors. The kernel hands out the
  lowest free descriptor, so one at the ceiling means every one below is taken; no client
  socket ever sits at or above it, and the reserve is always there for the node's own
  files, its Raft peers and the Raft port's unauthenticated connections (capped at 64).

The check is one comparison per accepted connection; no descriptor is counted. A
platform without RLIMIT_NOFILE (no `resource` module) has no ceiling.
"""

from __future__ import annotations

import logging
import os
import sys

try:
    import resource
except ImportError:  # not a Unix: no descriptor limit to read or raise
    resource = None  # type: ignore[assignment]

from serving.rate_limited_log import RateLimitedLog

log = logging.getLogger("lightgate.fd_budget")

RESERVE_FRACTION = 4  # a quarter of the limit ...
RESERVE_MIN = 128  # ... but at least this many descriptors ...
RESERVE_MAX = 1024  # ... and no more than this many


def raise_fd_limit() -> int | None:
    """Raise the soft RLIMIT_NOFILE to the hard limit; returns the soft limit now (None
    where there is no such limit)."""
    if resource is None:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as exc:  # e.g. above fs.nr_open: keep what we have
            log.debug("RLIMIT_NOFILE stays %d: %s", soft, exc)
    _budget.ceiling = ceiling_for(soft)
    return soft


def ceiling_for(limit: int) -> int:
    """The first descriptor a client connection may not have, under `limit`."""
    reserve = min(RESERVE_MAX, max(RESERVE_MIN, limit // RESERVE_FRACTION))
    return max(limit // 2, limit - reserve)  # a tiny limit: half for clients


class _Budget:
    def __init__(self) -> None:
        self.ceiling = (ceiling_for(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
                        if resource is not None else sys.maxsize)
        self.refused = 0  # client connections refused, over the process's life
        self.log = RateLimitedLog(log, logging.WARNING)


_budget = _Budget()


def client_fd_ceiling() -> int:
    return _budget.ceiling


def refused_connections() -> int:
    return _budget.refused


# Where the process's open descriptors are listed: /proc on Linux, /dev/fd on macOS.
FD_DIRS = ("/proc/self/fd",) if sys.platform.startswith("linux") else ("/dev/fd",)


def open_fds() -> int | None:
    """How many descriptors the process has open (for /metrics and the admin API: a
    scrape, not an accept); None where the platform does not list them."""
    for path in FD_DIRS:
        try:
            return len(os.listdir(path)) - 1  # less the one listdir opened
        except OSError:
            continue
    return None


def over_budget(fd: int, listener: str) -> bool:
    """Whether the client connection on `fd`, just accepted by `listener`, must be
    refused (the caller closes it): its descriptor is in the reserve."""
    if fd < _budget.ceiling:
        return False
    refused_natively(listener, 1)
    return True


def refused_natively(listener: str, count: int) -> None:
    """`count` client connections `listener` refused for the reserve (the native
    listeners check `client_fd_ceiling` themselves): counted and said."""
    _budget.refused += count
    _budget.log.note(
        f"{listener}: client connections refused: the process's file descriptors are "
        f"used up to the {_budget.ceiling} kept for clients (the rest is the node's own)")
