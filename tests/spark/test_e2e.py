"""End to end: `lightgate serve`, the alerts job run by the CLI on local[2], devices
publishing over MQTT, alerts reaching MQTT subscribers and a server app alike."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("pyspark", reason="pyspark not installed: pip install 'lightgate[spark]'")
pytest.importorskip("pyarrow", reason="pyarrow not installed: pip install 'lightgate[spark]'")
# Minutes on a 2-core machine (JVM start, query start-up): tests/spark as a whole
# takes over 4 minutes, so these run with `make soak` / `pytest -m slow`.
pytestmark = pytest.mark.slow

from store.sdk import Consumer  # noqa: E402
from tests.conftest import ROOT, Server  # noqa: E402
from tests.mqtt.paho_client import Client  # noqa: E402
from tests.spark.conftest import java_missing  # noqa: E402

RULES = """
source_topic = "devices"
device_from = "topic:1"
[[rule]]
name = "overheat"
field = "temperature"
op = ">"
threshold = 80
"""


class Job:
    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "lightgate", *args], cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(text in line for line in self.lines):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(f"no {text!r} from the job: {''.join(self.lines)[-3000:]}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


def test_alerts_end_to_end(lg: Server, tmp_path: Path) -> None:
    reason = java_missing()
    if reason:
        pytest.skip(reason)
    rules = tmp_path / "rules.toml"
    rules.write_text(RULES)
    sub = Client(lg.port, "alert-watcher")
    sub.subscribe("alerts/#", qos=1)
    app = Consumer(lg.native, "alert-app", "alerts")
    job = Job("analytics", "run", "alerts", "--server", lg.native, "--rules", str(rules),
              "--checkpoint", str(tmp_path / "ck"), "--master", "local[2]",
              "--trigger", "0.5 seconds", "--starting-offsets", "earliest")
    try:
        job.wait_for("analytics alerts running", 240)
        devices = {name: Client(lg.port, f"sensor-{name}") for name in ("dev-1", "dev-2",
                                                                         "dev-3")}
        now = int(time.time() * 1000)
        for step in range(3):
            for name, dev in devices.items():
                temp = 95.5 if name == "dev-2" and step == 1 else 20.0 + step
                dev.publish(f"devices/{name}/temp",
                            json.dumps({"temperature": temp, "ts": now + step}).encode(), qos=1)
        [got] = sub.expect(1, timeout=90)
        sub.expect_none(3.0)  # and nothing for dev-1 or dev-3
        alert = json.loads(got.payload)
        assert got.topic == "alerts/dev-2"
        assert alert["rule"] == "overheat" and alert["device"] == "dev-2"
        assert alert["value"] == 95.5 and alert["threshold"] == 80
        assert alert["ts"] == now + 1 and alert["topic"] == "devices/dev-2/temp"

        seen = []
        deadline = time.monotonic() + 30
        while not seen and time.monotonic() < deadline:
            for msg in app.poll(timeout=1.0):
                seen.append(msg)
                app.ack(msg)
        assert [(m.mqtt_topic, json.loads(m.body)) for m in seen] == [("alerts/dev-2", alert)]
        for dev in devices.values():
            dev.disconnect()
    finally:
        code = job.stop()
        app.close()
        sub.disconnect()
    assert code == 0, "".join(job.lines)[-3000:]
