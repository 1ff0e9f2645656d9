"""`lightgate --version`: the installed package's version, as `$SYS/broker/version` says
it (tests/mqtt/test_sys_topics.py reads that one from a running broker)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

from tests.conftest import ROOT


def test_version_flag_prints_the_installed_version() -> None:
    res = subprocess.run([sys.executable, "-m", "lightgate", "--version"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"lightgate version {version('lightgate')}\n"
