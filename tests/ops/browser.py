"""A page in real headless Chromium (Debian's, driven by Playwright), for the dashboard
tests: skipped where either is missing, JavaScript errors collected and asserted none."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
needs_chromium = pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                    reason="Debian's chromium is not installed (make test does)")


@contextmanager
def browser_page(width: int = 1280, height: int = 1000) -> Iterator[Any]:
    """A fresh page; on a clean exit, no uncaught JavaScript error may have happened."""
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="playwright (the test extra) is not installed")
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (make test does)")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            yield page
            assert errors == [], errors
        finally:
            browser.close()
