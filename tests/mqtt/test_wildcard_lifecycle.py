"""Wildcard queues follow live filters, end to end on `lightgate serve`: a
filter a connected client reads stays registered however long it is quiet (the gateway
touches it), one an offline persistent session holds stays too, and one nobody holds
any more is unregistered, so messages stop being indexed into it."""

from __future__ import annotations

import time

import pytest

from gateway import mqtt
from tests.conftest import Server
from tests.mqtt.raw import RawClient

IDLE_S = 1.0


@pytest.fixture
def gc_server(tmp_path):
    srv = Server(tmp_path / "data", "--wildcard-idle-s", str(IDLE_S), "--wildcard-touch-s",
                 "0.2").start()
    yield srv
    if srv.proc is not None:
        srv.stop()


def publish(port: int, topic: str, body: bytes) -> None:
    pub = RawClient(port)
    pub.connect(f"pub-{time.monotonic_ns()}")
    pub.send(mqtt.Publish(topic, body, qos=1, packet_id=1))
    assert isinstance(pub.recv(), mqtt.Puback)
    pub.close()


def next_publish(client: RawClient) -> mqtt.Publish:
    while True:
        p = client.recv()
        if isinstance(p, mqtt.Publish):
            if p.qos == 1:
                client.send(mqtt.Puback(p.packet_id))
            return p


def test_wildcards_stay_while_used_and_go_when_nobody_holds_them(gc_server: Server) -> None:
    port = gc_server.port
    live = RawClient(port)
    live.connect("live")
    live.subscribe("live/+/t", 1)
    keeper = RawClient(port)
    keeper.connect("keeper", clean=False)
    keeper.subscribe("kept/+/t", 1)
    keeper.close()  # offline, persistent: its stored position names kept/+/t
    gone = RawClient(port)
    gone.connect("gone")
    gone.subscribe("gone/+/t", 1)
    gone.close()  # clean session: nothing holds gone/+/t any more

    assert gc_server.wait_log("unregistered 1 wildcard queues", timeout=10), \
        gc_server.logs()[-3000:]
    time.sleep(3 * IDLE_S)  # several more rounds
    log = gc_server.logs()
    assert "gone/+/t" in log
    assert "live/+/t" not in log.split("unregistered", 1)[1]
    assert "kept/+/t" not in log.split("unregistered", 1)[1]

    # The quiet live subscriber still gets what is published, and so does the offline
    # persistent session when it comes back.
    publish(port, "live/a/t", b"to-live")
    assert next_publish(live).payload == b"to-live"
    publish(port, "kept/a/t", b"to-keeper")
    back = RawClient(port)
    ack = back.connect("keeper", clean=False)
    assert ack.session_present
    assert next_publish(back).payload == b"to-keeper"
    back.close()
    live.close()

    # A new subscriber of the dropped filter registers it again and is served.
    again = RawClient(port)
    again.connect("again")
    again.subscribe("gone/+/t", 1)
    publish(port, "gone/b/t", b"again")
    assert next_publish(again).payload == b"again"
    again.close()
