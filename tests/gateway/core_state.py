"""What the gateway hands the MQTT core (gateway.mqtt.protocol), as plain values: a
session's share of the state and a stored message. The core's tests and its fuzzer
(tests/fuzz/fuzz_connection.py) drive it with these instead of a session and a store."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from gateway.mqtt import protocol as mp


@dataclass
class Flows:
    """A session's share of the state (gateway.session.Session has the real one)."""

    client_id: str = ""
    persistent: bool = False
    expiry: int = 0
    next_packet_id: int = 1
    outgoing: OrderedDict[int, mp.Outgoing] = field(default_factory=OrderedDict)
    incoming_qos2: set[int] = field(default_factory=set)

    def in_flight(self) -> int:
        return len(self.outgoing)


@dataclass
class Stored:
    """A stored message, as the core reads it (the store's Message has more)."""

    topic: str
    body: bytes
    qos: int = 1
    properties: dict[str, Any] = field(default_factory=dict)
    store_ts: int = 0
