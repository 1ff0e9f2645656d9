"""`lightgate config --example` and the README's copy of it list every setting of the
server commands, and nothing else: a key added to cli.py without the README fails here."""

from __future__ import annotations

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


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("### The config file, every key", 1)[1].split("\n### ", 1)[0]
    return section.split("```toml\n", 1)[1].split("```", 1)[0]


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


def test_readme_lists_every_key() -> None:
    in_readme = KEY_LINE.findall(readme_example())
    known = list(cli.all_settings())
    missing = [k for k in known if k not in in_readme]
    stale = [k for k in in_readme if k not in known]
    assert not missing and not stale, (
        f"README's config file is out of step with lightgate/cli.py (missing {missing}, "
        f"stale {stale}): paste the output of `lightgate config --example` into the "
        "README's 'The config file, every key'")
