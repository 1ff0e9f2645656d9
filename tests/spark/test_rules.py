"""Rules file and offset arithmetic: no Spark needed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from spark_streaming.jobs.rules import load_rules, parse_rules

RULES = """
source_topic = "devices"
device_from = "topic:1"
[[rule]]
name = "overheat"
field = "temperature"
op = ">"
threshold = 80
[[rule]]
name = "warm"
field = "temperature"
op = ">="
threshold = 60
window = "10 seconds"
[[rule]]
name = "jump"
field = "temperature"
op = "rate>"
threshold = 5
"""


def test_rules_file(tmp_path: Path) -> None:
    path = tmp_path / "rules.toml"
    path.write_text(RULES)
    rules = load_rules(path)
    assert rules.source_topic == "devices" and rules.device_from == "topic:1"
    assert [r.name for r in rules.rules] == ["overheat", "warm", "jump"]
    assert rules.rules[1].window == "10 seconds" and rules.rules[2].is_rate
    assert rules.rules[2].compare == ">"


@pytest.mark.parametrize(("data", "error"), [
    ({"rule": []}, "at least one"),
    ({"rule": [{"name": "a", "field": "t", "op": "~", "threshold": 1}]}, "op must be"),
    ({"rule": [{"name": "a", "field": "t", "op": ">"}]}, "threshold"),
    ({"device_from": "topic:x", "rule": [{"name": "a", "field": "t", "op": ">",
                                          "threshold": 1}]}, "device_from"),
    ({"source_topic": "a/b", "rule": [{"name": "a", "field": "t", "op": ">",
                                       "threshold": 1}]}, "first-level"),
    ({"rule": [{"name": "a", "field": "t", "op": "rate>", "threshold": 1,
                "window": "5 seconds"}]}, "no window"),
])
def test_bad_rules(data: dict, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_rules(data)


def test_help_without_pyspark() -> None:
    """`lightgate --help` and the analytics/simulate help must not need pyspark."""
    code = ("import sys; sys.modules['pyspark'] = None\n"
            "from lightgate.cli import build_parser\n"
            "p = build_parser()\n"
            "for argv in (['--help'], ['analytics', 'run', '--help'], ['simulate', '--help']):\n"
            "    try:\n"
            "        p.parse_args(argv)\n"
            "    except SystemExit as e:\n"
            "        assert e.code == 0, argv\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "analytics" in out.stdout and "--topic-prefix" in out.stdout


def test_alerts_needs_rules(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[[rule]]\nname = 'x'\n")
    out = subprocess.run([sys.executable, "-m", "lightgate", "analytics", "run", "alerts",
                          "--rules", str(bad)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "bad rules file" in out.stderr
