"""Spark tests: one small local[2] session shared by the whole directory (a JVM start
costs tens of seconds on a small machine), and a `lightgate serve` per test."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Server

NEEDS = [m for m in ("pyspark", "pyarrow", "pandas") if importlib.util.find_spec(m) is None]
SKIP_REASON = (f"{', '.join(NEEDS)} not installed: pip install 'lightgate[spark]'"
               if NEEDS else "")


def java_missing() -> str | None:
    from spark_streaming.session import SparkSetupError, find_java

    try:
        find_java()
    except SparkSetupError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    if NEEDS:
        pytest.skip(SKIP_REASON)
    reason = java_missing()
    if reason:
        pytest.skip(reason)
    from spark_streaming.session import get_spark

    session = get_spark("local[2]", "lightgate-tests")
    yield session
    for q in session.streams.active:
        q.stop()
    session.stop()


@pytest.fixture
def lg(tmp_path: Path) -> Iterator[Server]:
    srv = Server(tmp_path / "data").start()
    yield srv
    if srv.proc is not None:
        assert srv.stop() == 0, srv.logs()[-3000:]
