"""The native CommitLog tail writer against store/commitlog.py, the reference: the same
records make the same segment files, byte for byte, which the Python CommitLog then
recovers and reads; a write that fails for a full disk is undone whole."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

from lightqueue.index import ConsumeQueueIndex
from serving import plane
from store import record
from store.commitlog import CommitLog
from store.record import Message

if plane.NATIVE is None:
    if os.environ.get("LIGHTGATE_NATIVE") == "1":
        pytest.fail("LIGHTGATE_NATIVE=1 but the native extension is not installed")
    pytest.skip("the native extension is not installed", allow_module_level=True)


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())
            if record_segment(p.name)}


def record_segment(name: str) -> bool:
    return len(name) == 20 and name.isdigit()


def test_same_segments_as_python(tmp_path: Path) -> None:
    py_dir, rs_dir = tmp_path / "py", tmp_path / "rs"
    log = CommitLog(py_dir, ConsumeQueueIndex(tmp_path / "py-index"), segment_size=4096)
    log.open()
    try:
        batches = [[Message(f"t/{i % 7}", os.urandom(50 + 37 * j) + bytes([i]), qos=1)
                    for j in range(i % 5 + 1)] for i in range(60)]
        stored = [log.append(b, [[m.topic, "t/+"] for m in b]).result(10) for b in batches]
    finally:
        log.close()
    rs_dir.mkdir()
    writer = plane.NATIVE.LogWriter(rs_dir, 4096, 0, 0)
    for batch in stored:
        positions, _ = writer.append([record.encode(m) for m in batch])
        assert positions == [m.phys_offset for m in batch]
    writer.sync()
    assert _files(rs_dir) == _files(py_dir)
    assert len(_files(rs_dir)) > 5

    # The Python CommitLog recovers what the native writer wrote and reads every record.
    again = CommitLog(rs_dir, ConsumeQueueIndex(tmp_path / "rs-index"), segment_size=4096)
    report = again.open()
    try:
        assert report.truncated_at is None
        flat = [m for batch in stored for m in batch]
        assert [m.body for m in again.scan(0)] == [m.body for m in flat]
        assert again.max_offset == writer.write_pos
    finally:
        again.close()


def test_a_failed_write_is_undone_whole(tmp_path: Path) -> None:
    """On a full disk the batch that did not fit leaves nothing behind: not a partial
    record, not the segment it began."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        writer = plane.NATIVE.LogWriter(mnt, 64 * 1024, 0, 0)
        msg = Message("t", b"x" * 3000, store_ts=1)
        msg.queues = [("t", 0)]
        rec = record.encode(msg)
        written = 0
        with pytest.raises(OSError) as full:
            for _ in range(1000):
                writer.append([rec] * 5)
                written += 5
        assert full.value.errno == errno.ENOSPC
        assert writer.write_pos == written * len(rec)
        on_disk = sum(p.stat().st_size for p in mnt.iterdir())
        assert on_disk == writer.write_pos, "the failed batch left bytes behind"
        assert writer.sync() == writer.write_pos
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
