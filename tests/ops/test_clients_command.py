"""`lightgate clients list|kick` against a real `lightgate serve`, with real paho clients,
on both planes: a connection the native plane carries is listed as such and kicked too
(MQTT 5: DISCONNECT 0x98, Administrative action)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from serving import plane
from tests.conftest import ROOT, Server

ADMIN = "admin:admin-pw"


def lightgate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightgate", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


class Device:
    """A paho client that remembers the reason code of the DISCONNECT it got."""

    def __init__(self, port: int, client_id: str, version: int, *topics: str,
                 auth: tuple[str, str] | None = None) -> None:
        proto = paho.MQTTv5 if version == 5 else paho.MQTTv311
        self.c = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=proto,
                             reconnect_on_failure=False)
        if auth:
            self.c.username_pw_set(*auth)
        self.ready, self.gone = threading.Event(), threading.Event()
        self.reason: int | None = None
        self.c.on_connect = lambda *a: self.ready.set()
        self.c.on_disconnect = self._gone
        self.c.on_subscribe = lambda *a: self.ready.set()
        self.c.connect("127.0.0.1", port)
        self.c.loop_start()
        assert self.ready.wait(10), "no CONNACK"
        for topic in topics:
            self.ready.clear()
            self.c.subscribe(topic, 1)
            assert self.ready.wait(10), "no SUBACK"

    def _gone(self, client, userdata, flags, reason_code, properties) -> None:
        self.reason = reason_code.value
        self.gone.set()

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


@pytest.fixture(params=["native", "python"])
def srv(request: pytest.FixtureRequest, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    if request.param == "native" and plane.require_native() is not None:
        pytest.skip("the native plane is not built here")
    monkeypatch.setenv("LIGHTGATE_NATIVE", "1" if request.param == "native" else "0")
    s = Server(tmp_path / "data").start()
    assert s.addrs["plane"] == request.param
    yield s
    if s.proc is not None:
        assert s.stop() == 0, s.logs()[-3000:]


def rows(srv: Server, *extra: str) -> dict[str, dict]:
    res = lightgate("clients", "list", "--json", "--http", srv.addrs["http"], *extra)
    assert res.returncode == 0, res.stderr
    return {row["client_id"]: row for row in map(json.loads, res.stdout.splitlines())}


def wait_plane(srv: Server, client_id: str, where: str) -> dict:
    """The client's row once `where` carries it (read from the API: quicker than a
    command a poll)."""
    deadline = time.monotonic() + 10
    url = f"http://{srv.addrs['http']}/api/v1/clients/{client_id}"
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                row = json.loads(r.read())
        except urllib.error.HTTPError:
            row = None
        if row is not None and row["plane"] == where:
            return rows(srv)[client_id]  # as the command says it
        assert time.monotonic() < deadline, (row, srv.logs()[-3000:])
        time.sleep(0.05)


def test_list_and_kick_on_both_planes(srv: Server) -> None:
    where = srv.addrs["plane"]
    five = Device(srv.port, "dev-5", 5, "plant/a", "plant/b")
    four = Device(srv.port, "dev-4", 4)
    try:
        row = wait_plane(srv, "dev-5", where)
        assert (row["protocol_name"], row["subscriptions"]) == ("5.0", 2)
        assert row["peer"].startswith("127.0.0.1:") and row["connected_since"] > 0
        assert wait_plane(srv, "dev-4", where)["protocol_name"] == "3.1.1"
        table = lightgate("clients", "list", "--http", srv.addrs["http"])
        assert table.returncode == 0, table.stderr
        head, *lines = table.stdout.splitlines()
        assert head.split() == ["CLIENT", "ID", "PEER", "PROTOCOL", "PLANE",
                                "CONNECTED", "SINCE", "SUBSCRIPTIONS"]
        line = next(line.split() for line in lines if line.startswith("dev-5 "))
        assert line[2:4] == ["5.0", where] and line[-1] == "2"
        kicked = lightgate("clients", "kick", "dev-5", "--http", srv.addrs["http"])
        assert kicked.returncode == 0 and kicked.stdout == "kicked dev-5\n", kicked.stderr
        assert five.gone.wait(10) and five.reason == 0x98  # Administrative action
        assert lightgate("clients", "kick", "dev-4", "--http", srv.addrs["http"]).returncode == 0
        assert four.gone.wait(10)
        assert "dev-5" not in rows(srv) and "dev-4" not in rows(srv)
    finally:
        five.close()
        four.close()
    unknown = lightgate("clients", "kick", "nobody", "--http", srv.addrs["http"])
    assert unknown.returncode == 1
    assert unknown.stderr == (f"lightgate clients: no client 'nobody' is connected to the "
                              f"gateway at {srv.addrs['http']}\n")


def test_with_auth_the_command_needs_credentials(tmp_path: Path) -> None:
    srv = Server(tmp_path / "data", "--auth", "--init-user", ADMIN).start()
    try:
        res = lightgate("clients", "list", "--http", srv.addrs["http"])
        assert res.returncode == 1
        assert res.stderr.startswith("lightgate clients: the admin API needs credentials"), \
            res.stderr
        assert len(res.stderr.splitlines()) == 1
        wrong = lightgate("clients", "list", "--http", srv.addrs["http"], "--as", "admin:no")
        assert wrong.returncode == 1 and "refused the credentials of 'admin'" in wrong.stderr
        device = Device(srv.port, "dev", 5, auth=("admin", "admin-pw"))
        assert "dev" in rows(srv, "--as", ADMIN)
        device.close()
    finally:
        assert srv.stop() == 0, srv.logs()[-3000:]


def test_nothing_listening_is_one_line() -> None:
    res = lightgate("clients", "list", "--http", "127.0.0.1:1")
    assert res.returncode == 1 and len(res.stderr.splitlines()) == 1
    assert "cannot reach the admin API at http://127.0.0.1:1" in res.stderr
    assert "--http" in res.stderr
