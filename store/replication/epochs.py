"""Epochs (RocketMQ's epoch file, Kafka's leader-epoch cache): every mastership has an
epoch number and the CommitLog offset where it began. A node that comes back compares
its history with the master's to find where their logs part ("fork point"), cuts its log
there and rejoins as a replica. Sans-IO apart from `EpochFile` (load/save)."""

from __future__ import annotations

import os
from pathlib import Path

import orjson

EPOCHS_FILE = "epochs"

Epoch = tuple[int, int]  # (epoch, start offset)


def end_of(history: list[Epoch], index: int, log_end: int) -> int:
    """Where the epoch at `index` of `history` ends: the next one's start, or the log end."""
    return history[index + 1][1] if index + 1 < len(history) else log_end


def fork_point(master: list[Epoch], master_end: int, replica: list[Epoch],
               replica_end: int) -> int:
    """The offset up to which the replica's log is the master's log: walk the two
    histories while they agree (same epoch, same start); the replica's bytes of the last
    epoch they share are the master's only up to where the shorter of the two ended it.
    A replica with no history has nothing to keep but what it shares from offset 0 of
    epoch 0 (a log written before epochs, see `implicit`)."""
    common = 0
    for i, (epoch, start) in enumerate(replica):
        if i >= len(master) or master[i] != (epoch, start):
            break
        r_end = end_of(replica, i, replica_end)
        m_end = end_of(master, i, master_end)
        common = min(r_end, m_end)
        if r_end != m_end:
            break
    return min(common, replica_end)


def implicit(history: list[Epoch], log_end: int) -> list[Epoch]:
    """A log that has bytes but no history was written before epochs: epoch 0 from 0."""
    if not history and log_end > 0:
        return [(0, 0)]
    return history


class EpochFile:
    """DATA/epochs: the history as JSON, replaced atomically (fsync'd) on each change."""

    def __init__(self, data_dir: str | Path) -> None:
        self.path = Path(data_dir) / EPOCHS_FILE
        self.history: list[Epoch] = []
        self._saved = False  # the file holds `history` (a replica's every fetch asks)
        try:
            raw = orjson.loads(self.path.read_bytes())
            self.history = [(int(e), int(s)) for e, s in raw]
            self._saved = True
        except FileNotFoundError:
            pass

    @property
    def last_epoch(self) -> int:
        return self.history[-1][0] if self.history else 0

    def start(self, epoch: int, offset: int, log_end: int) -> None:
        """This node became master of `epoch` at log offset `offset`."""
        hist = implicit(self.history, log_end)
        if hist and hist[-1][0] >= epoch:
            raise ValueError(f"epoch {epoch} is not after {hist[-1][0]}")
        self.save([*hist, (epoch, offset)])

    def save(self, history: list[Epoch]) -> None:
        if self._saved and history == self.history:
            return
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "wb") as fh:
            fh.write(orjson.dumps([list(x) for x in history]))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        self.history = list(history)
        self._saved = True
