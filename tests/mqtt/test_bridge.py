"""Bridges to Lightgate. First what a bridge relies on, over a raw socket: the bridge bit
of a try_private CONNECT, which `$` topics a client may write (a bridge's state), no echo
and retain as published on a bridge's subscriptions, a log line for every refused
CONNECT. Then the real thing: Debian's mosquitto in a subprocess with a config of its
own, bridging to a real `lightgate serve`, paho clients on each side counting every
message."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway import mqtt
from gateway.mqtt import reason as rc
from tests.conftest import Server, reserved_port
from tests.mqtt.paho_client import Client, Received
from tests.mqtt.raw import RawClient
from tests.security.helpers import ADMIN, add_user, allow, auth_server

# -- try_private: a CONNECT with the bridge bit ---------------------------------------------


def test_bridge_bit_round_trips_through_the_codec() -> None:
    for level in (3, 4):
        data = mqtt.encode(mqtt.Connect("edge", level, bridge=True), level)
        assert data[2 + 2 + len(mqtt.PROTOCOL_NAMES[level])] == mqtt.BRIDGE_BIT | level
        [p] = mqtt.Decoder().feed(data)
        assert isinstance(p, mqtt.Connect) and p.bridge and p.protocol_level == level
        [plain] = mqtt.Decoder().feed(mqtt.encode(mqtt.Connect("edge", level), level))
        assert not plain.bridge
    with pytest.raises(ValueError):
        mqtt.encode(mqtt.Connect("edge", 5, bridge=True), 5)
    v5 = bytearray(mqtt.encode(mqtt.Connect("edge", 5), 5))
    v5[8] |= mqtt.BRIDGE_BIT  # 0x85: no such thing; 5.0 has subscription options for it
    with pytest.raises(mqtt.UnsupportedProtocolError):
        mqtt.Decoder().feed(bytes(v5))


# -- which `$` topics a client may write ----------------------------------------------------


def _pub_code(c: RawClient, topic: str, pid: int, retain: bool = True) -> int:
    c.send(mqtt.Publish(topic, b"1", 1, retain, False, pid))
    ack = c.recv()
    assert isinstance(ack, mqtt.Puback), ack
    return ack.reason_code


def test_without_auth_only_bridge_state_topics_are_open(server: Server) -> None:
    c = RawClient(server.port, version=5)
    c.connect("writer")
    assert _pub_code(c, "$SYS/broker/connection/edge-1/state", 1) == rc.SUCCESS
    for pid, topic in enumerate(["$SYS/broker/uptime", "$SYS/broker/connection/edge-1",
                                 "$SYS/broker/connection/a/b/state", "$SYS/other",
                                 "$app/x", "$share/g/t"], start=2):
        assert _pub_code(c, topic, pid) == rc.NOT_AUTHORIZED, topic
    c.close()
    reader = RawClient(server.port, version=4, timeout=2.0)
    reader.connect("reader")
    reader.subscribe("$SYS/broker/connection/#", 0)
    p = reader.recv()
    assert isinstance(p, mqtt.Publish) and p.retain
    assert (p.topic, p.payload) == ("$SYS/broker/connection/edge-1/state", b"1")
    reader.close()
    # A will: the same rule (CONNACK 0x87 for the broker's own statistics).
    for version in (4, 5):
        ok = RawClient(server.port, version=version)
        will = mqtt.Will("$SYS/broker/connection/edge-2/state", b"0", 1, True)
        assert ok.connect(f"will-ok-{version}", will=will).reason_code == 0
        ok.close()
        bad = RawClient(server.port, version=version)
        will = mqtt.Will("$SYS/broker/clients/connected", b"0", 1, True)
        assert bad.connect(f"will-bad-{version}", will=will).reason_code == \
            (rc.NOT_AUTHORIZED if version == 5 else 5)
        bad.close()


def test_with_auth_the_policies_decide_on_dollar_topics(tmp_path: Path) -> None:
    lg = auth_server(tmp_path)
    try:
        add_user(lg, "plain", "pw")
        allow(lg, "plain", "Topic:#", "PUB")
        add_user(lg, "bridge", "pw")
        allow(lg, "bridge", "Topic:$SYS/broker/connection/#", "PUB")
        allow(lg, "bridge", "Topic:$SYS/broker/uptime", "PUB")
        plain = RawClient(lg.port, version=5)
        plain.connect("plain-1", username="plain", password=b"pw")
        assert _pub_code(plain, "$SYS/broker/connection/p/state", 1) == rc.NOT_AUTHORIZED
        assert _pub_code(plain, "a/b", 2) == rc.SUCCESS
        plain.close()
        bridge = RawClient(lg.port, version=5)
        will = mqtt.Will("$SYS/broker/connection/b/state", b"0", 1, True)
        assert bridge.connect("bridge-1", username="bridge", password=b"pw",
                              will=will).reason_code == 0
        assert _pub_code(bridge, "$SYS/broker/connection/b/state", 1) == rc.SUCCESS
        # The grant overrides the default that keeps $SYS/broker/... the broker's own.
        assert _pub_code(bridge, "$SYS/broker/uptime", 2, retain=False) == rc.SUCCESS
        assert _pub_code(bridge, "$SYS/broker/clients/connected", 3) == rc.NOT_AUTHORIZED
        assert _pub_code(bridge, "$share/g/t", 4) == rc.NOT_AUTHORIZED
        bridge.close()
        refused = RawClient(lg.port, version=5)
        will = mqtt.Will("$SYS/broker/connection/p/state", b"0", 1, True)
        assert refused.connect("plain-2", username="plain", password=b"pw",
                               will=will).reason_code == rc.NOT_AUTHORIZED
        refused.close()
        assert lg.wait_log("connect of 'plain-2' from 127.0.0.1:")
    finally:
        assert lg.stop() == 0, lg.logs()[-3000:]


def test_retained_state_messages_count_in_the_clients_budget(tmp_path: Path) -> None:
    srv = Server(tmp_path / "data", "--max-retained-per-client", "2").start()
    try:
        c = RawClient(srv.port, version=5)
        c.connect("many-bridges")
        codes = [_pub_code(c, f"$SYS/broker/connection/b{i}/state", i + 1) for i in range(3)]
        assert codes == [rc.SUCCESS, rc.SUCCESS, rc.QUOTA_EXCEEDED]
        c.close()
    finally:
        assert srv.stop() == 0, srv.logs()[-3000:]


# -- a bridge's subscriptions --------------------------------------------------------------


@pytest.mark.parametrize("version", [3, 4])
def test_a_bridge_gets_no_echo_and_retain_as_published(server: Server, version: int) -> None:
    bridge = RawClient(server.port, version=version, timeout=1.0)
    assert bridge.connect("edge-bridge", clean=False, bridge=True).reason_code == 0
    bridge.subscribe("t/#", 1)
    plain = RawClient(server.port, version=version, timeout=1.0)
    assert plain.connect("plain-client").reason_code == 0
    plain.subscribe("t/#", 1)
    bridge.send(mqtt.Publish("t/from-bridge", b"b", 1, True, False, 1))
    plain.send(mqtt.Publish("t/from-plain", b"p", 1, True, False, 1))
    at_bridge, at_plain = _drain(bridge), _drain(plain)
    # The bridge's own message does not come back to it; the other keeps its retain flag.
    assert [(p.topic, p.retain) for p in at_bridge] == [("t/from-plain", True)]
    # An ordinary client: its own message too, and live messages with the flag off (3.1.1).
    assert sorted((p.topic, p.retain) for p in at_plain) == \
        [("t/from-bridge", False), ("t/from-plain", False)]
    bridge.close()
    plain.close()


def _drain(c: RawClient) -> list[mqtt.Publish]:
    got = []
    while True:
        try:
            p = c.recv()
        except TimeoutError:
            return got
        if isinstance(p, mqtt.Publish):
            got.append(p)
            if p.qos == 1:
                c.send(mqtt.Puback(p.packet_id))


# -- every refused CONNECT is logged ----------------------------------------------------------


def test_every_refused_connect_is_logged_with_its_reason(server: Server) -> None:
    bad = RawClient(server.port, version=4)
    bad.send_raw(b"\x10\x0d\x00\x04MQTT\x06\x02\x00\x3c\x00\x01x")  # level 6
    assert bad.closed_by_server()
    bad.close()
    will = RawClient(server.port, version=4)
    assert will.connect("will-on-stats", will=mqtt.Will("$SYS/broker/uptime", b"x")
                        ).reason_code == 5
    will.close()
    anon = RawClient(server.port, version=4)
    assert anon.connect("", clean=False).reason_code == 2
    anon.close()
    for text in ("connect of ? from 127.0.0.1:", "refused: unsupported protocol 'MQTT' "
                 "level 6", "connect of 'will-on-stats' from 127.0.0.1:",
                 "refused: will topic '$SYS/broker/uptime' reserved for the server",
                 "connect of '' from 127.0.0.1:", "refused: empty client id with a "
                 "persistent session"):
        assert server.wait_log(text), (text, server.logs()[-3000:])
    refusals = [x for x in server.logs().splitlines() if "refused:" in x]
    assert len(refusals) == 3 and all(" INFO " in x for x in refusals), refusals


# -- a Mosquitto edge broker bridging to Lightgate -----------------------------------------

MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
needs_mosquitto = pytest.mark.skipif(
    not os.access(MOSQUITTO, os.X_OK), reason="Debian's mosquitto is not installed")

# Mosquitto's default remote client id for `connection lightgate`: <hostname>.<name>.
BRIDGE_ID = f"{socket.gethostname()}.lightgate"
STATE_TOPIC = f"$SYS/broker/connection/{BRIDGE_ID}/state"
N = 200  # messages each way

BOTH = "topic # both 1"
SPLIT = "topic up/# out 1\ntopic down/# in 1"


class Mosquitto:
    """Debian's mosquitto on a reserved loopback port, bridging to Lightgate with its
    default bridge settings but for the lines given (and a 1 s restart delay instead of
    5-30 s, so that a test does not wait for the reconnects)."""

    def __init__(self, tmp: Path, remote_port: int, bridge_lines: str) -> None:
        self.port = reserved_port()
        self.conf = tmp / "mosquitto.conf"
        self.log_file = tmp / "mosquitto.log"
        user = "user root\n" if os.geteuid() == 0 else ""  # else it drops to `mosquitto`
        self.conf.write_text(
            f"{user}listener {self.port} 127.0.0.1\nallow_anonymous true\n"
            f"persistence false\nlog_dest file {self.log_file}\nlog_type all\n\n"
            f"connection lightgate\naddress 127.0.0.1:{remote_port}\nrestart_timeout 1\n"
            f"{bridge_lines}\n")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Mosquitto:
        self.proc = subprocess.Popen([MOSQUITTO, "-c", str(self.conf)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"mosquitto did not start: {self.logs()}")

    def logs(self) -> str:
        return self.log_file.read_text() if self.log_file.exists() else ""

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


@pytest.fixture
def lightgate(tmp_path: Path) -> Iterator[Server]:
    srv = Server(tmp_path / "data").start()
    yield srv
    if srv.proc is not None:
        assert srv.stop() == 0, srv.logs()[-3000:]


def edge(tmp_path: Path, lg: Server, lines: str) -> Mosquitto:
    return Mosquitto(tmp_path, lg.port, lines).start()


def wait_state(lg: Server, mq: Mosquitto, want: bytes, creds: tuple[str, str] | None = None,
               timeout: float = 20.0) -> None:
    """Until Lightgate holds the bridge's notification `want` on its state topic."""
    kw = {"username": creds[0], "password": creds[1]} if creds else {}
    watch = Client(lg.port, "state-watch", **kw)
    watch.subscribe(STATE_TOPIC, 1)
    deadline = time.monotonic() + timeout
    got: list[bytes] = []
    try:
        while time.monotonic() < deadline:
            try:
                got += [m.payload for m in watch.expect(1, timeout=0.5)]
            except TimeoutError:
                continue
            if got[-1] == want:
                return
        raise AssertionError(f"bridge state {got}, not {want!r}; lightgate: "
                             f"{lg.logs()[-3000:]}\nmosquitto: {mq.logs()[-3000:]}")
    finally:
        watch.disconnect()


