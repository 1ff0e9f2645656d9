"""One CommitLog segment file, named by its base offset (20 zero-padded digits)."""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

NAME_DIGITS = 20


def segment_name(base: int) -> str:
    return f"{base:0{NAME_DIGITS}d}"


def is_segment_name(name: str) -> bool:
    return len(name) == NAME_DIGITS and name.isdigit()


class Segment:
    """A segment opened for reading with pread; reference-counted so retention never
    deletes a file under a reader."""

    def __init__(self, path: Path, base: int) -> None:
        self.path = path
        self.base = base
        self._fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
        self._lock = threading.Lock()
        self._refs = 0
        self.doomed = False  # retention wants it gone; unlinked when the last reader leaves

    @property
    def end(self) -> int:
        return self.base + self.size()

    def size(self) -> int:
        if self._fd < 0:  # closed or deleted
            return self.path.stat().st_size if self.path.exists() else 0
        return os.fstat(self._fd).st_size

    def acquire(self) -> bool:
        with self._lock:
            if self.doomed:
                return False
            self._refs += 1
            return True

    def release(self) -> None:
        with self._lock:
            self._refs -= 1
            last = self._refs == 0 and self.doomed
        if last:
            self._destroy()

    def doom(self) -> bool:
        """Mark for deletion; delete now if unread. True if the file is gone now."""
        with self._lock:
            self.doomed = True
            idle = self._refs == 0
        if idle:
            self._destroy()
        return idle

    def _destroy(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.path.unlink(missing_ok=True)

    def pread(self, size: int, pos: int) -> bytes:
        return os.pread(self._fd, size, pos)

    def map(self) -> mmap.mmap | None:
        """Read-only map of the whole file (None when empty), for sequential scans."""
        n = self.size()
        return mmap.mmap(self._fd, n, access=mmap.ACCESS_READ) if n else None

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            self.doomed = True


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (a file just created or renamed) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# The file's data (and its size) without the rest of its metadata: Linux's fdatasync.
# macOS has none; its fsync does the same job (and, like Linux's, leaves the drive's own
# cache to the drive: docs/deployment.md#platforms).
fdatasync = getattr(os, "fdatasync", os.fsync)
