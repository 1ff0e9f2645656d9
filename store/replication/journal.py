"""The controller's Raft journal, written so that a full disk is an error, not a signal.

pysyncobj's FileJournal writes through a memory map that it grows with ftruncate: on a
full filesystem a store into a page no block backs kills the process with SIGBUS. This
journal keeps FileJournal's record format (a journal pysyncobj wrote opens here) but
writes with pwrite into space reserved ahead with posix_fallocate:

- Reserving may fail with ENOSPC, an OSError raised before anything changed (the entry
  is neither on disk nor in memory; pysyncobj sends it again, or the leader does).
  Writing into reserved space cannot fail for want of space.
- RESERVE_BYTES stay reserved past the last record, so Raft goes on for a long while on
  a full disk (the journal only grows between compactions), and `short` says when the
  reserve could not be topped up.
- The term, vote and commit index live in a file of two fixed slots written in turn, in
  place (never a new block), so a vote is stored on a full disk too.

Every write is fdatasync'ed before pysyncobj acts on it (Raft's rule: a term, a vote or an
entry is durable before any message that relies on it leaves)."""

from __future__ import annotations

import errno
import json
import logging
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import pysyncobj.syncobj
from pysyncobj.journal import (
    APP_NAME,
    APP_VERSION,
    FIRST_RECORD_OFFSET,
    JOURNAL_FORMAT_VERSION,
    LAST_RECORD_OFFSET_OFFSET,
    NAME_SIZE,
    VERSION_SIZE,
    Journal,
    MemoryJournal,
    MetaStorer,
)
from pysyncobj.pickle import to_bytes

from store.segment import fdatasync

log = logging.getLogger("lightgate.store.controller")

RESERVE_BYTES = 4 << 20  # reserved past the last record (a compaction's worth: ~15k entries)
SLOT_BYTES = 4096
_SLOT_HEAD = struct.Struct("<4sQII")  # magic, sequence, payload length, crc32
_MAGIC = b"LGRS"
_SIZE = struct.Struct("<I")
_IDX_TERM = struct.Struct("<QQ")

# FileJournal's header: name, version, format, where the records end (none yet).
_HEADER = (APP_NAME.ljust(NAME_SIZE, b"\0") + APP_VERSION.ljust(VERSION_SIZE, b"\0")
           + struct.pack("<II", JOURNAL_FORMAT_VERSION, FIRST_RECORD_OFFSET))