def wait_flowing(lg: Server, mq: Mosquitto, up: bool = True, down: bool = True,
                 creds: tuple[str, str] | None = None) -> None:
    """Until a probe published on one side reaches the other, each way: the bridge's
    SUBSCRIBEs (after its CONNACK) have been handled. `creds`: for Lightgate's side."""
    kw = {"username": creds[0], "password": creds[1]} if creds else {}
    for topic in ("up/probe",) * up + ("down/probe",) * down:
        edge_side, cloud_side = Client(mq.port, "probe-edge"), Client(lg.port, "probe-cloud", **kw)
        sub, pub = (cloud_side, edge_side) if topic == "up/probe" else (edge_side, cloud_side)
        sub.subscribe(topic, 1)
        deadline = time.monotonic() + 15
        while True:
            pub.publish(topic, b"?", 1)
            try:
                sub.expect(1, timeout=0.3)
                break
            except TimeoutError:
                assert time.monotonic() < deadline, f"{topic} not bridged: {mq.logs()[-2000:]}"
        sub.disconnect()
        pub.disconnect()


def collect(c: Client, n: int, settle: float = 1.0) -> Counter[tuple[str, bytes]]:
    """The first `n` messages, and whatever follows within `settle` s (duplicates)."""
    got = c.expect(n, timeout=30)
    time.sleep(settle)
    while not c.messages.empty():
        got.append(c.messages.get_nowait())
    return Counter((m.topic, m.payload) for m in got)


