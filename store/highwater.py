"""Each light queue's high-water mark: an offset the queue has not handed out yet, made
durable before any offset below it is given to a message. After a crash that took
records the queues' offsets were in (a torn tail, a damaged record, a power loss before
the log's fsync), recovery starts each queue at its mark at least, so an offset a reader
was given (a PULL's answer, a Spark checkpoint, a session's position) is never given to
another message.

Why a file of its own: the light-queue index has no WAL (the CommitLog is its log), and
after such a crash it lost its newest entries together with the records; the index is
also derived data that may be deleted. The marks are neither.

Cost: a mark is raised ahead of need, by a quarter of the queue's offset (1,024 to
65,536 at a time), so a queue writes a mark on its first message after a start and then
rarely (once in its first thousand messages, about 35 times in its first million); each
write is one `write` and one `fdatasync` for every queue of an append that needs one,
in the appender's path (with an async log, the store's event loop): with steps of 64,
a few new queues at a few thousand messages a second paid one every few milliseconds.
After a clean stop the marks are of no use (the log holds every record whole) and the
file is emptied.

File: records `crc32 u32 | name_len u16 | mark u64 | name`, appended; the last mark of
a queue counts; a torn last record (its append never went on) is ignored. Rewritten
whole at each start and when it holds four times what it needs to.
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from collections.abc import Iterable
from pathlib import Path

from store.segment import fdatasync, fsync_dir

MARKS_FILE = "offset-marks"
HEAD = struct.Struct(">IHQ")  # crc32 of the rest, name length, mark
STEP_MIN, STEP_MAX = 1024, 65536
COMPACT_MIN = 1 << 20  # bytes below which the file is never rewritten


def step(offset: int) -> int:
    """How far past `offset` a new mark goes: proportional to the queue's size, so a
    busy queue writes rarely, and bounded, as is the gap a crash may leave."""
    return max(STEP_MIN, min(STEP_MAX, offset // 4))


def _encode(queue: str, mark: int) -> bytes:
    name = queue.encode()
    rest = struct.pack(">HQ", len(name), mark) + name
    return struct.pack(">I", zlib.crc32(rest)) + rest


def parse(data: bytes) -> dict[str, int]:
    """The marks in a file's bytes, up to the first record that does not check."""
    marks: dict[str, int] = {}
    pos = 0
    while pos + HEAD.size <= len(data):
        crc, n, mark = HEAD.unpack_from(data, pos)
        end = pos + HEAD.size + n
        if end > len(data) or zlib.crc32(data[pos + 4:end]) != crc:
            break
        try:
            marks[data[pos + HEAD.size:end].decode()] = mark
        except UnicodeDecodeError:
            break
        pos = end
    return marks


class HighWater:
    """The marks of one CommitLog (`<commitlog dir>/offset-marks`). Raised by whoever
    assigns offsets (the CommitLog's writer, or the native engine through `cover`),
    one at a time."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / MARKS_FILE
        self._marks: dict[str, int] = {}
        self._fd = -1
        self._bytes = 0  # the file's size
        self._live = 0  # what the current marks alone would take of it
        self._lock = threading.Lock()
        self.writes = 0  # fdatasyncs of new marks since start

    def load(self) -> dict[str, int]:
        """The marks the file holds (the last run's, before `open`)."""
        try:
            return parse(self.path.read_bytes())
        except FileNotFoundError:
            return {}

    def open(self, marks: dict[str, int]) -> None:
        """Start with these marks, the file rewritten to hold them alone."""
        with self._lock:
            self._marks = dict(marks)
            self._rewrite()

    def mark(self, queue: str) -> int:
        """The queue's mark: offsets from here on were never handed out (0: no mark)."""
        return self._marks.get(queue, 0)

    def marks(self) -> dict[str, int]:
        return dict(self._marks)

    def cover(self, assigned: Iterable[tuple[str, int]]) -> None:
        """Make sure each (queue, offset) is below its queue's mark, raising the marks
        that are not (durably, before this returns: the offsets may be handed out once
        it did). OSError if they cannot be written."""
        marks = self._marks
        raised: dict[str, int] = {}
        for queue, offset in assigned:
            if offset >= marks.get(queue, 0) and offset >= raised.get(queue, 0):
                raised[queue] = offset + 1 + step(offset)
        if raised:
            self._write(raised)

    def raise_for(self, assigned: list[tuple[str, int]]) -> list[int]:
        """`cover`, and the marks of these queues after it (the native engine keeps
        them, and asks only when an offset it assigns reaches one)."""
        self.cover(assigned)
        return [self._marks.get(q, 0) for q, _ in assigned]

    def clear(self) -> None:
        """After a clean stop: the log holds every record whole, no mark is needed."""
        with self._lock:
            self._marks = {}
            self._live = 0
            if self._fd >= 0:
                os.ftruncate(self._fd, 0)
                os.fsync(self._fd)
                self._bytes = 0

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def _write(self, raised: dict[str, int]) -> None:
        with self._lock:
            data = b"".join(_encode(q, m) for q, m in raised.items())
            if self._fd < 0:
                raise OSError("the offset marks file is not open")
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
            fdatasync(self._fd)
            self._bytes += len(data)
            marks = self._marks
            self._live += sum(HEAD.size + len(q.encode()) for q in raised if q not in marks)
            marks.update(raised)
            self.writes += 1
            if self._bytes > max(COMPACT_MIN, 4 * self._live_bytes()):
                self._rewrite()

    def _live_bytes(self) -> int:
        # Kept as marks come (a walk of them all per new queue was quadratic: a fleet's
        # first round opens a queue per device).
        return self._live

    def _rewrite(self) -> None:
        """The file with the current marks alone (under the lock): written aside, synced,
        renamed over, the directory synced; then appended to."""
        tmp = self.path.with_suffix(".tmp")
        data = b"".join(_encode(q, m) for q, m in self._marks.items())
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._bytes = self._live = len(data)
