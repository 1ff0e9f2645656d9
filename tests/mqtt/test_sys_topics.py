"""`$SYS/broker/...` against a real `lightgate serve`, on both planes: a subscriber gets the
current values at subscribe (retained) and each round's after them (live), while none of
it goes into the store, as Mosquitto keeps `$SYS` out of its persistence: the CommitLog
does not grow, and neither `/api/v1/topics` nor the history knows a `$SYS` topic."""

from __future__ import annotations

import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Server
from tests.mqtt.paho_client import Client, Received

ROUNDS = 3  # of --sys-interval 1 the test waits for
STATISTICS = {"uptime", "clients/connected", "clients/total", "messages/received",
              "messages/sent", "bytes/received", "bytes/sent", "store/bytes",
              "store/segments", "version"}


def get(srv: Server, path: str, **params: Any) -> Any:
    r = httpx.get(f"http://{srv.addrs['http']}{path}", params=params, timeout=10)
    r.raise_for_status()
    return r.json()


def log_end(srv: Server) -> int:
    return int(get(srv, "/api/v1/store/stats")["commitlog"]["max_offset"])


@pytest.fixture(params=["native", "python"])
def srv(request: pytest.FixtureRequest, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("LIGHTGATE_NATIVE", "1" if request.param == "native" else "0")
    s = Server(tmp_path / "data").start()  # --sys-interval 1
    yield s
    assert s.stop() == 0, s.logs()[-3000:]


def test_sys_reaches_subscribers_and_stays_out_of_the_store(srv: Server) -> None:
    device = Client(srv.port, "device")
    device.publish("home/kitchen/temp", b"21", qos=1)
    time.sleep(1.5)  # a round of $SYS first: the values a subscriber finds retained
    end = log_end(srv)
    sub = Client(srv.port, "monitor")
    sub.subscribe("$SYS/#", 0)
    got: list[Received] = []
    deadline = time.monotonic() + ROUNDS + 5
    while time.monotonic() < deadline and \
            sum(1 for m in got if not m.retain) < ROUNDS * len(STATISTICS) - len(STATISTICS):
        got += sub.expect(1, timeout=deadline - time.monotonic())
    retained = {m.topic: m.payload for m in got if m.retain}
    live = [m for m in got if not m.retain]
    assert set(retained) == {f"$SYS/broker/{name}" for name in STATISTICS}, retained
    assert retained["$SYS/broker/version"] == f"lightgate version {version('lightgate')}" \
        .encode()
    assert {m.topic for m in live} == set(retained)  # each value, again each round
    assert int(retained["$SYS/broker/clients/connected"]) >= 1
    # Nothing of it in the store: the log has not grown by a byte in those rounds ...
    assert log_end(srv) == end
    # ... and no page lists a $SYS topic beside the device's.
    topics = [row["topic"] for row in get(srv, "/api/v1/topics")["items"]]
    assert "home" in topics and not any(t.startswith("$") for t in topics), topics
    assert get(srv, "/api/v1/messages", filter="$SYS/#", since="earliest")["messages"] == []
    sub.disconnect()
    device.disconnect()


def test_a_bridges_state_is_still_stored_and_retained(srv: Server) -> None:
    """Clients' own `$SYS` topics (a bridge's state) are messages like any other."""
    bridge = Client(srv.port, "edge-1")
    bridge.publish("$SYS/broker/connection/edge-1/state", b"1", qos=1, retain=True)
    bridge.disconnect()
    sub = Client(srv.port, "monitor")
    sub.subscribe("$SYS/broker/connection/#", 0)
    [state] = sub.expect(1)
    assert (state.topic, state.payload, state.retain) == \
        ("$SYS/broker/connection/edge-1/state", b"1", True)
    sub.disconnect()
    stored = get(srv, "/api/v1/messages", filter="$SYS/#", since="earliest")["messages"]
    assert [m["topic"] for m in stored] == ["$SYS/broker/connection/edge-1/state"]