def publish_all(c: Client, prefix: str, n: int = N) -> set[tuple[str, bytes]]:
    sent = set()
    for i in range(n):
        topic, body = f"{prefix}/{i}", f"{prefix}-{i}".encode()
        c.publish(topic, body, 1)
        sent.add((topic, body))
    return sent


def retained(port: int, topic: str) -> Received | None:
    """What a new subscriber to `topic` gets at once: the retained message, if any."""
    c = Client(port, "retained-check")
    c.subscribe(topic, 1)
    try:
        return c.expect(1, timeout=1.5)[0]
    except TimeoutError:
        return None
    finally:
        c.disconnect()


@needs_mosquitto
@pytest.mark.parametrize(("lines", "echo"), [
    # Mosquitto's defaults: try_private true, bridge_attempt_unsubscribe true (an UNSUBSCRIBE
    # of each `out` topic after the CONNACK), notifications true, cleansession false.
    pytest.param(BOTH, False, id="both-defaults"),
    pytest.param(SPLIT, False, id="in-out-defaults"),
    pytest.param(SPLIT + "\nbridge_attempt_unsubscribe false", False, id="in-out-no_unsubscribe"),
    pytest.param(SPLIT + "\ntry_private false", False, id="in-out-plain"),
    # try_private off: Lightgate sees an ordinary client, which gets its own messages
    # back through `#` (Mosquitto, as the remote, does the same).
    pytest.param(BOTH + "\ntry_private false\nbridge_attempt_unsubscribe false", True,
                 id="both-plain-no_unsubscribe"),
])
def test_mosquitto_bridges_both_ways(tmp_path: Path, lightgate: Server, lines: str,
                                     echo: bool) -> None:
    mq = edge(tmp_path, lightgate, lines)
    try:
        wait_state(lightgate, mq, b"1")  # the will "0" and the "1" were accepted
        wait_flowing(lightgate, mq)
        cloud_sub = Client(lightgate.port, "cloud-sub")
        cloud_sub.subscribe([("up/data/#", 1), ("down/data/#", 1)])
        edge_sub = Client(mq.port, "edge-sub")
        edge_sub.subscribe([("up/data/#", 1), ("down/data/#", 1)])
        ups = publish_all(Client(mq.port, "edge-pub"), "up/data")
        downs = publish_all(Client(lightgate.port, "cloud-pub"), "down/data")

        at_cloud = collect(cloud_sub, 2 * N)
        assert at_cloud == Counter(ups | downs), "each message once at Lightgate"
        at_edge = collect(edge_sub, (3 if echo else 2) * N)
        assert at_edge == Counter(downs) + Counter({m: 2 if echo else 1 for m in ups})

        private = "try_private false" not in lines
        assert ("(v4 bridge," in _connect_line(lightgate)) == private

        # Retained messages keep their flag across the bridge: upwards always (Mosquitto
        # sends them as published); downwards only to a bridge that said so (try_private:
        # retain as published), else Lightgate forwards them as to any client, flag off.
        Client(mq.port, "edge-keep").publish("up/keep", b"edge-kept", 1, retain=True)
        Client(lightgate.port, "cloud-keep").publish("down/keep", b"cloud-kept", 1,
                                                     retain=True)
        time.sleep(1.0)
        up_kept = retained(lightgate.port, "up/keep")
        assert up_kept is not None and (up_kept.payload, up_kept.retain) == (b"edge-kept", True)
        down_kept = retained(mq.port, "down/keep")
        if private:
            assert down_kept is not None and down_kept.payload == b"cloud-kept"
            assert down_kept.retain
        else:
            assert down_kept is None
    finally:
        mq.stop()


