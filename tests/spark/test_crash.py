"""Exactly once from device to alert, with the Spark driver killed: simulated devices
publish over MQTT to `lightgate serve`; one driver runs the alerts and aggregates jobs
(tests/spark/crash_jobs.py) and is killed with SIGKILL (the driver's process group: its
JVM and Python workers too) at chosen moments, then restarted from its checkpoints.
Half of the kills come the moment an alert or an aggregate reaches an MQTT subscriber
(its batch is stored, its commit most likely not yet written: the batch is replayed),
the others at random moments. At the end an MQTT subscriber of `alerts/#` and an SDK
consumer of `alerts` each received every alert the readings call for exactly once, and
the last aggregate of every (device, window) equals the readings' figures, with no
aggregate stored twice.

LIGHTGATE_SPARK_KILLS sets the kills (2 here; `make soak` runs 10)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

from tests.spark.conftest import require_spark

require_spark()
pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(1800)]

from store.sdk import Consumer  # noqa: E402
from tests.conftest import ROOT, Server  # noqa: E402
from tests.spark.conftest import committed_offsets, read_topic, store_ends, wait_until  # noqa: E402

KILLS = int(os.environ.get("LIGHTGATE_SPARK_KILLS", "2"))
THRESHOLD = 80.0
WINDOW_MS = 10_000


class Driver:
    """tests/spark/crash_jobs.py in a session of its own, so that a kill takes its JVM
    and Python workers with it."""

    def __init__(self, server: str, checkpoint: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.spark.crash_jobs", server, str(checkpoint)],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    def log(self) -> str:
        """What it said, short: the lines that are not a stack frame, last ones first."""
        said = [x for x in self.lines if not x.lstrip().startswith("at ")]
        return "".join(said)[-4000:]

    def wait_running(self, timeout: float = 240.0) -> None:
        wait_until(lambda: self._alive() and any(x.startswith("running") for x in self.lines),
                   timeout, "the driver's queries running", self.log)

    def _alive(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the driver exited ({self.proc.returncode}):\n{self.log()}")
        return True

    def kill(self) -> None:
        """SIGKILL to the driver's whole process group; returns once none of it is left
        (a JVM still writing would race its successor for the checkpoint)."""
        pgid = self.proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        self.proc.wait(30)
        wait_until(lambda: not _group_alive(pgid), 30, "the killed driver's processes gone")


def _group_alive(pgid: int) -> bool:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


class Subscriber:
    """An MQTT subscriber of alerts/# and analytics/#: what it got, and an event set at
    each arrival (the moment to kill)."""

    def __init__(self, port: int) -> None:
        import paho.mqtt.client as paho
        from paho.mqtt.enums import CallbackAPIVersion

        self.got: queue.Queue = queue.Queue()
        self.arrived = {"alerts": threading.Event(), "analytics": threading.Event()}
        subscribed = threading.Event()
        self.client = paho.Client(CallbackAPIVersion.VERSION2, client_id="crash-test-sub")
        self.client.on_message = self._on
        self.client.on_subscribe = lambda *a: subscribed.set()
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        self.client.subscribe([("alerts/#", 1), ("analytics/#", 1)])
        assert subscribed.wait(10), "no SUBACK"

    def _on(self, client: object, userdata: object, msg: Any) -> None:
        self.got.put((msg.topic, msg.payload))
        self.arrived[msg.topic.split("/", 1)[0]].set()

    def drain(self) -> list[tuple[str, bytes]]:
        out = []
        while True:
            try:
                out.append(self.got.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def _consume(addr: str, stop: threading.Event, out: list[dict]) -> None:
    with Consumer(addr, "crash-test", "alerts") as c:
        while not stop.is_set():
            for m in c.poll(timeout=0.5):
                out.append(json.loads(m.body))
                c.ack(m)


def _truth(readings: list[tuple[str, dict]], msg_ids: list[str]) -> tuple[set, dict]:
    """The alerts the readings call for (by reading msg_id) and each (device, window)'s
    count, min, max."""
    alerts = set()
    windows: dict[tuple, list[float]] = defaultdict(list)
    for (topic, body), msg_id in zip(readings, msg_ids, strict=True):
        device = topic.split("/")[1]
        if body["temperature"] > THRESHOLD:
            alerts.add(msg_id)
        windows[(device, body["ts"] // WINDOW_MS * WINDOW_MS)].append(body["temperature"])
    return alerts, {k: (len(v), min(v), max(v)) for k, v in windows.items()}


def _readings(addr: str) -> tuple[list[tuple[str, dict]], list[str]]:
    from spark_streaming.native import StoreClient

    rows, ids = [], []
    with StoreClient(addr) as c:
        for q in sorted(c.describe("devices"), key=lambda q: q["queue"]):
            for _, m in c.read_range(q["queue"], int(q["min_offset"]), int(q["max_offset"])):
                rows.append((m.topic, json.loads(m.body)))
                ids.append(m.msg_id)
    return rows, ids


def test_driver_killed_alerts_and_aggregates_exactly_once(server: Server,
                                                          tmp_path: Path) -> None:
    rng = random.Random(38)
    checkpoint = tmp_path / "ck"
    sub = Subscriber(server.port)
    consumed: list[dict] = []
    stop = threading.Event()
    consumer = threading.Thread(target=_consume, args=(server.native, stop, consumed),
                                daemon=True)
    consumer.start()
    driver = Driver(server.native, checkpoint)
    kills: list[str] = []
    stop_devices = _start_devices(server)
    try:
        driver.wait_running()
        for k in range(KILLS):
            how = ("alerts", "analytics")[k % 2] if k % 4 < 2 else "random"
            if how == "random":
                time.sleep(rng.uniform(0.5, 6.0))
            else:
                time.sleep(rng.uniform(1.0, 3.0))
                sub.arrived[how].clear()
                sub.arrived[how].wait(60)
            driver.kill()
            kills.append(how)
            driver = Driver(server.native, checkpoint)
            driver.wait_running()
        stop_devices()
        # Everything published is processed and committed by both queries.
        for name in ("alerts-threshold", "aggregates-tumbling"):
            want = {q: n for q, n in store_ends(server.native, "devices").items() if n}
            wait_until(lambda n=name, w=want: {q: v for q, v in (committed_offsets(
                checkpoint / n) or {}).items() if v} == w, 180, f"{name} caught up",
                       driver.log)
        time.sleep(3)  # the last alerts' MQTT deliveries and the consumer's polls
    finally:
        stop.set()
        stop_devices()
        driver.kill()
    consumer.join(20)
    readings, msg_ids = _readings(server.native)
    want_alerts, want_windows = _truth(readings, msg_ids)
    assert len(want_alerts) > 50, len(want_alerts)

    mqtt = sub.drain()
    sub.close()
    by_mqtt = Counter(json.loads(p)["msg_id"] for t, p in mqtt if t.startswith("alerts/"))
    by_sdk = Counter(a["msg_id"] for a in consumed)
    stored_alerts = Counter(b["msg_id"] for _, b in read_topic(server.native, "alerts"))
    report = (f"kills {kills}: {len(want_alerts)} alerts due; stored "
              f"{sum(stored_alerts.values())}, MQTT {sum(by_mqtt.values())}, SDK "
              f"{sum(by_sdk.values())}")
    print(report)
    for name, got in (("stored", stored_alerts), ("MQTT", by_mqtt), ("SDK", by_sdk)):
        twice = {k: n for k, n in got.items() if n > 1}
        assert not twice, f"{name}: {len(twice)} alerts more than once; {report}"
        assert set(got) == want_alerts, \
            f"{name}: missing {len(want_alerts - set(got))}, extra " \
            f"{len(set(got) - want_alerts)}; {report}"

    aggregates = [b for _, b in read_topic(server.native, "analytics")]
    bodies = Counter(json.dumps(b, sort_keys=True) for b in aggregates)
    assert max(bodies.values()) == 1, "an aggregate stored twice"
    last: dict[tuple, dict] = {}
    for b in aggregates:  # in store order per queue: a window's updates grow its count
        key = (b["device"], b["window_start"])
        if key not in last or b["count"] >= last[key]["count"]:
            last[key] = b
    got_windows = {k: (b["count"], b["min"], b["max"]) for k, b in last.items()}
    assert got_windows == want_windows


def _start_devices(server: Server) -> Any:
    """Simulated devices until the returned function is called (then they stop)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "lightgate", "simulate", "--devices", "6", "--rate", "4",
         "--mqtt", f"127.0.0.1:{server.port}", "--seconds", "3600", "--hot", "2",
         "--seed", "38"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop() -> None:
        if proc.poll() is not None:
            return
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        time.sleep(1.0)  # QoS 1 publishes in flight land

    return stop
