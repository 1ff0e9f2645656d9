"""The device-offline job: a device that goes quiet gets an `offline` alert on
`alerts/{device}` after --offline-after seconds, one that keeps talking gets none, and the
quiet one gets `online` when it speaks again."""

from __future__ import annotations

import json
import queue
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.spark.conftest import require_spark

require_spark()
# Tens of seconds on a 2-core machine: marked slow, and e2e so that `make test` (CI) runs
# it anyway.
pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(600)]

from spark_streaming.jobs import offline  # noqa: E402
from spark_streaming.jobs.common import JobConfig  # noqa: E402
from tests.conftest import Server  # noqa: E402
from tests.mqtt.paho_client import Client, Received  # noqa: E402
from tests.spark.conftest import progress_summary, read_topic  # noqa: E402

AFTER = 6.0  # --offline-after: well above the trigger and the chatty device's interval


def _reading(dev: Client, name: str, temp: float) -> None:
    dev.publish(f"devices/{name}/temp",
                json.dumps({"temperature": temp, "ts": int(time.time() * 1000)}).encode(),
                qos=1)


class Chatter(threading.Thread):
    """A device that never goes quiet: a reading every 0.5 s from before the query starts
    until the end (a first micro-batch can take longer than AFTER on a small machine)."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.client = Client(port, "sensor-chatty")
        self.done = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.done.is_set():
                _reading(self.client, "dev-chatty", 22.0)
                self.done.wait(0.5)
        except BaseException as exc:  # reported by the test
            self.error = exc

    def stop(self) -> None:
        if not self.done.is_set():
            self.done.set()
            self.join(15)
            self.client.disconnect()


def test_offline_and_back_online(spark: Any, server: Server, tmp_path: Path) -> None:
    sub = Client(server.port, "offline-watcher")
    sub.subscribe("alerts/#", qos=1)
    quiet = Client(server.port, "sensor-quiet")
    chatty = Chatter(server.port)
    cfg = JobConfig(server=server.native, checkpoint=str(tmp_path / "ck"),
                    starting_offsets="earliest", trigger="0.5 seconds")
    chatty.start()
    _reading(quiet, "dev-quiet", 21.0)
    went = time.monotonic()  # dev-quiet's last word, until it comes back
    got: list[Received] = []
    q = None

    def wait_alert(rule: str, timeout: float) -> dict:
        """Until an alert with `rule` arrives; returns its body. Every alert seen on the
        way is kept in `got`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert chatty.is_alive(), f"the chatty device failed: {chatty.error!r}"
            if not q.isActive:
                raise AssertionError(f"the offline query stopped\n{progress_summary(q)}")
            try:
                msg = sub.messages.get(timeout=0.2)
            except queue.Empty:
                continue
            got.append(msg)
            body = json.loads(msg.payload)
            if body["rule"] == rule:
                return body
        raise AssertionError(f"no {rule!r} alert within {timeout:.0f} s; got "
                             f"{[(m.topic, m.payload) for m in got]}\n{progress_summary(q)}")

    try:
        [q] = offline.start(spark, cfg, AFTER)
        down = wait_alert("offline", 120)
        # Not before it was due: the timeout counts from the timestamp of the batch that
        # read the reading (taken as that trigger began, so at most a moment before).
        assert time.monotonic() - went >= AFTER - 0.5
        assert got[-1].topic == "alerts/dev-quiet", [(m.topic, m.payload) for m in got]
        assert down["device"] == "dev-quiet" and down["threshold"] == AFTER
        assert down["value"] >= AFTER and down["topic"] == "devices/dev-quiet/temp"
        _reading(quiet, "dev-quiet", 21.5)
        up = wait_alert("online", 120)
        assert got[-1].topic == "alerts/dev-quiet", [(m.topic, m.payload) for m in got]
        assert up["device"] == "dev-quiet" and up["topic"] == "devices/dev-quiet/temp"
    finally:
        if q is not None:
            q.stop()  # before dev-chatty stops talking
        chatty.stop()
        quiet.disconnect()
        sub.disconnect()
    assert q.exception() is None, progress_summary(q)
    # dev-chatty never went quiet: everything the query wrote is in the store by now, and
    # it is exactly these two alerts; MQTT delivered nothing else.
    stored = read_topic(server.native, "alerts")
    assert [(t, b["rule"], b["device"]) for t, b in stored] == [
        ("alerts/dev-quiet", "offline", "dev-quiet"),
        ("alerts/dev-quiet", "online", "dev-quiet")], stored
    assert [json.loads(m.payload)["rule"] for m in got] == ["offline", "online"]
