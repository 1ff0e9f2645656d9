"""The native protocol with auth on: every request checked; gateways join as nodes."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import trio

from store import protocol as p
from store.client import AuthFailed, NativeClient
from store.record import Message
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
    add_user(s, "gw", "gw-pw", node=True)
    allow(s, "gw", "Cluster", "GET")
    add_user(s, "ops", "ops-pw")  # an operator who may kick clients: no node
    allow(s, "ops", "Cluster", "UPDATE,GET")
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


def test_nodes_have_an_identity_of_their_own(srv: Server) -> None:
    """Cluster UPDATE (an operator's right to kick clients) once made a user a node: it
    read every password hash and SCRAM verifier and could fetch the whole log. A node is
    now a role no policy grants, and the log goes to store nodes of the group alone."""
    ops = ("ops", "ops-pw")
    for code, header in (("META_ITEMS", {"cf": "users"}), ("META_GET", {"cf": "users",
                                                                       "key": "app"}),
                         ("REPL_FETCH", {"node": "x", "offset": 0})):
        with pytest.raises(p.RemoteError) as err:
            native(srv, code, header, creds=ops)
        assert err.value.status == 403, code
    users = native(srv, "META_ITEMS", {"cf": "users"}, creds=("gw", "gw-pw"))["items"]
    assert any(name == "app" for name, _ in users)  # a node checks MQTT passwords itself
    with pytest.raises(p.RemoteError) as err:  # a node user is not a store node
        native(srv, "REPL_FETCH", {"node": "x", "offset": 0}, creds=("gw", "gw-pw"))
    assert err.value.status == 403
    assert "node" in native(srv, "USER_LIST", {})["users"][0]


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


def _pull_bodies(srv: Server, queue: str, creds: tuple[str, str]) -> list[tuple[str, bytes]]:
    """(topic, body) of every message of `queue` a PULL as `creds` hands out."""

    async def pull_all() -> list[tuple[str, bytes]]:
        out: list[tuple[str, bytes]] = []
        async with NativeClient.open(srv.native, credentials=creds) as client:
            offset = 0
            while True:
                header, body = await client.request(p.PULL, {"queue": queue,
                                                             "offset": offset, "max": 64})
                out += [(m.topic, m.body) for m in p.unpack_messages(header["messages"], body)]
                if header["next_offset"] == offset:
                    return out
                offset = header["next_offset"]

    return trio.run(pull_all)


def test_a_pull_hands_out_only_messages_the_reader_may_read(srv: Server) -> None:
    """Allow home/# and Deny home/secret: over MQTT home/secret is filtered out; a PULL
    of the wildcard queue home/# (or of home's partitions) must filter it too."""
    add_user(srv, "reader", "reader-pw")
    allow(srv, "reader", "Topic:home/#", "SUB")
    allow(srv, "reader", "Topic:home/secret", "SUB", deny=True)
    watcher = Client(srv.port, "home-watch", username=ADMIN[0], password=ADMIN[1])
    watcher.subscribe("home/#", 1)  # registers the wildcard queue home/#
    mqtt_reader = Client(srv.port, "home-reader", version=5, username="reader",
                         password="reader-pw")
    mqtt_reader.subscribe("home/#", 1)
    watcher.publish("home/open", b"for everyone", qos=1)
    watcher.publish("home/secret", b"for admins", qos=1)
    watcher.expect(2)
    assert [m.topic for m in mqtt_reader.expect(1)] == ["home/open"]
    mqtt_reader.expect_none(0.5)
    watcher.disconnect()
    mqtt_reader.disconnect()

    reader = ("reader", "reader-pw")
    assert _pull_bodies(srv, "home/#", ADMIN) == [("home/open", b"for everyone"),
                                                 ("home/secret", b"for admins")]
    assert _pull_bodies(srv, "home/#", reader) == [("home/open", b"for everyone")]
    partitions = [m for q in range(4) for m in _pull_bodies(srv, f"home#{q}", reader)]
    assert partitions == [("home/open", b"for everyone")]
    with pytest.raises(p.RemoteError) as err:  # the topic itself was refused already
        native(srv, "PULL", {"queue": "home/secret"}, creds=reader)
    assert err.value.status == 403
    assert srv.wait_log("[AUTHORIZATION] user=reader ip=127.0.0.1 action=SUB "
                        "resource=Topic:home/secret result=deny")


def test_nack_takes_only_a_message_the_reader_received(srv: Server) -> None:
    """NACK needs SUB on the group; it must name a message the reader could pull (queue
    and offset) and copy that, never store a body the client makes up."""
    app = ("app", "app-pw")
    forged = Message("payroll", b"forged", 1, False, "", {"lg_attempt": 0})
    forged.phys_offset = -1
    metas, body = p.pack_messages([forged])
    with pytest.raises(p.RemoteError) as err:
        native(srv, "NACK", {"group": "billing", "message": metas[0]}, app, body)
    assert err.value.status in (400, 403)  # no queue and offset: nothing it may pull
    assert b"forged" not in b"".join(b for _, b in _pull_bodies(srv, "billing#retry", ADMIN))

    with Producer(srv.native, username="app", password="app-pw") as producer:
        producer.send("orders", b"to-retry", key="r")
    queue, offset = next((f"orders#{q}", i) for q in range(4)
                         for i, (_, b) in enumerate(_pull_bodies(srv, f"orders#{q}", app))
                         if b == b"to-retry")
    reply = native(srv, "NACK", {"group": "billing", "queue": queue, "offset": offset},
                   creds=app)
    assert reply["queue"] == "billing#retry" and reply["attempt"] == 1
    assert (("orders", b"to-retry") in _pull_bodies(srv, "billing#retry", ADMIN))
    for bad in ({"queue": "payroll#0", "offset": 0},  # a queue it may not read
                {"queue": queue, "offset": 10_000}):  # nothing there
        with pytest.raises(p.RemoteError) as err:
            native(srv, "NACK", {"group": "billing", **bad}, creds=app)
        assert err.value.status in (403, 404), bad
