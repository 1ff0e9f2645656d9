"""The damaged ranges of a CommitLog: bytes where records were and no longer check (a
flipped bit, a bad block), found by start-up verification, by the background
verification of older segments, or by a reader.

A damaged range stays where it is in its segment (records are found by their position,
so nothing after it may move); its bytes are copied to `quarantine/<start>.damaged` and
the range is listed in `damaged` (JSON), so every reader skips it at once and no record
in it is ever handed out. Records before and after it are served as before.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
from pathlib import Path

import orjson

from store.segment import fsync_dir, segment_name

log = logging.getLogger("lightgate.store.commitlog")

DAMAGED_FILE = "damaged"
QUARANTINE_DIR = "quarantine"
MAX_RANGES = 100_000  # past this, new ranges are counted and logged, not listed


class DamagedRanges:
    """[start, end) ranges of log positions, sorted, none overlapping. Any thread."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._why: list[str] = []
        self._lock = threading.Lock()
        self.unlisted = 0  # ranges found past MAX_RANGES

    def load(self, min_offset: int) -> None:
        """The ranges found before (those retention has not removed)."""
        try:
            rows = orjson.loads((self.dir / DAMAGED_FILE).read_bytes())
        except FileNotFoundError:
            return
        except (OSError, orjson.JSONDecodeError) as exc:
            log.warning("list of damaged ranges unreadable (%s): they are found again", exc)
            return
        for row in rows if isinstance(rows, list) else ():
            try:
                start, end, why = int(row[0]), int(row[1]), str(row[2])
            except (TypeError, ValueError, IndexError):
                continue
            if end > max(start, min_offset):
                self._insert(start, end, why)

    def __bool__(self) -> bool:
        return bool(self._starts)

    @property
    def count(self) -> int:
        return len(self._starts)

    @property
    def bytes(self) -> int:
        with self._lock:
            return sum(e - s for s, e in zip(self._starts, self._ends, strict=True))

    def containing(self, pos: int) -> tuple[int, int] | None:
        """The range `pos` lies in, if any."""
        if not self._starts:
            return None
        with self._lock:
            return self._containing(pos)

    def _containing(self, pos: int) -> tuple[int, int] | None:
        i = bisect.bisect_right(self._starts, pos) - 1
        if i >= 0 and pos < self._ends[i]:
            return self._starts[i], self._ends[i]
        return None

    def ranges(self) -> list[tuple[int, int, str]]:
        with self._lock:
            return self._ranges()

    def _ranges(self) -> list[tuple[int, int, str]]:
        return list(zip(self._starts, self._ends, self._why, strict=True))

    def add(self, start: int, end: int, why: str, data: bytes) -> bool:
        """A damaged range and its bytes (copied to quarantine): True if it was not known
        (any overlap with a known one merges into it)."""
        with self._lock:
            known = self._containing(start)
            if known is not None and end <= known[1]:
                return False
            if len(self._starts) >= MAX_RANGES:
                self.unlisted += 1
                return True
            self._keep(start, data)
            self._insert(start, end, why)
            self._save()
        log.warning("commitlog: %d damaged bytes at offset %d (%s): no record there is "
                    "served; readers go on after them, the bytes are kept in %s",
                    end - start, start, why, self.dir / QUARANTINE_DIR)
        return True

    def forget_below(self, offset: int) -> None:
        """Retention removed the log below `offset`."""
        with self._lock:
            n = bisect.bisect_left(self._ends, offset + 1)
            if n:
                del self._starts[:n], self._ends[:n], self._why[:n]
                self._save()

    def forget_from(self, offset: int) -> None:
        """The log was cut at `offset`: new records will be written from there."""
        with self._lock:
            n = bisect.bisect_left(self._starts, offset)
            changed = n < len(self._starts)
            del self._starts[n:], self._ends[n:], self._why[n:]
            if n and self._ends[n - 1] > offset:
                self._ends[n - 1] = offset
                changed = True
            if changed:
                self._save()

    def _insert(self, start: int, end: int, why: str) -> None:
        i = bisect.bisect_left(self._starts, start)
        # Merge with any range it touches on either side.
        while i > 0 and self._ends[i - 1] >= start:
            i -= 1
            start, end = min(start, self._starts[i]), max(end, self._ends[i])
            del self._starts[i], self._ends[i], self._why[i]
        while i < len(self._starts) and self._starts[i] <= end:
            end = max(end, self._ends[i])
            del self._starts[i], self._ends[i], self._why[i]
        self._starts.insert(i, start)
        self._ends.insert(i, end)
        self._why.insert(i, why)

    def _keep(self, start: int, data: bytes) -> None:
        qdir = self.dir / QUARANTINE_DIR
        try:
            qdir.mkdir(exist_ok=True)
            path = qdir / f"{segment_name(start)}.damaged"
            if not path.exists():
                path.write_bytes(data)
        except OSError as exc:  # the range is listed all the same
            log.warning("damaged bytes at %d not copied to quarantine: %s", start, exc)

    def _save(self) -> None:
        tmp = self.dir / (DAMAGED_FILE + ".tmp")
        try:
            with open(tmp, "wb") as fh:
                fh.write(orjson.dumps(self._ranges()))
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.dir / DAMAGED_FILE)
            fsync_dir(self.dir)
        except OSError as exc:  # found again by the next verification
            log.warning("list of damaged ranges not written: %s", exc)
