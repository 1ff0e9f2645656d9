"""End to end: `lightgate serve`, the alerts job run by the CLI on local[2], devices
publishing over MQTT, alerts reaching MQTT subscribers and a server app alike."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.spark.conftest import require_spark

require_spark()
# A minute or more on a 2-core machine (a second JVM for the CLI job): marked slow, and
# e2e so that `make test` (CI) runs it anyway.
pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(600)]

from store.sdk import Consumer  # noqa: E402
from tests.conftest import Server  # noqa: E402
from tests.mqtt.paho_client import Client  # noqa: E402
from tests.spark.conftest import Job, read_topic  # noqa: E402

RULES = """
source_topic = "devices"
device_from = "topic:1"
[[rule]]
name = "overheat"
field = "temperature"
op = ">"
threshold = 80
"""


def test_alerts_end_to_end(server: Server, tmp_path: Path) -> None:
    rules = tmp_path / "rules.toml"
    rules.write_text(RULES)
    sub = Client(server.port, "alert-watcher")
    sub.subscribe("alerts/#", qos=1)
    app = Consumer(server.native, "alert-app", "alerts")
    ck = tmp_path / "ck"
    # The job's own trigger: back to back, each batch waiting in the store for a reading.
    job = Job("analytics", "run", "alerts", "--server", server.native, "--rules", str(rules),
              "--checkpoint", str(ck), "--master", "local[2]", "--starting-offsets", "earliest")
    devices: dict[str, Client] = {}
    try:
        job.wait_for("analytics alerts running", 240)
        devices = {name: Client(server.port, f"sensor-{name}")
                   for name in ("dev-1", "dev-2", "dev-3")}
        now = int(time.time() * 1000)
        for step in range(3):
            for name, dev in devices.items():
                temp = 95.5 if name == "dev-2" and step == 1 else 20.0 + step
                dev.publish(f"devices/{name}/temp",
                            json.dumps({"temperature": temp, "ts": now + step}).encode(), qos=1)
        try:
            [got] = sub.expect(1, timeout=120)
        except TimeoutError as exc:
            raise AssertionError(f"no alert over MQTT: {exc}\n{job.log()}") from None
        alert = json.loads(got.payload)
        assert got.topic == "alerts/dev-2"
        assert alert["rule"] == "overheat" and alert["device"] == "dev-2"
        assert alert["value"] == 95.5 and alert["threshold"] == 80
        assert alert["ts"] == now + 1 and alert["topic"] == "devices/dev-2/temp"

        # None for the others: once the job has committed a batch reaching the end of
        # `devices`, every alert it will ever send for these readings is in the store.
        job.wait_committed(ck / "alerts-threshold", server.native, "devices", 120)
        assert read_topic(server.native, "alerts") == [("alerts/dev-2", alert)]
        sub.expect_none(0.5)  # and no duplicate on its way to the subscriber

        # A server app consuming `alerts` with the SDK receives the same.
        seen = []
        deadline = time.monotonic() + 30
        while not seen and time.monotonic() < deadline:
            for msg in app.poll(timeout=1.0):
                seen.append(msg)
                app.ack(msg)
        assert [(m.mqtt_topic, json.loads(m.body)) for m in seen] == [("alerts/dev-2", alert)]
    finally:
        for dev in devices.values():
            dev.disconnect()
        code = job.stop()
        app.close()
        sub.disconnect()
    assert code == 0, job.log()
