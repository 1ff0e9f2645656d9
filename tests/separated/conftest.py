"""Separated mode's cluster: one `lightgate store`, two `lightgate gateway`s, a real Redis."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.conftest import RedisServer, Server


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def cluster(tmp_path, redis_server: RedisServer) -> Iterator[tuple]:
    store = Server(tmp_path / "store", "--notify", redis_server.url, command="store").start()
    gateways = [Server(None, "--store", store.native, "--notify", redis_server.url,
                       command="gateway").start() for _ in range(2)]
    yield store, gateways, redis_server
    for srv in (*gateways, store):
        if srv.proc is not None:
            assert srv.stop() == 0, srv.logs()[-2000:]
