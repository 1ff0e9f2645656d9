"""The controller's Raft journal (store.replication.journal): pysyncobj's file format, and
a full disk that is an OSError in the caller, never a signal that kills the process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pysyncobj.journal import FileJournal

from store.replication.journal import RESERVE_BYTES, ReservedJournal
from tests.conftest import ROOT, free_bytes


def test_reads_pysyncobj_journals_and_keeps_what_it_writes(tmp_path: Path) -> None:
    path = str(tmp_path / "raft.journal")
    old = FileJournal(path)
    for i in range(1, 6):
        old.add(b"cmd%d" % i, i, 1)
    old.setCurrentTerm(3, "127.0.0.1:7000")
    old.setRaftCommitIndex(4)
    old.onOneSecondTimer()
    old._destroy()

    j = ReservedJournal(path)
    assert [j[i] for i in range(len(j))] == [(b"cmd%d" % i, i, 1) for i in range(1, 6)]
    assert (j.getCurrentTerm(), j.getVotedForNodeId(), j.getRaftCommitIndex()) == (
        3, "127.0.0.1:7000", 4)
    j.deleteEntriesFrom(3)  # a leader's log says otherwise from entry 4 on
    j.add(b"new", 4, 2)
    j.deleteEntriesTo(1)  # a snapshot covers entry 1
    j.setCurrentTerm(4, None)
    j.setRaftCommitIndex(4)
    j.onOneSecondTimer()
    assert Path(path).stat().st_blocks * 512 >= RESERVE_BYTES  # space held in advance
    j._destroy()

    again = ReservedJournal(path)
    assert list(again._entries) == [(b"cmd2", 2, 1), (b"cmd3", 3, 1), (b"new", 4, 2)]
    assert (again.getCurrentTerm(), again.getVotedForNodeId(),
            again.getRaftCommitIndex()) == (4, None, 4)
    again._destroy()


FILL_AND_WRITE = """
import errno, sys
from store.replication.journal import ReservedJournal
j = ReservedJournal(sys.argv[1] + "/raft.journal")
with open(sys.argv[1] + "/filler", "wb", buffering=0) as f:
    for size in (1 << 20, 4096, 1):
        try:
            while True:
                f.write(b"\\0" * size)
        except OSError:
            pass
written = 0
for i in range(200_000):  # past the reserve: an OSError, not SIGBUS
    try:
        j.add(b"x" * 200, i + 1, 1)
        written += 1
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
        break
j.setCurrentTerm(7, "me")  # a vote is stored on a full disk too
print(written, j.short is not None, len(j))
"""


def test_a_full_disk_is_an_error_not_a_signal(small_fs: Path) -> None:
    res = subprocess.run([sys.executable, "-c", FILL_AND_WRITE, str(small_fs)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    written, short, entries = res.stdout.split()
    # It went on in its reserve after the disk filled, said so, then refused.
    assert int(written) * 200 > RESERVE_BYTES // 2 and short == "True", res.stdout
    assert int(entries) == int(written)
    assert free_bytes(small_fs) == 0
    (small_fs / "filler").unlink()
    j = ReservedJournal(str(small_fs / "raft.journal"))  # all of it is there
    assert len(j) == int(written) and j.getCurrentTerm() == 7
    j.add(b"more", int(written) + 1, 1)  # and it writes again
    assert len(j) == int(written) + 1
    j._destroy()
