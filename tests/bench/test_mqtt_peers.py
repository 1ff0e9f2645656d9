"""The peer brokers of the MQTT benchmark (RabbitMQ's MQTT plugin, rumqttd): their configs
carry the bounds every broker gets, each starts on loopback, passes QoS 0 and QoS 1
messages and leaves no process behind; a broker's CPU counts its whole process tree.
The smokes skip where a peer is not installed (`make bench-peers` installs both)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from bench.mqtt import brokers
from bench.mqtt.cli import add_ratios
from bench.mqtt.installs import RABBITMQ_SERVER, RUMQTTD
from bench.mqtt.procfs import _tree, cpu_seconds, rss_kb
from bench.mqtt.wire import (
    acks_in,
    connect,
    puback,
    publish_fields,
    recv_batch,
    set_keepalive,
    split_frames,
    subscribe,
)
from gateway import mqtt

INSTALLED = {"rabbitmq": RABBITMQ_SERVER, "rumqttd": RUMQTTD}


def test_rumqttd_config_is_its_toml_with_the_shared_bounds() -> None:
    conf = tomllib.loads(brokers.rumqttd_config(18830, 200_000))
    assert conf["router"]["max_connections"] == 200_000  # the idle scenario's connections
    server = conf["v4"]["1"]
    assert server["listen"] == "127.0.0.1:18830"
    assert server["next_connection_delay_ms"] == 0  # no 1 ms pause between accepts
    assert server["connections"]["max_payload_size"] == brokers.MAX_PACKET
    assert set(conf) == {"id", "router", "v4"}  # no console, metrics or other listeners


def test_rabbitmq_config_listens_on_loopback_with_the_shared_bounds(tmp_path: Path) -> None:
    conf = dict(line.split(" = ", 1)
                for line in brokers.rabbitmq_config(18831, 18832, tmp_path).splitlines())
    assert conf["mqtt.listeners.tcp.default"] == "127.0.0.1:18831"
    assert conf["listeners.tcp.default"] == "127.0.0.1:18832"
    assert conf["mqtt.prefetch"] == str(brokers.MAX_INFLIGHT)
    assert conf["mqtt.allow_anonymous"] == "true"
    defs = brokers.rabbitmq_definitions()
    [policy] = defs["policies"]
    assert policy["definition"] == {"max-length": brokers.MAX_QUEUED}
    # The guest password hash is RabbitMQ's: base64(salt + sha256(salt + password)).
    raw = base64.b64decode(defs["users"][0]["password_hash"])
    assert hashlib.sha256(raw[:4] + b"guest").digest() == raw[4:]


def test_ratios_against_each_peer_that_ran() -> None:
    rows = [{"broker": "mosquitto", "msgs_per_s": 100}, {"broker": "rabbitmq", "msgs_per_s": 50},
            {"broker": "lightgate-async", "msgs_per_s": 75}]
    add_ratios(rows, "msgs_per_s")
    assert rows[2]["ratio_vs_mosquitto"] == 0.75 and rows[2]["ratio_vs_rabbitmq"] == 1.5
    assert "ratio_vs_rumqttd" not in rows[2]


def test_cpu_and_memory_count_grandchildren(tmp_path: Path) -> None:
    """A broker's work may run two levels down (RabbitMQ: script, beam.smp, helpers)."""
    burn = tmp_path / "burn.py"
    burn.write_text("import time\nt = time.process_time()\n"
                    "while time.process_time() - t < 0.6:\n    pass\ntime.sleep(30)\n")
    # sh -> sh -> python (`; :` keeps each shell from exec-ing its command)
    top = subprocess.Popen(["sh", "-c", f"sh -c '{sys.executable} {burn}; :'; :"])
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(_tree(top.pid)) < 3:
            time.sleep(0.05)
        grandchild = _tree(top.pid)[-1]
        while time.monotonic() < deadline and cpu_seconds([grandchild]) < 0.5:
            time.sleep(0.1)
        assert cpu_seconds([top.pid]) >= 0.5
        assert rss_kb(top.pid) > rss_kb(grandchild) > 0
    finally:
        for pid in reversed(_tree(top.pid)):
            os.kill(pid, 9)
        top.wait()


def _passes_messages(port: int, pub_port: int | None = None) -> None:
    """QoS 0 and QoS 1 from a publisher (on `pub_port`: another gateway's) to a QoS 1
    subscriber, each PUBACKed."""
    sub = connect(port, "peer-sub")
    subscribe(sub, "peer/+", 1)
    pub = connect(port if pub_port is None else pub_port, "peer-pub")
    n = 20
    pub.sendall(b"".join(mqtt.encode_publish("peer/t", b"x" * 64, i % 2, False, False,
                                             i + 1 if i % 2 else None, 4) for i in range(n)))
    got, acked, rest, buf = 0, 0, b"", b""
    deadline = time.monotonic() + 20
    sub.settimeout(1)
    pub.settimeout(1)
    while (got < n or acked < n // 2) and time.monotonic() < deadline:
        try:
            buf += recv_batch(sub, 65536)  # over TLS: every record there
            count, frames, used = split_frames(buf, True)
            buf = buf[used:]
            got += count
            sub.sendall(b"".join(puback(publish_fields(b0, body)[0])
                                 for b0, body in frames if b0 >> 4 == 3 and b0 & 0x06))
        except TimeoutError:
            pass
        try:
            k, rest = acks_in(rest, recv_batch(pub, 65536))
            acked += k
        except TimeoutError:
            pass
    sub.close()
    pub.close()
    assert (got, acked) == (n, n // 2)


@pytest.mark.parametrize("name", [
    pytest.param("rabbitmq", marks=pytest.mark.slow),  # its VM boots in 10-20 s
    "rumqttd"])
def test_peer_starts_passes_messages_and_stops_clean(name: str) -> None:
    if not INSTALLED[name].exists():
        pytest.skip(f"{name} not installed (make bench-peers)")
    b = brokers.start_broker(name)
    try:
        tree = _tree(b.pid)
        set_keepalive(b.keepalive)  # as the runner does: rumqttd refuses keepalive 0
        _passes_messages(b.port)
        assert b.died() is None
        assert b.notes  # what its rows say about how it ran
        if name == "rabbitmq":
            comms = {Path(f"/proc/{p}/comm").read_text().strip() for p in _tree(b.procs[0].pid)}
            assert comms == {"epmd"}  # our own, on a port of its own
            assert "beam.smp" in {Path(f"/proc/{p}/comm").read_text().strip() for p in tree}
            tree += _tree(b.procs[0].pid)
    finally:
        set_keepalive(0)
        b.stop()
    time.sleep(0.5)
    left = [p for p in tree if Path(f"/proc/{p}").exists()
            and "Z" not in Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]]
    assert left == [], json.dumps([Path(f"/proc/{p}/cmdline").read_text() for p in left])