def _connect_line(lg: Server) -> str:
    return next(line for line in lg.logs().splitlines()
                if f"client {BRIDGE_ID!r} connected from" in line)


@needs_mosquitto
def test_messages_mosquitto_queued_while_lightgate_restarted_all_arrive(
        tmp_path: Path, lightgate: Server) -> None:
    mq = edge(tmp_path, lightgate, BOTH)
    try:
        wait_state(lightgate, mq, b"1")
        wait_flowing(lightgate, mq)
        cloud_sub = Client(lightgate.port, "cloud-sub", clean=False)  # its session waits
        cloud_sub.subscribe("up/data/#", 1)
        edge_sub = Client(mq.port, "edge-sub")
        edge_sub.subscribe([("up/data/#", 1), ("down/data/#", 1)])
        edge_pub = Client(mq.port, "edge-pub")
        before = publish_all(edge_pub, "up/data/before", 50)
        assert collect(cloud_sub, 50, settle=0.2) == Counter(before)
        cloud_sub.disconnect()

        assert lightgate.stop() == 0
        # Lightgate is down: Mosquitto acknowledges these and queues them for the bridge.
        during = publish_all(edge_pub, "up/data/during")
        lightgate.start()  # same ports, same data
        wait_state(lightgate, mq, b"1")

        cloud_sub = Client(lightgate.port, "cloud-sub", clean=False)
        at_cloud = collect(cloud_sub, N)
        assert set(at_cloud) == during, f"missing: {sorted(during - set(at_cloud))[:5]}"
        dup = sum(at_cloud.values()) - N  # QoS 1: a resend is allowed, a loss is not
        assert dup <= 20, at_cloud.most_common(3)

        wait_flowing(lightgate, mq, up=False)
        downs = publish_all(Client(lightgate.port, "cloud-pub"), "down/data")
        at_edge = collect(edge_sub, 50 + N + N)
        # try_private (the default): nothing that went up comes back down as a duplicate.
        assert at_edge == Counter(before | during | downs)
    finally:
        mq.stop()


