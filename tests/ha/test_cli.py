"""Start-up errors of the store group's flags: one line naming the flag, exit status 2."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def _store(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightgate", "store", "--data-dir",
                           str(tmp_path / "d"), "--native", "127.0.0.1:0", "--http",
                           "127.0.0.1:0", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_group_flags_are_checked(tmp_path: Path) -> None:
    r = _store(tmp_path, "--group-peers", "127.0.0.1:1")
    assert r.returncode == 2 and "--group-peers needs --raft" in r.stderr
    r = _store(tmp_path, "--replication", "fast")
    assert r.returncode == 2 and "--replication must be sync or async" in r.stderr
    r = _store(tmp_path, "--raft", "127.0.0.1:1", "--group-peers", "127.0.0.1:2",
               "--raft-secret", "s", "--min-insync", "3")
    assert r.returncode == 2 and "--min-insync must be between 1" in r.stderr
    r = _store(tmp_path, "--raft", "127.0.0.1:1", "--group-peers", "127.0.0.1:2",
               "--raft-secret", "s", "--replica-of", "127.0.0.1:3")
    assert r.returncode == 2 and "exclude each other" in r.stderr
    r = _store(tmp_path, "--raft", "127.0.0.1:1", "--group-peers", "127.0.0.1:2",
               "--raft-secret", "s", "--controller-lease-s", "4", "--failover-after-s", "4")
    assert r.returncode == 2 and "at least --controller-lease-s + 0.5" in r.stderr


def test_a_group_needs_its_secret(tmp_path: Path) -> None:
    """Raft frames are pickles: a group without a secret would run what anyone who
    reaches its port sends, so there is none."""
    for raft in ("127.0.0.1:1", "0.0.0.0:1"):
        r = _store(tmp_path, "--raft", raft, "--group-peers", "127.0.0.1:2")
        assert r.returncode == 2 and "needs a secret: --raft-secret" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    r = _store(tmp_path, "--raft", "127.0.0.1:1", "--group-peers", "127.0.0.1:2",
               "--raft-secret", f"@{tmp_path / 'missing'}")
    assert r.returncode == 2 and "--raft-secret: cannot read" in r.stderr


def test_raft_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _store(tmp_path, "--raft", f"127.0.0.1:{port}", "--group-peers", "127.0.0.1:1",
                   "--raft-secret", "s")
    assert r.returncode == 2
    assert "Raft controller cannot listen" in r.stderr and "--raft" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
