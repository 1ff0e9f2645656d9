"""Start-up failures the user fixes: one line on stderr, exit status 2 (lightgate.cli).

Raised where the condition is found, worded with the flag (or config key) that fixes it,
so the command line prints it as it is instead of a trio traceback. It lives in the
store room, the lowest that raises it (the gateway imports the store, never the other
way round; the `lightgate` package holds only the command line).
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TypeVar

E = TypeVar("E", bound=BaseException)


class StartupError(Exception):
    """A server cannot start, for a reason named in one line with the setting to change."""


# What a failed bind means to someone starting a server, by errno.
_BIND_REASONS = {
    errno.EADDRINUSE: "the address is already in use (another process listens there)",
    errno.EADDRNOTAVAIL: "no local interface has that address",
    errno.EACCES: "permission denied (ports below 1024 need root or CAP_NET_BIND_SERVICE)",
}


@contextmanager
def listening(what: str, flag: str, addr: str) -> Iterator[None]:
    """Around opening the listener `what` (e.g. "MQTT over WebSocket") configured by `flag`
    at `addr`: a bad address or a failed bind becomes a StartupError naming both."""
    try:
        yield
    except ValueError as exc:  # split_hostport: not HOST:PORT
        raise StartupError(f"{flag} {addr!r} is not HOST:PORT ({exc})") from exc
    except (OSError, BaseExceptionGroup) as exc:  # a server's nursery may wrap it (hypercorn)
        failed = first_of(exc, OSError)
        if failed is None:
            raise
        reason = _BIND_REASONS.get(failed.errno or 0) or failed.strerror or str(failed)
        raise StartupError(
            f"{what} cannot listen on {addr}: {reason}; choose another with "
            f"{flag} HOST:PORT (port 0 picks a free one)") from exc


def first_of(exc: BaseException, kind: type[E]) -> E | None:
    """`exc` itself if it is a `kind`, else the first `kind` inside its groups."""
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = first_of(inner, kind)
            if found is not None:
                return found
    return None


def lock_data_dir(path: Path) -> IO[str]:
    """Create `path` if needed and hold an exclusive lock on `path`/lock for as long as
    the returned file stays open: two stores on one data directory would both append to
    the CommitLog. The lock file names the holder's pid for the message of the next."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        fh = open(path / "lock", "a+")  # noqa: SIM115 - held open for the store's life
    except OSError as exc:
        raise _unusable(path, exc) from exc
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "?"
        fh.close()
        raise StartupError(f"data directory {path} is in use by another Lightgate "
                           f"(pid {holder}); stop it or choose another --data-dir") from None
    try:
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.getpid()}\n")
        fh.flush()
    except OSError as exc:
        fh.close()
        raise _unusable(path, exc) from exc
    return fh


def _unusable(path: Path, exc: OSError) -> StartupError:
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        what = "is not writable"
    elif path.exists() and not path.is_dir():
        what = "is a file, not a directory"
    else:
        what = "cannot be used"
    return StartupError(f"data directory {path} {what} ({exc.strerror or exc}); "
                        "choose another with --data-dir")
