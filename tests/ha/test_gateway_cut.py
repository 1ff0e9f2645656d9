"""A gateway cut off from its store group's master while the group is healthy (the link
between that gateway and the master's node down: a TCP proxy the test cuts; the other
nodes and the other gateway reach the master). It says so once in its log and on
/readyz, sends MQTT 5 clients to its peer (DISCONNECT 0x9C with Server Reference),
closes 3.1.1 clients so they connect again elsewhere, answers new CONNECTs the same way,
and takes clients again once the link heals."""

from __future__ import annotations

import json
import os
import re
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gateway import mqtt
from gateway.mqtt import reason as rc
from tests.conftest import RedisServer, Server
from tests.ha.cluster import Group, wait_for
from tests.ha.proxy import Proxy
from tests.mqtt.raw import RawClient

AFTER_S = 3.0  # --master-unreachable-s


@pytest.fixture
def redis(redis_server: RedisServer) -> RedisServer:
    return redis_server


def _get(srv: Server, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://{srv.addrs['http']}{path}", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _publisher(port: int, stop: threading.Event, outcome: dict) -> None:
    """QoS 1 publishes one at a time until the gateway sends this client away."""
    c = RawClient(port, version=5, timeout=10)
    c.connect("pub-a")
    i = 0
    try:
        while not stop.is_set():
            i += 1
            c.send(mqtt.Publish("cut/x", b"%d" % i, qos=1, packet_id=i % 60000 + 1))
            got = c.recv()
            if isinstance(got, mqtt.Disconnect):
                outcome["disconnect"] = got
                return
            outcome.setdefault("codes", []).append(got.reason_code)
    except (ConnectionError, OSError) as exc:
        outcome["error"] = repr(exc)


def test_a_gateway_cut_from_the_master_sends_its_clients_to_another(
        tmp_path: Path, redis: RedisServer) -> None:
    g = Group(tmp_path, 3, "--replication", "sync", "--min-insync", "2",
              "--notify", redis.url).start()
    proxies = [Proxy(("127.0.0.1", n.native_port)) for n in g.nodes]
    other = Server(None, "--store", g.addrs, "--notify", redis.url, command="gateway")
    gw = Server(None, "--store", ",".join(p.addr for p in proxies), "--notify", redis.url,
                "--peers", f"127.0.0.1:{other.mqtt_port}",
                "--master-unreachable-s", str(AFTER_S), command="gateway")
    stop = threading.Event()
    try:
        m = g.master(20)
        wait_for(lambda: len(g.insync(m)) == 3, 15, "all three in sync")
        other.start()
        gw.start()
        assert _get(gw, "/readyz") == (200, {"status": "ready", "store": "serving"})
        v5 = RawClient(gw.port, version=5, timeout=30)
        v5.connect("dev5")
        v3 = RawClient(gw.port, version=4, timeout=30)
        v3.connect("dev3")
        outcome: dict = {}
        pub = threading.Thread(target=_publisher, args=(gw.port, stop, outcome), daemon=True)
        pub.start()
        wait_for(lambda: len(outcome.get("codes", [])) > 20, 10, "publishing under way")

        proxies[m].cut()
        cut_at = time.monotonic()
        bye = v5.recv()  # the gateway sends it away
        sent_away = time.monotonic() - cut_at
        assert isinstance(bye, mqtt.Disconnect), bye
        assert bye.reason_code == rc.USE_ANOTHER_SERVER
        assert bye.properties["server_reference"] == f"127.0.0.1:{other.mqtt_port}"
        assert v3.closed_by_server()
        pub.join(10)
        assert outcome["disconnect"].reason_code == rc.USE_ANOTHER_SERVER, outcome
        status, body = _get(gw, "/readyz")
        assert status == 503 and body["store"] == "cut off", body
        assert body["peers"] == [f"127.0.0.1:{other.mqtt_port}"]
        assert _get(gw, "/healthz") == (200, {"status": "ok"})  # alive, just not ready
        late = RawClient(gw.port, version=5)  # a CONNECT meanwhile: to the peer
        ack = late.connect("late")
        assert ack.reason_code == rc.USE_ANOTHER_SERVER
        assert ack.properties["server_reference"] == f"127.0.0.1:{other.mqtt_port}"
        late3 = RawClient(gw.port, version=4)
        assert late3.connect("late3").reason_code == rc.CONNACK_SERVER_UNAVAILABLE
        # They connect again elsewhere: the other gateway serves them.
        again = RawClient(other.port, version=5)
        again.connect("dev5")
        again.send(mqtt.Publish("cut/x", b"moved", qos=1, packet_id=1))
        assert again.recv().reason_code == 0
        again.close()
        time.sleep(2.0)
        cut_log = gw.logs()
        print(f"clients sent away {sent_away:.1f} s after the cut")

        proxies[m].heal()
        healed = time.monotonic()
        wait_for(lambda: _get(gw, "/readyz")[0] == 200, 30, "ready again")
        print(f"ready again {time.monotonic() - healed:.1f} s after the heal")
        back = RawClient(gw.port, version=5)
        assert back.connect("back").reason_code == 0
        back.send(mqtt.Publish("cut/x", b"back", qos=1, packet_id=1))
        assert back.recv().reason_code == 0
        back.close()
        # The state said once each way, not a warning per refused publish or CONNECT.
        lines = cut_log.splitlines()
        assert len([ln for ln in lines if "cut off from the store's master" in ln]) == 1
        refused = [ln for ln in lines if re.search(r" WARNING .*not stored", ln)]
        assert not refused, refused[:5]
        assert gw.wait_log("no longer cut off from the store's master")
    finally:
        stop.set()
        dump = os.environ.get("LIGHTGATE_HA_DUMP")  # a directory for the processes' logs
        if dump:
            Path(dump, "gateway-cut.log").write_text(gw.logs())
            Path(dump, "gateway-other.log").write_text(other.logs())
        for srv in (gw, other):
            if srv.proc is not None:
                srv.kill()
        for p in proxies:
            p.close()
        g.stop()
