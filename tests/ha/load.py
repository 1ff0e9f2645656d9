"""MQTT load for the store-group tests: QoS 1 publishers (paho, MQTT 5) that resend what
was refused, and a persistent subscriber whose deliveries are counted."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from tests.mqtt.paho_client import Client

TOPIC = "ha/load"


@dataclass
class Publisher:
    """A device publishing QoS 1, one at a time, resending what was refused."""

    port: int
    name: str
    acked: list[bytes] = field(default_factory=list)
    acked_at: list[float] = field(default_factory=list)
    refused: int = 0
    timeouts: int = 0
    error: str = ""

    def run(self, stop: threading.Event, paused: threading.Event | None = None) -> None:
        try:
            c = Client(self.port, self.name, version=5)
            i = 0
            while not stop.is_set():
                if paused is not None and paused.is_set():
                    time.sleep(0.05)
                    continue
                payload = f"{self.name}-{i}".encode()
                mid = c.publish(TOPIC, payload, qos=1, wait=False)
                if not c._ack_event(mid).wait(15):
                    self.timeouts += 1
                    continue
                code = c.pub_codes[mid]
                if int(getattr(code, "value", code)) == 0:
                    self.acked.append(payload)
                    self.acked_at.append(time.monotonic())
                    i += 1
                else:  # 0x80 while the group has no master: back off, send it again
                    self.refused += 1
                    time.sleep(0.1)
            c.disconnect()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = repr(exc)


class Load:
    """Publishers spread over the gateways' ports, in threads, until stopped."""

    def __init__(self, ports: list[int], n: int = 4) -> None:
        self.pubs = [Publisher(ports[i % len(ports)], f"p{i}") for i in range(n)]
        self.stop_event = threading.Event()
        self.paused = threading.Event()  # set: the publishers wait (the group idles)
        self.threads = [threading.Thread(target=p.run, args=(self.stop_event, self.paused),
                                         daemon=True) for p in self.pubs]

    def start(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def acked(self) -> int:
        return sum(len(p.acked) for p in self.pubs)

    def refused(self) -> int:
        return sum(p.refused for p in self.pubs)

    def first_ack_after(self, t: float) -> float | None:
        times = [a for p in self.pubs for a in p.acked_at if a > t]
        return min(times) if times else None

    def stop(self) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(20)
        for p in self.pubs:
            assert not p.error, p.error

    def all_acked(self) -> list[bytes]:
        return [a for p in self.pubs for a in p.acked]


def subscriber(port: int, client_id: str = "ha-sub") -> Client:
    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = 3600
    return Client(port, client_id, version=5, clean_start=False, properties=props)


def collect(sub: Client, idle_s: float) -> list[bytes]:
    out: list[bytes] = []
    while True:
        try:
            out.append(sub.messages.get(timeout=idle_s).payload)
        except Exception:  # noqa: BLE001 - queue.Empty: quiet for idle_s
            return out


def overlapping_acks(statuses: dict[str, dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Pairs of (node, epoch) mastership spans, on different nodes, whose first-to-last
    acknowledgement times (CLOCK_MONOTONIC, one host) overlap: two nodes acknowledging
    writes at once. `statuses`: node -> its /api/v1/cluster."""
    spans = [(node, int(epoch), a, b) for node, st in statuses.items()
             for epoch, (a, b) in st.get("acked_at", {}).items()]
    return [(x, y) for x, y in combinations(spans, 2)
            if x[0] != y[0] and x[2] <= y[3] and y[2] <= x[3]]
