"""The README's two commands, as make plans them (`make -n`) for a fresh virtualenv:
`make serve` installs the package alone, `make test` the test extras too, and neither
repeats what the other already installed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def plan(target: str, venv: Path) -> list[str]:
    """The commands `make TARGET` would run with its virtualenv at `venv`."""
    # Under `make test` this make is a sub-make: without these it would print
    # "Entering/Leaving directory" lines (and inherit the parent's flags).
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    res = subprocess.run(["make", "--no-print-directory", "-n", target, f"VENV={venv}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=30, check=True,
                         env=env)
    return res.stdout.splitlines()


def installs(lines: list[str]) -> list[str]:
    return [ln for ln in lines if re.search(r"/pip install .*-e ", ln)]


def touched(lines: list[str]) -> list[Path]:
    """What the plan's `touch` lines mark as done, so a test can leave the venv as that
    target would (without spending minutes in pip)."""
    return [Path(p) for ln in lines if ln.startswith("touch ") for p in ln.split()[1:]]


def test_serve_installs_only_the_runtime_dependencies(tmp_path: Path) -> None:
    venv = tmp_path / ".venv"
    lines = plan("serve", venv)
    assert f"python3 -m venv {venv}" in lines
    assert installs(lines) == [f"{venv}/bin/pip install -q -e ."]
    assert lines[-1] == f"{venv}/bin/lightgate serve"


def test_test_installs_the_extras_after_serve_and_serve_reuses_them(tmp_path: Path) -> None:
    venv = tmp_path / ".venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    for stamp in touched(plan("serve", venv)):  # as after `make serve`
        stamp.touch()
    assert installs(plan("serve", venv)) == []
    test_plan = plan("test", venv)
    assert [ln.split("-e ", 1)[1] for ln in installs(test_plan)] == [
        "'.[test,bench]'", "'.[test,bench,spark]'"]
    assert any("pytest" in ln for ln in test_plan)
    for stamp in touched(test_plan):  # as after `make test`
        stamp.touch()
    assert installs(plan("test", venv)) == []
    assert installs(plan("serve", venv)) == []  # the test extras include the package
