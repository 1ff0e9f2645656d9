"""The README's picture of the dashboard, taken in real headless Chromium while a few
simulated devices publish. It goes to docs/dashboard.png only with
LIGHTGATE_UPDATE_SCREENSHOT=1 (so test runs leave the tree alone); otherwise to tmp,
and the test checks that a real, non-empty PNG came out of the browser."""

from __future__ import annotations

import os
import struct
import threading
import time
from pathlib import Path

from tests.mqtt.paho_client import Client
from tests.ops.browser import browser_page, needs_chromium

ROOT = Path(__file__).resolve().parents[2]
WIDTH, HEIGHT = 1280, 1100
pytestmark = needs_chromium


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", data[:16]
    return struct.unpack(">II", data[16:24])


def test_dashboard_screenshot(server, tmp_path: Path) -> None:
    update = os.environ.get("LIGHTGATE_UPDATE_SCREENSHOT") == "1"
    out = ROOT / "docs" / "dashboard.png" if update else tmp_path / "dashboard.png"
    stop = threading.Event()
    devices = [Client(server.port, f"boiler-{i}", clean=False) for i in range(4)]
    app = Client(server.port, "control-room", clean=False)
    app.subscribe("plant/+/temp", qos=1)
    devices[0].publish("plant/1/state", b"running", 1, retain=True)
    devices[1].publish("plant/2/state", b"maintenance", 1, retain=True)

    def simulate() -> None:
        i = 0
        while not stop.is_set():
            dev = i % len(devices)
            devices[dev].publish(f"plant/{dev}/temp", b"%d" % (60 + (i * 7) % 30), i % 2)
            if i % 150 == 0:
                devices[dev].publish(f"alerts/boiler-{dev}",
                                     b'{"rule":"overheat","value":%d}' % (80 + (i // 150) % 9), 1)
            i += 1
            time.sleep(0.004 + 0.004 * ((i // 200) % 3))  # a rate that moves on the chart

    sim = threading.Thread(target=simulate, daemon=True)
    sim.start()
    with browser_page(WIDTH, HEIGHT) as page:
        try:
            page.goto(f"http://{server.addrs['http']}/")
            page.wait_for_function("document.getElementById('connections').textContent == '5'",
                                   timeout=10_000)
            page.wait_for_function(
                "document.getElementById('alerts').textContent.includes('overheat')",
                timeout=15_000)
            page.wait_for_selector("tr[data-topic='plant/2/state']", timeout=10_000)
            page.wait_for_function("window.lgState.rin.filter(v => v > 0).length >= 15",
                                   timeout=30_000)
            page.screenshot(path=str(out))
        finally:
            stop.set()
    sim.join(5)
    for client in (*devices, app):
        client.disconnect()
    data = out.read_bytes()
    assert png_size(data) == (WIDTH, HEIGHT)
    assert len(data) > 20_000  # cards, charts and tables, not a blank page
