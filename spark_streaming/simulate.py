"""Simulated devices: paho-mqtt clients publishing JSON temperatures, bounded in time.

Device i (1-based) is `dev-{i}`, client id `sim-dev-{i}`, publishing
`{"temperature": x, "ts": ms}` on `{prefix}/dev-{i}/temp` at `rate` messages per second.
Temperatures random-walk around `base`; the first `hot` devices read around `hot_temp`.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from serving.startup import CommandError
from serving.values import split_hostport

CONNACK_TIMEOUT_S = 10.0


@dataclass
class SimConfig:
    mqtt: str = "127.0.0.1:1883"
    devices: int = 10
    rate: float = 1.0  # messages per second per device
    seconds: float = 10.0
    topic_prefix: str = "devices"
    qos: int = 1
    base: float = 22.0
    hot: int = 0
    hot_temp: float = 95.0
    seed: int | None = None
    username: str | None = None  # when the broker runs with --auth
    password: str | None = None


def run(cfg: SimConfig, progress: bool = True) -> int:
    """Publish until `seconds` pass; returns the number of messages published."""
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion

    host, port = split_hostport(cfg.mqtt, "127.0.0.1")
    rng = random.Random(cfg.seed)
    clients = []
    try:
        for i in range(1, cfg.devices + 1):
            c = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"sim-dev-{i}")
            if cfg.username:
                c.username_pw_set(cfg.username, cfg.password)
            c.max_queued_messages_set(10_000)
            connack = _Connack()
            c.on_connect = connack.on_connect
            try:
                c.connect(host, port)
            except OSError as exc:
                raise CommandError(
                    f"cannot connect to the MQTT broker at {cfg.mqtt}: "
                    f"{os.strerror(exc.errno).lower() if exc.errno else exc}; give its "
                    "HOST:PORT with --mqtt") from None
            c.loop_start()
            clients.append(c)
            connack.check(cfg, f"sim-dev-{i}")
    except BaseException:
        _stop(clients)
        raise
    temps = [cfg.hot_temp if i < cfg.hot else cfg.base + rng.uniform(-2, 2)
             for i in range(cfg.devices)]
    sent = 0
    lock = threading.Lock()
    start = time.monotonic()
    interval = 1.0 / cfg.rate if cfg.rate > 0 else 1.0
    tick = 0
    last_report = start
    try:
        while time.monotonic() - start < cfg.seconds:
            now_ms = int(time.time() * 1000)
            for i, c in enumerate(clients):
                center = cfg.hot_temp if i < cfg.hot else cfg.base
                temps[i] += rng.uniform(-0.5, 0.5) + (center - temps[i]) * 0.1
                body = json.dumps({"temperature": round(temps[i], 2), "ts": now_ms})
                c.publish(f"{cfg.topic_prefix}/dev-{i + 1}/temp", body, cfg.qos)
                with lock:
                    sent += 1
            tick += 1
            if progress and time.monotonic() - last_report >= 1.0:
                last_report = time.monotonic()
                print(f"\rsimulate: {sent} messages from {cfg.devices} devices, "
                      f"{last_report - start:.0f}/{cfg.seconds:.0f} s", end="", file=sys.stderr,
                      flush=True)
            # Pace on the schedule, not on the loop's own duration.
            delay = start + tick * interval - time.monotonic()
            if delay > 0:
                time.sleep(delay)
    finally:
        _stop(clients)
    if progress:
        print(f"\rsimulate: {sent} messages from {cfg.devices} devices in "
              f"{time.monotonic() - start:.1f} s", file=sys.stderr)
    return sent


class _Connack:
    """A device's CONNACK, as paho's network thread hands it over."""

    def __init__(self) -> None:
        self.answered = threading.Event()
        self.code: Any = None

    def on_connect(self, client: Any, userdata: Any, flags: Any, code: Any,
                   properties: Any) -> None:
        self.code = code
        self.answered.set()

    def check(self, cfg: SimConfig, who: str) -> None:
        """A CommandError saying why the broker did not let `who` in, if it did not."""
        if not self.answered.wait(CONNACK_TIMEOUT_S):
            raise CommandError(f"the MQTT broker at {cfg.mqtt} did not answer {who}'s "
                               f"CONNECT within {CONNACK_TIMEOUT_S:g} s (--mqtt HOST:PORT)")
        if self.code.is_failure:
            raise CommandError(f"the MQTT broker at {cfg.mqtt} refused {who}: {self.code} "
                               "(credentials: --as NAME:PASSWORD or LIGHTGATE_AUTH)")


def _stop(clients: list[Any]) -> None:
    for c in clients:
        c.disconnect()
        c.loop_stop()
