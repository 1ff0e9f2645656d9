"""The store's data directory lock: one Lightgate per --data-dir."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import IO

from serving.startup import StartupError

try:
    import fcntl
except ImportError:  # not a Unix (Windows): no flock, and no store either
    fcntl = None  # type: ignore[assignment]


def lock_data_dir(path: Path) -> IO[str]:
    """Create `path` if needed and hold an exclusive lock on `path`/lock for as long as
    the returned file stays open: two stores on one data directory would both append to
    the CommitLog. The lock file names the holder's pid for the message of the next."""
    if fcntl is None:
        raise StartupError("the store runs on Linux (and macOS, for development): this "
                           "platform has no flock to guard its data directory with")
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
