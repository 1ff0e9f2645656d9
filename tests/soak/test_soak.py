"""Soak: mixed MQTT load (QoS 0/1/2 publishers, wildcard and shared subscribers, churn of
connects and disconnects, retained updates) with RSS and open-fd sampling.

The short form runs in `make test`; `make soak` runs 30 minutes (LIGHTGATE_SOAK_SECONDS)
and checks there is no growth trend over the second half; its samples are written to
bench/results/soak_long.json."""

from __future__ import annotations

import json
import os
import random
import threading
import time
from pathlib import Path

import pytest

from gateway import mqtt
from tests.conftest import Server
from tests.mqtt.raw import RawClient

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def proc_stats(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/status") as fh:
        rss = next(int(ln.split()[1]) for ln in fh if ln.startswith("VmRSS:"))
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def worker(port: int, n: int, stop: threading.Event, errors: list[str]) -> None:
    rng = random.Random(n)
    while not stop.is_set():
        try:
            c = RawClient(port, version=rng.choice([4, 5]), timeout=5)
            c.connect(f"soak-{n}-{rng.randrange(4)}", clean=rng.random() < 0.5)
            c.subscribe(rng.choice(["soak/+/t", "soak/#", "$share/g/soak/+/t"]),
                        rng.randrange(3))
            pid = 1
            for _ in range(rng.randrange(50, 300)):
                if stop.is_set():
                    break
                qos = rng.randrange(3)
                c.send(mqtt.Publish(f"soak/{rng.randrange(20)}/t", os.urandom(64), qos,
                                    rng.random() < 0.05, False, pid if qos else None))
                pid = pid % 60000 + 1
                c.sock.settimeout(0.001)
                try:  # read (and acknowledge) whatever arrived, without blocking long
                    while True:
                        p = c.recv()
                        if isinstance(p, mqtt.Publish) and p.qos == 1:
                            c.send(mqtt.Puback(p.packet_id))
                        elif isinstance(p, mqtt.Publish) and p.qos == 2:
                            c.send(mqtt.Pubrec(p.packet_id))
                        elif isinstance(p, mqtt.Pubrec):
                            c.send(mqtt.Pubrel(p.packet_id))
                        elif isinstance(p, mqtt.Pubrel):
                            c.send(mqtt.Pubcomp(p.packet_id))
                except (TimeoutError, BlockingIOError):
                    pass
                time.sleep(0.002)
            if rng.random() < 0.5:
                c.send(mqtt.Disconnect())
            c.close()  # else: abrupt
        except (OSError, ConnectionError, AssertionError) as exc:
            errors.append(repr(exc))
            time.sleep(0.1)


def run_soak(tmp_path: Path, seconds: float, out: Path) -> list[tuple[float, int, int]]:
    srv = Server(tmp_path / "d", "--segment-size", str(64 << 20),
                 "--retention-bytes", str(256 << 20)).start()
    stop = threading.Event()
    errors: list[str] = []
    threads = [threading.Thread(target=worker, args=(srv.port, n, stop, errors), daemon=True)
               for n in range(8)]
    samples = []
    try:
        for t in threads:
            t.start()
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            time.sleep(1.0)
            rss, fds = proc_stats(srv.proc.pid)
            samples.append((round(time.monotonic() - t0, 1), rss, fds))
        stop.set()
        for t in threads:
            t.join(20)
    finally:
        code = srv.stop()
    assert code == 0, srv.logs()[-3000:]
    logs = srv.logs()
    at = logs.find("Traceback")
    assert at < 0, logs[max(0, at - 500) : at + 4000]
    assert len(errors) < max(5, seconds / 10), errors[:5]  # connection errors are rare
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"seconds": seconds, "samples": samples}) + "\n")
    print(f"soak {seconds}s: RSS kB first {samples[0][1]} max {max(s[1] for s in samples)} "
          f"last {samples[-1][1]}; fds first {samples[0][2]} last {samples[-1][2]}")
    return samples


def slope(points: list[tuple[float, int]]) -> float:
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    den = sum((x - mx) ** 2 for x, _ in points) or 1.0
    return sum((x - mx) * (y - my) for x, y in points) / den


def test_short_soak(tmp_path: Path) -> None:
    samples = run_soak(tmp_path, float(os.environ.get("LIGHTGATE_SHORT_SOAK_SECONDS", "20")),
                       tmp_path / "soak_samples.json")
    assert max(s[1] for s in samples) < 400_000  # kB: bounded, far from the machine's limit
    assert samples[-1][2] <= samples[0][2] + 40  # fds: only the live connections


LONG_SOAK_SECONDS = float(os.environ.get("LIGHTGATE_SOAK_SECONDS", "1800"))


@pytest.mark.slow
@pytest.mark.timeout(int(LONG_SOAK_SECONDS) + 600)
def test_long_soak_has_no_growth_trend(tmp_path: Path) -> None:
    seconds = LONG_SOAK_SECONDS
    samples = run_soak(tmp_path, seconds, RESULTS / "soak_long.json")
    half = [(t, rss) for t, rss, _ in samples[len(samples) // 2 :]]
    kb_per_hour = slope(half) * 3600
    print(f"RSS trend over the second half: {kb_per_hour:.0f} kB/hour")
    assert kb_per_hour < 20_000  # < 20 MB/hour: no leak worth the name
    fd_half = [(t, fds) for t, _, fds in samples[len(samples) // 2 :]]
    assert abs(slope(fd_half)) * 3600 < 50