@needs_mosquitto
def test_bridge_user_with_a_policy_on_the_state_topics(tmp_path: Path) -> None:
    lg = auth_server(tmp_path)
    try:
        add_user(lg, "edge", "edge-pw")
        allow(lg, "edge", "Topic:#", "PUB,SUB")
        allow(lg, "edge", "Topic:$SYS/broker/connection/#", "PUB")
        add_user(lg, "app", "app-pw")
        allow(lg, "app", "Topic:#", "PUB,SUB")
        mq = edge(tmp_path, lg, f"{BOTH}\nremote_username edge\nremote_password edge-pw")
        try:
            wait_state(lg, mq, b"1", creds=ADMIN)
            wait_flowing(lg, mq, creds=("app", "app-pw"))
            cloud = Client(lg.port, "cloud-app", username="app", password="app-pw")
            cloud.subscribe("up/data/#", 1)
            edge_sub = Client(mq.port, "edge-sub")
            edge_sub.subscribe("down/data/#", 1)
            ups = publish_all(Client(mq.port, "edge-pub"), "up/data", 50)
            downs = publish_all(cloud, "down/data", 50)
            assert collect(cloud, 50) == Counter(ups)
            assert collect(edge_sub, 50) == Counter(downs)
        finally:
            mq.stop()
    finally:
        assert lg.stop() == 0, lg.logs()[-3000:]


@needs_mosquitto
def test_bridge_user_without_a_policy_on_the_state_topics_is_refused_with_a_reason(
        tmp_path: Path) -> None:
    lg = auth_server(tmp_path)
    try:
        add_user(lg, "edge", "edge-pw")
        allow(lg, "edge", "Topic:#", "PUB,SUB")  # '#' does not reach $SYS (MQTT 4.7.2)
        mq = edge(tmp_path, lg, f"{BOTH}\nremote_username edge\nremote_password edge-pw")
        try:
            assert lg.wait_log(f"connect of {BRIDGE_ID!r} from 127.0.0.1:", timeout=20), \
                lg.logs()[-3000:]
            line = next(x for x in lg.logs().splitlines()
                        if f"connect of {BRIDGE_ID!r} from" in x)
            assert " INFO " in line
            assert re.search(r"refused: will topic '\$SYS/broker/connection/.+/state' not "
                             r"authorized", line), line
            deadline = time.monotonic() + 10
            while "not authorised" not in mq.logs() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert "Connection Refused: not authorised" in mq.logs(), mq.logs()[-2000:]
        finally:
            mq.stop()
    finally:
        assert lg.stop() == 0, lg.logs()[-3000:]
