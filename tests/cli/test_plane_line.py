"""Every server says which data plane runs it: its ready line ends with `plane=native` or
`plane=python`, and where the native plane is not there (here: LIGHTGATE_NATIVE=0; a
build without Rust and an extension that does not load: tests/ops/test_packaging.py) one
WARNING line at start-up says why, what it costs and where the docs are. A store in no
group runs the native writer and server where the extension is there (a group's nodes
keep Python's), and says so; a separated gateway carries its plain-TCP publishers and
clean sessions' subscribers natively where the extension is there."""

from __future__ import annotations

from pathlib import Path

import pytest

from serving import plane
from tests.conftest import Server

DOCS = "docs/deployment.md#platforms-and-the-native-plane"


def _warnings(server: Server) -> list[str]:
    assert server.wait_log("shutting down"), server.logs()  # its whole start-up log is in
    return [ln for ln in server.log if " WARNING " in ln and "native data plane" in ln]


def test_serve_off_says_why_and_what_it_costs(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTGATE_NATIVE", "0")
    server = Server(tmp_path / "d").start()
    assert list(server.addrs)[-1] == "plane" and server.addrs["plane"] == "python"
    assert server.stop() == 0
    warned = _warnings(server)
    assert len(warned) == 1, server.logs()
    assert "the native data plane is off (LIGHTGATE_NATIVE=0)" in warned[0]
    assert "messages a second" in warned[0] and "CPU a message" in warned[0]
    assert DOCS in warned[0]


def test_serve_native_says_nothing_more(tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    if plane.NATIVE is None:
        pytest.skip("the native extension is not installed")
    monkeypatch.delenv("LIGHTGATE_NATIVE", raising=False)
    server = Server(tmp_path / "d").start()
    assert list(server.addrs)[-1] == "plane" and server.addrs["plane"] == "native"
    assert server.stop() == 0
    assert _warnings(server) == []


@pytest.mark.parametrize("native", ["default", "0"])
def test_a_store_and_a_gateway_say_their_plane(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               native: str) -> None:
    if native == "0":
        monkeypatch.setenv("LIGHTGATE_NATIVE", "0")
    else:
        monkeypatch.delenv("LIGHTGATE_NATIVE", raising=False)
    store = Server(tmp_path / "d", command="store").start()
    try:
        off = native == "0" or plane.NATIVE is None
        assert list(store.addrs)[-1] == "plane"
        assert store.addrs["plane"] == ("python" if off else "native")
        gateway = Server(None, "--store", store.native, command="gateway").start()
        assert list(gateway.addrs)[-1] == "plane"
        assert gateway.addrs["plane"] == ("python" if off else "native")
        assert gateway.stop() == 0
        gateway_warned = _warnings(gateway)
        if off:  # its devices' messages cost the interpreter
            assert len(gateway_warned) == 1 and "appends to the store run in Python" \
                in gateway_warned[0], gateway.logs()
        else:
            assert gateway_warned == []
    finally:
        assert store.stop() == 0
    warned = _warnings(store)
    if native == "0" or plane.NATIVE is None:  # the store encodes records natively
        assert len(warned) == 1 and "each record is encoded in Python" in warned[0]
        assert DOCS in warned[0]
    else:
        assert warned == []
