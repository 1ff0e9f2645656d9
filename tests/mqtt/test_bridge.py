"""What a bridge to Lightgate relies on, over a raw socket: the bridge bit of a
try_private CONNECT, which `$` topics a client may write (a bridge's state), no echo
and retain as published on a bridge's subscriptions, a log line for every refused
CONNECT."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway import mqtt
from gateway.mqtt import reason as rc
from tests.conftest import Server
from tests.mqtt.raw import RawClient
from tests.security.helpers import add_user, allow, auth_server

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