def _pwrite(fd: int, data: bytes, offset: int) -> None:
    """All of `data` or an OSError (a short write to a file means no space)."""
    if os.pwrite(fd, data, offset) != len(data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class _Slots:
    """A small dict kept in two fixed slots of a preallocated file, written in turn: a
    write that dies half-way leaves the other slot whole."""

    def __init__(self, path: Path) -> None:
        fresh = not path.exists()
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        if fresh or os.fstat(self._fd).st_size < 2 * SLOT_BYTES:
            try:
                os.posix_fallocate(self._fd, 0, 2 * SLOT_BYTES)
            except OSError as exc:  # a full disk at start: writes will say so
                log.error("controller: no space for its Raft state file %s: %s", path, exc)
        self.seq, self.value = 0, {}
        for slot in (0, 1):
            got = self._read(slot)
            if got is not None and got[0] >= self.seq:
                self.seq, self.value = got

    def _read(self, slot: int) -> tuple[int, dict[str, Any]] | None:
        raw = os.pread(self._fd, SLOT_BYTES, slot * SLOT_BYTES)
        if len(raw) < _SLOT_HEAD.size:
            return None
        magic, seq, size, crc = _SLOT_HEAD.unpack_from(raw)
        payload = raw[_SLOT_HEAD.size:_SLOT_HEAD.size + size]
        if magic != _MAGIC or len(payload) != size or zlib.crc32(payload) != crc:
            return None
        return seq, json.loads(payload)

    def write(self, value: dict[str, Any]) -> None:
        payload = json.dumps(value).encode()
        if _SLOT_HEAD.size + len(payload) > SLOT_BYTES:
            raise ValueError("Raft state too large for its slot")
        seq = self.seq + 1
        data = _SLOT_HEAD.pack(_MAGIC, seq, len(payload), zlib.crc32(payload)) + payload
        _pwrite(self._fd, data, (seq % 2) * SLOT_BYTES)
        fdatasync(self._fd)
        self.seq, self.value = seq, dict(value)

    def close(self) -> None:
        os.close(self._fd)


_OPEN: dict[str, ReservedJournal] = {}  # path -> the journal open there (pysyncobj's)


def opened(path: str) -> ReservedJournal | None:
    """The journal pysyncobj has open at `path` (its owner asks how it is doing)."""
    return _OPEN.get(path)


class ReservedJournal(Journal):
    """pysyncobj's Journal interface on FileJournal's format, in reserved space."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.short: str | None = None  # why the reserve could not be topped up
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        size = os.fstat(self._fd).st_size
        if size < FIRST_RECORD_OFFSET:
            _pwrite(self._fd, _HEADER, 0)
            size = len(_HEADER)
        self._entries: list[tuple[bytes, int, int]] = []
        self._offsets: list[int] = []  # where each entry's record starts
        end = _SIZE.unpack(os.pread(self._fd, 4, LAST_RECORD_OFFSET_OFFSET))[0]
        data = os.pread(self._fd, end, 0)
        pos = FIRST_RECORD_OFFSET
        while pos < end:
            n = _SIZE.unpack_from(data, pos)[0]
            idx, term = _IDX_TERM.unpack_from(data, pos + 4)
            self._entries.append((data[pos + 4 + _IDX_TERM.size:pos + 4 + n], idx, term))
            self._offsets.append(pos)
            pos += n + 8
        self._end = pos
        # Bytes of the file known to have blocks behind them: none yet, for FileJournal's
        # files may be sparse. Without room for the holes now (said in the log), writing
        # into them later fills them or fails with ENOSPC: an error either way.
        self._allocated = 0
        try:
            self._reserve(self._end)
        except OSError:
            self._allocated = size
        state = Path(path + ".state")
        legacy = not state.exists() and Path(path + ".meta").exists()
        self._state = _Slots(state)
        if legacy:  # a journal of pysyncobj's: its term, vote and commit index
            meta = MetaStorer(path + ".meta").getMeta()
            self._state.write({k: meta[k] for k in
                               ("currentTerm", "votedForNodeId", "raftCommitIndex")
                               if k in meta})
        self._meta = dict(self._state.value)
        self._meta_saved = True
        _OPEN[path] = self

    # -- space -----------------------------------------------------------------------
    def _reserve(self, end: int) -> None:
        """Make sure the file has blocks up to `end`, topping the reserve up when it runs
        low; raises OSError (nothing written) when `end` itself cannot be had."""
        if end + RESERVE_BYTES // 2 <= self._allocated:
            return
        try:
            os.posix_fallocate(self._fd, 0, end + RESERVE_BYTES)
        except OSError as exc:
            if self.short is None:
                log.error("controller: no space to reserve for its Raft journal %s (%s); "
                          "%d bytes of reserve left", self.path, exc,
                          max(0, self._allocated - end))
            self.short = str(exc)
            if end > self._allocated:
                raise
            return
        if self.short is not None:
            log.warning("controller: space reserved for its Raft journal again")
        self.short = None
        self._allocated = end + RESERVE_BYTES

    def _set_end(self, end: int) -> None:
        _pwrite(self._fd, _SIZE.pack(end), LAST_RECORD_OFFSET_OFFSET)
        fdatasync(self._fd)

    # -- entries ---------------------------------------------------------------------
    def add(self, command: bytes, idx: int, term: int) -> None:
        body = _IDX_TERM.pack(idx, term) + to_bytes(command)
        record = _SIZE.pack(len(body)) + body + _SIZE.pack(len(body))
        end = self._end + len(record)
        self._reserve(end)
        _pwrite(self._fd, record, self._end)
        self._set_end(end)
        self._entries.append((command, idx, term))
        self._offsets.append(self._end)
        self._end = end

    def clear(self) -> None:
        self._set_end(FIRST_RECORD_OFFSET)
        self._entries, self._offsets, self._end = [], [], FIRST_RECORD_OFFSET

    def deleteEntriesFrom(self, entryFrom: int) -> None:  # noqa: N802 - pysyncobj's name
        if entryFrom >= len(self._entries):
            return
        end = self._offsets[entryFrom]
        self._set_end(end)
        del self._entries[entryFrom:]
        del self._offsets[entryFrom:]
        self._end = end

    def deleteEntriesTo(self, entryTo: int) -> None:  # noqa: N802 - pysyncobj's name
        """Drop the entries before `entryTo` (after a snapshot): the rest is written
        again from the start, in space the file already has."""
        keep = self._entries[entryTo:]
        self.clear()
        for entry in keep:
            self.add(*entry)

    def __getitem__(self, item: Any) -> Any:
        return self._entries[item]

    def __len__(self) -> int:
        return len(self._entries)

    # -- term, vote, commit index ------------------------------------------------------
    def setRaftCommitIndex(self, raftCommitIndex: int) -> None:  # noqa: N802, N803
        self._meta["raftCommitIndex"] = raftCommitIndex
        self._meta_saved = False

    def getRaftCommitIndex(self) -> int:  # noqa: N802
        return int(self._meta.get("raftCommitIndex", 1))

    def setCurrentTerm(self, term: int, votedForNodeId: Any) -> None:  # noqa: N802, N803
        meta = {**self._meta, "currentTerm": term, "votedForNodeId": votedForNodeId}
        self._state.write(meta)  # durable before the vote or the term is acted on
        self._meta, self._meta_saved = meta, True

    def getCurrentTerm(self) -> int:  # noqa: N802
        return int(self._meta.get("currentTerm", 0))

    def getVotedForNodeId(self) -> Any:  # noqa: N802
        return self._meta.get("votedForNodeId")

    def onOneSecondTimer(self) -> None:  # noqa: N802
        if not self._meta_saved:
            self._state.write(self._meta)
            self._meta_saved = True

    def flush(self) -> None:
        fdatasync(self._fd)

    def _destroy(self) -> None:
        if _OPEN.get(self.path) is self:
            del _OPEN[self.path]
        for close in (lambda: os.close(self._fd), self._state.close):
            try:
                close()
            except OSError as exc:
                if exc.errno != errno.EBADF:
                    raise


def open_journal(journalFile: str | None = None) -> Journal:  # noqa: N803 - pysyncobj's
    """pysyncobj's createJournal, with ReservedJournal for files."""
    return MemoryJournal() if journalFile is None else ReservedJournal(journalFile)


def install() -> None:
    """Make pysyncobj open its journals with open_journal (it names createJournal at
    construction; the version is pinned below 0.4 in pyproject.toml)."""
    pysyncobj.syncobj.createJournal = open_journal  # type: ignore[attr-defined]
