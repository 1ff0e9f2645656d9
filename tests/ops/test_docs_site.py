"""The documentation site as a reader sees it: built with mkdocs, opened in real headless
Chromium at a laptop's width. The home page's set-up commands show whole, with no
line cut off at the page's width."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.conftest import ROOT
from tests.ops.browser import browser_page, needs_chromium


@needs_chromium
def test_the_home_pages_code_blocks_fit_the_page(tmp_path: Path) -> None:
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                    str(site)], cwd=ROOT, check=True, capture_output=True, timeout=300,
                   env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    handler = partial(SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *args: None  # type: ignore[attr-defined]
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with browser_page(width=1280, height=900) as page:
            page.goto(f"http://127.0.0.1:{httpd.server_address[1]}/")
            blocks = page.eval_on_selector_all(
                "article pre > code",
                "els => els.map(e => [e.scrollWidth, e.clientWidth, "
                "e.innerText.split('\\n')[0]])")
    finally:
        httpd.shutdown()
    assert blocks, "no code block on the home page"
    cut = [(first, scroll, client) for scroll, client, first in blocks if scroll > client]
    assert not cut, f"code cut off at the page's width (scroll, visible): {cut}"
