from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightqueue.index import ConsumeQueueIndex
from store.commitlog import _STOP, CommitLog


class LogFactory:
    """Opens CommitLogs (with their index) on one directory; closes what it opened."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.open_logs: list[CommitLog] = []

    def open(self, **kwargs) -> CommitLog:
        kwargs.setdefault("segment_size", 64 * 1024)
        kwargs.setdefault("flush", "async")
        log = CommitLog(self.root / "commitlog", ConsumeQueueIndex(self.root / "index"), **kwargs)
        log.report = log.open()
        self.open_logs.append(log)
        return log

    def close(self, log: CommitLog) -> None:
        log.close()
        log.index.close()
        self.open_logs.remove(log)

    def crash(self, log: CommitLog) -> None:
        """Stop without the clean-shutdown steps (abort marker stays, no checkpoint)."""
        log._closed = True
        log._requests.put(_STOP)
        log._thread.join()
        os.close(log._wfd)
        log.marks.close()
        for seg in log._segments:
            seg.close()
        log.index._db.close()
        self.open_logs.remove(log)


@pytest.fixture
def logs(tmp_path: Path) -> Iterator[LogFactory]:
    factory = LogFactory(tmp_path)
    yield factory
    for log in list(factory.open_logs):
        factory.close(log)
