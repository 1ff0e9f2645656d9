"""The dashboard in real headless Chromium (Debian's, driven by Playwright): live numbers
and charts move while a simulator publishes, and Kick disconnects a client."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from tests.mqtt.paho_client import Client
from tests.ops.browser import browser_page, needs_chromium

pytestmark = needs_chromium


def test_dashboard_is_live_and_kicks_clients(server, tmp_path: Path) -> None:
    stop = threading.Event()
    devices = [Client(server.port, f"sim-{i}") for i in range(3)]
    victim = Client(server.port, "kick-me")

    def simulate() -> None:
        i = 0
        while not stop.is_set():
            devices[i % 3].publish(f"sim/{i % 3}/temp", b"%d" % (20 + i % 10), 0)
            if i % 40 == 0:
                devices[0].publish("alerts/sim-0", b'{"rule":"overheat","value":91}', 1)
            i += 1
            time.sleep(0.005)

    sim = threading.Thread(target=simulate, daemon=True)
    with browser_page() as page:
        try:
            devices[1].publish("sim/state", b"on", 1, retain=True)
            page.goto(f"http://{server.addrs['http']}/")
            page.wait_for_function("document.getElementById('connections').textContent == '4'",
                                   timeout=10_000)
            late = Client(server.port, "late-joiner")
            page.wait_for_function("document.getElementById('connections').textContent == '5'",
                                   timeout=10_000)
            sim.start()
            page.wait_for_function("window.lgState.rin.some(v => v > 20)", timeout=15_000)
            page.wait_for_function(
                "document.getElementById('alerts').textContent.includes('overheat')",
                timeout=15_000)
            state = page.evaluate("window.lgState")
            assert max(state["rin"]) > 20  # the chart's series moved with the simulator
            assert {4, 5} <= set(state["conns"]) and state["bytes"][-1] > state["bytes"][0]
            page.wait_for_selector("#topics td:text-is('sim')", timeout=10_000)
            row = page.locator("tr[data-client='kick-me']")
            row.wait_for(timeout=10_000)
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            row.locator("button.kick").click()
            assert victim.disconnected.wait(10), "kick did not disconnect the client"
            page.wait_for_selector("tr[data-client='kick-me']", state="detached",
                                   timeout=10_000)
            late.disconnect()
            page.locator("tr[data-topic='sim/state'] button.del-retained").click()
            page.wait_for_selector("tr[data-topic='sim/state']", state="detached",
                                   timeout=10_000)
        finally:
            stop.set()
    sim.join(5)
    for d in devices:
        d.disconnect()
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
