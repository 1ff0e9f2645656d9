"""The dashboard's history view in real headless Chromium: a filter's stored messages
page by page, a chart of a JSON field, errors shown, no JavaScript error. Its picture for
docs/replay.md goes to docs/history.png with LIGHTGATE_UPDATE_SCREENSHOT=1 (else to tmp)."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from tests.mqtt.paho_client import Client
from tests.ops.browser import browser_page, needs_chromium
from tests.ops.test_dashboard_screenshot import ROOT, png_size

pytestmark = needs_chromium
WIDTH, HEIGHT = 1280, 1400


def publish_boilers(port: int, n: int) -> None:
    """Three boilers' temperatures as JSON, a wave each, and one binary payload."""
    dev = Client(port, "boilers")
    for i in range(n):
        b = i % 3
        temp = round(70 + 8 * math.sin(i / 9 + b) + 3 * b, 1)
        dev.publish(f"plant/{b + 1}/temp", json.dumps({"temp": temp, "seq": i}).encode(), 1)
        time.sleep(0.01)  # store times apart, as readings are: the chart's x axis
    dev.publish("plant/1/raw", b"\x00\xff", 0)
    dev.disconnect()


def test_history_view_pages_and_charts(server, tmp_path: Path) -> None:
    publish_boilers(server.port, 130)
    update = os.environ.get("LIGHTGATE_UPDATE_SCREENSHOT") == "1"
    out = ROOT / "docs" / "history.png" if update else tmp_path / "history.png"
    with browser_page(WIDTH, HEIGHT) as page:
        page.goto(f"http://{server.addrs['http']}/")
        page.fill("#history-filter", "plant/+/temp")
        page.select_option("#history-since", "earliest")
        page.fill("#history-field", "temp")
        page.click("#history-form button[type=submit]")
        page.wait_for_function("window.lgHistory.page === 1 && window.lgHistory.rows.length",
                               timeout=10_000)
        state = page.evaluate("window.lgHistory")
        assert len(state["rows"]) == 100 and state["points"] == 100 and state["cursor"]
        assert page.locator("#history tbody tr").count() == 100
        assert page.is_visible("#history-chart-box")
        assert "more on the next page" in page.text_content("#history-status")
        first = page.locator("#history tbody tr").first.text_content()
        assert "plant/1/temp" in first and '"seq": 0' in first
        page.locator("#history-section").screenshot(path=str(out))

        page.click("#history-next")
        page.wait_for_function("window.lgHistory.page === 2", timeout=10_000)
        assert page.locator("#history tbody tr").count() == 30
        assert "the end" in page.text_content("#history-status")
        assert page.is_disabled("#history-next") and not page.is_disabled("#history-first")
        page.click("#history-first")
        page.wait_for_function("window.lgHistory.page === 1", timeout=10_000)

        # Payloads that are no numbers leave the chart out; a mistake is shown, not thrown.
        page.fill("#history-filter", "plant/1/raw")
        page.fill("#history-field", "")
        page.click("#history-form button[type=submit]")
        page.wait_for_function("window.lgHistory.rows.length === 1", timeout=10_000)
        assert page.is_hidden("#history-chart-box")
        assert "binary" in page.locator("#history tbody tr").first.text_content()
        page.fill("#history-filter", "plant/#/x")
        page.click("#history-form button[type=submit]")
        page.wait_for_function(
            "document.getElementById('history-error').textContent.includes('#')",
            timeout=10_000)
    width, height = png_size(out.read_bytes())
    assert width > 1000 and height > 300 and out.stat().st_size > 20_000
