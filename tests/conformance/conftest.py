"""One broker for the whole conformance directory (and one with authentication on)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import Server

MAX_PACKET = 32768  # the server's Maximum Packet Size here, small enough to exceed cheaply
USER, PASSWORD = "alice", "secret-pw"


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("conformance") / "data",
                 "--max-packet-size", str(MAX_PACKET)).start()
    yield srv
    if srv.proc is not None:
        assert srv.stop() == 0, srv.logs()[-3000:]


@pytest.fixture(scope="session")
def auth_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("conformance-auth") / "data", "--auth",
                 "--init-user", f"{USER}:{PASSWORD}").start()
    yield srv
    if srv.proc is not None:
        assert srv.stop() == 0, srv.logs()[-3000:]


@pytest.fixture
def port(broker: Server) -> int:
    return broker.port


@pytest.fixture
def ws_port(broker: Server) -> int:
    """The same broker's MQTT over WebSocket listener (`--ws`)."""
    return int(broker.addrs["ws"].rsplit(":", 1)[1])
