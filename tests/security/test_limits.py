"""Gateway limits: each refusal has a clear reason code and a log line."""

from __future__ import annotations

import time

from gateway import mqtt
from tests.conftest import Server
from tests.mqtt.paho_client import Client
from tests.mqtt.raw import RawClient


def test_max_connections(tmp_path) -> None:
    s = Server(tmp_path / "d", "--max-connections", "2").start()
    try:
        a, b = Client(s.port, "a", version=5), Client(s.port, "b", version=5)
        raw = RawClient(s.port, 5)
        assert raw.connect("c").reason_code == 0x97  # Quota exceeded
        raw.close()
        raw = RawClient(s.port, 4)
        assert raw.connect("c3").reason_code == 3  # 3.1.1: server unavailable
        raw.close()
        a.disconnect()
        time.sleep(0.2)
        Client(s.port, "c", version=5).disconnect()  # room again
        b.disconnect()
        assert s.wait_log("--max-connections")
    finally:
        assert s.stop() == 0


def test_connect_rate_per_source(tmp_path) -> None:
    s = Server(tmp_path / "d", "--max-connect-rate", "3").start()
    try:
        codes = []
        for i in range(8):
            raw = RawClient(s.port, 5)
            codes.append(raw.connect(f"r{i}").reason_code)
            raw.close()
        assert codes[:3] == [0, 0, 0]
        assert 0x9F in codes  # Connection rate exceeded
        assert s.wait_log("--max-connect-rate")
    finally:
        assert s.stop() == 0


def test_publish_rate_disconnects_with_reason(tmp_path) -> None:
    s = Server(tmp_path / "d", "--max-publish-rate", "20").start()
    try:
        raw = RawClient(s.port, 5)
        raw.connect("flood")
        for i in range(200):
            try:
                raw.send(mqtt.Publish("flood/x", b"%d" % i, 0))
            except OSError:
                break
        packet = raw.recv()
        assert isinstance(packet, mqtt.Disconnect) and packet.reason_code == 0x96
        raw.close()
        assert s.wait_log("publishes/s")
    finally:
        assert s.stop() == 0


def test_bytes_rate(tmp_path) -> None:
    s = Server(tmp_path / "d", "--max-publish-bytes-rate", "10000").start()
    try:
        c = Client(s.port, "big", version=5)
        c.publish("big/x", b"x" * 5000, qos=1)  # within the burst
        for _ in range(5):
            c.publish("big/x", b"x" * 5000, qos=0)
        assert c.disconnected.wait(5)
        assert s.wait_log("bytes/s")
    finally:
        assert s.stop() == 0


def test_max_subscriptions(tmp_path) -> None:
    s = Server(tmp_path / "d", "--max-subscriptions", "2").start()
    try:
        c = Client(s.port, "subs", version=5)
        codes = c.subscribe([("a/1", 0), ("a/2", 1), ("a/3", 0)])
        assert [x.value for x in codes] == [0, 1, 0x97]
        assert [x.value for x in c.subscribe("a/1", 1)] == [1]  # a re-subscribe is no new one
        c3 = Client(s.port, "subs3", version=4)
        codes3 = c3.subscribe([("b/1", 0), ("b/2", 0), ("b/3", 0)])
        assert [getattr(x, "value", x) for x in codes3] == [0, 0, 0x80]
        c.disconnect()
        c3.disconnect()
    finally:
        assert s.stop() == 0


def test_max_packet_size_is_enforced(tmp_path) -> None:
    s = Server(tmp_path / "d", "--max-packet-size", "1024").start()
    try:
        raw = RawClient(s.port, 5)
        ack = raw.connect("pk")
        assert ack.properties["maximum_packet_size"] == 1024
        raw.send(mqtt.Publish("pk/x", b"x" * 2000, 0))
        packet = raw.recv()
        assert isinstance(packet, mqtt.Disconnect) and packet.reason_code == 0x95
        raw.close()
    finally:
        assert s.stop() == 0
