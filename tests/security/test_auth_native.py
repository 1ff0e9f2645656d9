"""The native protocol with auth on: every request checked; gateways join as nodes."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from store import protocol as p
from store.client import AuthFailed
from store.sdk import Consumer, Producer
from tests.conftest import ROOT, Server
from tests.mqtt.paho_client import Client
from tests.security.helpers import ADMIN, add_user, allow, auth_server, native


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = auth_server(tmp_path_factory.mktemp("native-auth"))
    add_user(s, "app", "app-pw")
    allow(s, "app", "Topic:orders", "PUB,SUB")
    allow(s, "app", "Group:billing", "SUB")
    add_user(s, "gw", "gw-pw")
    allow(s, "gw", "Cluster", "UPDATE,GET")
    yield s
    assert s.stop() == 0, s.logs()[-3000:]


def test_no_credentials_are_refused(srv: Server) -> None:
    with pytest.raises(AuthFailed) as err:
        native(srv, "STATS", creds=None)
    assert err.value.status == 401
    with pytest.raises(AuthFailed):
        native(srv, "STATS", creds=("app", "wrong"))
    with pytest.raises(AuthFailed):
        Producer(srv.native).__enter__()


def test_app_may_use_its_topic_and_group_only(srv: Server) -> None:
    with Producer(srv.native, username="app", password="app-pw") as producer:
        producer.send("orders", b"o-1")
        with pytest.raises(p.RemoteError) as err:
            producer.send("payroll", b"p-1")
        assert err.value.status == 403
        with pytest.raises(p.RemoteError):  # addressing an MQTT topic needs PUB on it too
            producer.send("orders", b"cmd", mqtt_topic="devices/1/cmd")
    with Consumer(srv.native, "billing", "orders", username="app", password="app-pw") as c:
        got = []
        for _ in range(50):
            got += c.poll(timeout=0.2)
            if got:
                break
        assert [m.body for m in got] == [b"o-1"]
    with pytest.raises(p.RemoteError) as err, \
            Consumer(srv.native, "other-group", "orders", username="app", password="app-pw") as c:
        c.poll(timeout=0.5)
    assert err.value.status == 403


def test_node_and_super_requests(srv: Server) -> None:
    for code, header in (("STATS", {}), ("USER_LIST", {}),
                         ("META_ITEMS", {"cf": "users"}),
                         ("PUBLISH", {"messages": []})):
        with pytest.raises(p.RemoteError) as err:
            native(srv, code, header, creds=("app", "app-pw"))
        assert err.value.status == 403, code
    assert native(srv, "STATS", creds=("gw", "gw-pw"))  # Cluster GET
    with pytest.raises(p.RemoteError) as err:  # a node still may not change users
        native(srv, "META_PUT", {"cf": "users", "key": "x", "value": {}}, creds=("gw", "gw-pw"))
    assert err.value.status == 403
    topics = native(srv, "TOPIC_LIST", creds=("app", "app-pw"))["topics"]
    assert set(topics) <= {"orders"}


def _gateway(srv: Server, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "lightgate", "gateway", "--store", srv.native, "--mqtt",
         "127.0.0.1:0", "--ws", "off", "--http", "127.0.0.1:0", *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_gateway_without_credentials_cannot_join(srv: Server) -> None:
    for extra in ((), ("--store-auth", "app:app-pw"), ("--store-auth", "gw:bad")):
        proc = _gateway(srv, *extra)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode != 0, out
        assert "ready" not in out
        assert "--store-auth" in err, err[-2000:]


def test_gateway_with_node_credentials_serves_devices(srv: Server) -> None:
    proc = _gateway(srv, "--store-auth", "gw:gw-pw")
    try:
        line = proc.stdout.readline()
        assert line.startswith("ready "), proc.stderr.read()
        port = int(dict(x.split("=", 1) for x in line.split()[1:])["mqtt"].rsplit(":", 1)[1])
        sub = Client(port, "dev-sub", username=ADMIN[0], password=ADMIN[1])
        sub.subscribe("devices/#", 1)
        assert Client(port, "x", version=5, username="app", password="bad").connack[1] == 0x86
        add_user(srv, "dev1", "dev1-pw")
        allow(srv, "dev1", "Topic:devices/1/#", "PUB")
        deadline = time.monotonic() + 10  # no notify bus here: the gateway's 5 s refresh
        while True:
            dev = Client(port, "dev1", version=5, username="dev1", password="dev1-pw")
            if dev.connack[1] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert dev.connack[1] == 0
        dev.publish("devices/1/temp", b"20", qos=1)
        mid = dev.publish("devices/2/temp", b"spoof", qos=1)
        assert dev.pub_codes[mid] == 0x87
        [got] = sub.expect(1)
        assert got.topic == "devices/1/temp"
        native(srv, "USER_UPDATE", {"name": "dev1", "enabled": False})
        assert dev.disconnected.wait(10), "the change must reach the gateway process"
        sub.disconnect()
    finally:
        proc.terminate()
        proc.wait(15)
