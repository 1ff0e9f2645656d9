"""A small synchronous wrapper over paho-mqtt for tests: connect, wait for acks, collect
messages, all with bounded waits."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

TIMEOUT = 10.0


@dataclass
class Received:
    topic: str
    payload: bytes
    qos: int
    retain: bool
    dup: bool
    properties: object = None


class Client:
    def __init__(
        self,
        port: int,
        client_id: str = "",
        *,
        clean: bool = True,
        version: int = 4,
        keepalive: int = 60,
        will: tuple[str, bytes, int, bool] | None = None,
        auto_reconnect: bool = False,
        properties: object = None,
        clean_start: bool | None = None,
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        proto = {3: paho.MQTTv31, 4: paho.MQTTv311, 5: paho.MQTTv5}[version]
        kwargs = {} if version == 5 else {"clean_session": clean}
        self.c = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=proto,
                             reconnect_on_failure=auto_reconnect, **kwargs)
        self.messages: queue.Queue[Received] = queue.Queue()
        self.connected = threading.Event()
        self.disconnected = threading.Event()
        self.connack: tuple = ()
        self.disconnect_reason: object = None  # the last disconnect's (paho's ReasonCode)
        self._acks: dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        self.granted: dict[int, list] = {}
        self.c.on_connect = self._on_connect
        self.c.on_disconnect = self._on_disconnect
        self.c.on_message = self._on_message
        self.c.on_publish = self._on_publish
        self.c.on_subscribe = self._on_subscribe
        self.c.on_unsubscribe = self._on_unsubscribe
        self.pub_codes: dict[int, object] = {}
        if username is not None:
            self.c.username_pw_set(username, password)
        if will:
            self.c.will_set(*will)
        self.c.connect("127.0.0.1", port, keepalive, clean_start=(
            clean_start if clean_start is not None else paho.MQTT_CLEAN_START_FIRST_ONLY
        ) if version == 5 else paho.MQTT_CLEAN_START_FIRST_ONLY, properties=properties)
        self.c.loop_start()
        if not self.connected.wait(TIMEOUT):
            raise TimeoutError("no CONNACK")

    # callbacks (paho's thread)
    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        self.connack = (flags.session_present, reason_code, properties)
        self.disconnected.clear()
        self.connected.set()

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        self.disconnect_reason = reason_code
        self.connected.clear()
        self.disconnected.set()

    def _on_message(self, client, userdata, msg) -> None:
        self.messages.put(Received(msg.topic, msg.payload, msg.qos, bool(msg.retain),
                                   bool(msg.dup), getattr(msg, "properties", None)))

    def _ack_event(self, mid: int) -> threading.Event:
        with self._lock:
            return self._acks.setdefault(mid, threading.Event())

    def _on_publish(self, client, userdata, mid, reason_code, properties) -> None:
        self.pub_codes[mid] = reason_code
        self._ack_event(mid).set()

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        self.granted[mid] = reason_codes
        self._ack_event(mid).set()

    def _on_unsubscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        self._ack_event(mid).set()

    # API
    def subscribe(self, topic: str | list, qos: int = 0, **kw) -> list:
        if isinstance(topic, list):
            rc, mid = self.c.subscribe(topic, **kw)
        else:
            rc, mid = self.c.subscribe(topic, qos, **kw)
        assert rc == 0
        assert self._ack_event(mid).wait(TIMEOUT), "no SUBACK"
        return self.granted[mid]

    def unsubscribe(self, topic: str) -> None:
        rc, mid = self.c.unsubscribe(topic)
        assert self._ack_event(mid).wait(TIMEOUT), "no UNSUBACK"

    def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False,
                wait: bool = True, **kw) -> int:
        info = self.c.publish(topic, payload, qos, retain, **kw)
        if wait and qos:
            assert self._ack_event(info.mid).wait(TIMEOUT), f"no ack for QoS {qos}"
        return info.mid

    def expect(self, n: int = 1, timeout: float = TIMEOUT) -> list[Received]:
        out = []
        deadline = time.monotonic() + timeout
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"got {len(out)} of {n} messages: {out}")
            try:
                out.append(self.messages.get(timeout=left))
            except queue.Empty:
                continue
        return out

    def expect_none(self, wait: float = 0.5) -> None:
        time.sleep(wait)
        assert self.messages.empty(), f"unexpected: {self.messages.get_nowait()}"

    def disconnect(self) -> None:
        self.c.disconnect()
        self.disconnected.wait(TIMEOUT)
        self.c.loop_stop()

    def drop(self) -> None:
        """Vanish without DISCONNECT, as a device losing power would."""
        self.c.loop_stop()
        sock = self.c.socket()
        if sock is not None:
            sock.close()
