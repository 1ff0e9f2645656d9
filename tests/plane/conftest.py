"""A real `lightgate serve` on the native plane, for the tests of this directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Server


def native_server(data: Path, monkeypatch: pytest.MonkeyPatch, *extra: str) -> Server:
    monkeypatch.setenv("LIGHTGATE_NATIVE", "1")
    return Server(data, *extra).start()


@pytest.fixture
def srv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    s = native_server(tmp_path / "data", monkeypatch)
    yield s
    if s.proc is not None:
        assert s.stop() == 0, s.logs()[-3000:]
