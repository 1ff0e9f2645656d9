"""Separated mode: kill -9 the store under QoS 1 load while devices stay on their gateway.

Devices (MQTT 5) keep their gateway connections through the outage; a QoS 1 publish the
gateway cannot store gets PUBACK 0x80 with a reason string, never a false success; once
the store is back (same data directory, `--flush sync`) publishes succeed again, and a
persistent subscriber on the other gateway then receives every message that was acked."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from gateway import mqtt
from tests.conftest import RedisServer, Server
from tests.faults.persistent import assert_each_in_order, drain
from tests.mqtt.raw import RawClient

PUBLISHERS = 3
WINDOW = 8  # QoS 1 publishes in flight per device
TOPIC = "outage/load"


@dataclass
class Device:
    """What one publishing device saw: PUBACKed payloads, refusals, a lost connection."""

    name: str
    acked: list[bytes] = field(default_factory=list)
    refused: list[tuple[bytes, int, str]] = field(default_factory=list)
    refused_at: list[float] = field(default_factory=list)
    acked_at: list[float] = field(default_factory=list)
    dropped: str = ""


def publish(port: int, dev: Device, stop: threading.Event) -> None:
    try:
        c = RawClient(port, version=5, timeout=20.0)
        c.connect(dev.name)
        inflight: dict[int, bytes] = {}
        i = 0
        while not stop.is_set():
            while len(inflight) < WINDOW:
                pid = i % 65535 + 1
                payload = f"{dev.name}-{i}".encode()
                c.send(mqtt.Publish(TOPIC, payload, qos=1, packet_id=pid))
                inflight[pid] = payload
                i += 1
            ack = c.recv()
            if not isinstance(ack, mqtt.Puback) or ack.packet_id not in inflight:
                continue
            payload = inflight.pop(ack.packet_id)
            if ack.reason_code == 0:
                dev.acked.append(payload)
                dev.acked_at.append(time.monotonic())
            else:
                reason = ack.properties.get("reason_string", "")
                dev.refused.append((payload, ack.reason_code, reason))
                dev.refused_at.append(time.monotonic())
                time.sleep(0.05)  # a device backs off on an error
        while inflight:  # settle what is still in flight before leaving
            ack = c.recv()
            if isinstance(ack, mqtt.Puback) and ack.packet_id in inflight:
                payload = inflight.pop(ack.packet_id)
                if ack.reason_code == 0:
                    dev.acked.append(payload)
        c.close()
    except (OSError, ConnectionError) as exc:
        dev.dropped = repr(exc)


def test_store_kill_9_under_load_loses_nothing_acked(tmp_path, redis_server: RedisServer) -> None:
    store = Server(tmp_path / "store", "--flush", "sync", "--notify", redis_server.url,
                   command="store").start()
    gw_a, gw_b = (Server(None, "--store", store.native, "--notify", redis_server.url,
                         "--max-offline-messages", "10000000", command="gateway").start()
                  for _ in range(2))
    try:
        sub = RawClient(gw_b.port)
        sub.connect("outage-sub", clean=False)
        sub.subscribe("outage/#", 1)
        sub.close()

        devices = [Device(f"dev{n}") for n in range(PUBLISHERS)]
        stop = threading.Event()
        threads = [threading.Thread(target=publish, args=(gw_a.port, d, stop)) for d in devices]
        for t in threads:
            t.start()
        time.sleep(1.5)
        store.kill()  # kill -9 mid-load
        killed_at = time.monotonic()
        time.sleep(2.0)
        store.start()  # same port, same data
        assert store.wait_log("commitlog recovered after a crash")
        restarted_at = time.monotonic()
        # Load goes on until every device has had publishes acked after the restart.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(
                d.acked_at and d.acked_at[-1] > restarted_at + 1 for d in devices):
            time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join(30)

        acked = [a for d in devices for a in d.acked]
        refused = [r for d in devices for r in d.refused]
        after = sum(t > restarted_at for d in devices for t in d.acked_at)
        print(f"acked {len(acked)}, refused {len(refused)} during the outage "
              f"({sorted({code for _, code, _ in refused})}), acked after the restart {after}")
        for d in devices:
            assert not d.dropped, f"{d.name} lost its gateway connection: {d.dropped}"
            assert any(t > restarted_at for t in d.acked_at), f"{d.name}: no ack after restart"
        if gw_a.addrs["plane"] == "python":  # the native plane holds them and sends
            # them again to the restarted store with their producer stamps, refusing none
            assert refused, "no publish was refused while the store was down"
        assert all(code == 0x80 and "store" in reason.lower() for _, code, reason in refused)
        assert all(t > killed_at - 0.5 for d in devices for t in d.refused_at)

        found = drain(gw_b.port, "outage-sub")
        missing = set(acked) - set(found)
        print(f"found {len(found)} ({len(set(found))} distinct), missing {len(missing)}")
        assert not missing, sorted(missing)[:10]
        assert_each_in_order(found, {d.name.encode() for d in devices})
    finally:
        for srv in (gw_a, gw_b, store):
            if srv.proc is not None:
                srv.stop()
