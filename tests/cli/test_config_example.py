"""`lightgate config --example` and the docs' configuration page list every setting of the
server commands, and nothing else. The page's tables and example file are made from the
settings tables when the site is built (tools/docs_config.py); this checks what it makes."""

from __future__ import annotations

import importlib.util
import re
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

from lightgate import cli
from tests.cli.test_serve import get_json, start_serve

ROOT = Path(__file__).resolve().parents[2]
KEY_LINE = re.compile(r"^(?:# )?([a-z][a-z0-9_]*) =", re.M)


def example() -> str:
    return subprocess.run([sys.executable, "-m", "lightgate", "config", "--example"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=True).stdout


def docs_page() -> str:
    """docs/configuration.md as the site renders it (mkdocs.yml's hook)."""
    spec = importlib.util.spec_from_file_location("docs_config", ROOT / "tools" / "docs_config.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.render((ROOT / "docs" / "configuration.md").read_text())


def test_the_example_has_every_key_and_serve_accepts_it(tmp_path: Path) -> None:
    text = example()
    assert sorted(KEY_LINE.findall(text)) == sorted(cli.all_settings())  # each once
    parsed = tomllib.loads(text)  # the keys without a default are commented out
    assert {k for k, s in cli.all_settings().items() if s[2] is not None} == set(parsed)
    assert parsed["flush"] == "async" and parsed["recent_cache_mb"] == 32
    conf = tmp_path / "lightgate.toml"
    conf.write_text(text.replace('flush = "async"', 'flush = "sync"'))
    proc, addrs = start_serve(tmp_path / "d", "--config", str(conf))
    try:
        stats = get_json(f"http://{addrs['http']}/api/v1/store/stats")
        assert stats["commitlog"]["flush"] == "sync"  # the file was read, not just parsed
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0


def test_the_docs_list_every_key() -> None:
    page = docs_page()
    example_file = page.split("```toml\n", 1)[1].split("```", 1)[0]
    assert example_file.strip() == example().strip()
    tables = page.split("## Every setting", 1)[1].split("## The example file", 1)[0]
    in_tables = re.findall(r"^\| `--([a-z0-9-]+)`", tables, re.M)
    known = [s[0] for s in cli.all_settings().values()]
    assert sorted(in_tables) == sorted(known), (
        "docs/configuration.md's generated tables are out of step with lightgate/settings.py")
