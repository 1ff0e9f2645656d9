"""`lightgate serve --help` (and store, gateway) lists the settings by concern, one
section each (listeners, security, limits, store, cluster, logging and observability),
from the same tables the configuration page and the example file are made from."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from lightgate import settings
from tests.conftest import ROOT

TABLES = {"serve": settings.SERVE_SETTINGS, "store": settings.STORE_CMD_SETTINGS,
          "gateway": settings.GATEWAY_CMD_SETTINGS}


def sections(text: str) -> dict[str, list[str]]:
    """Section title -> the flags listed under it, in the order of the help text."""
    out: dict[str, list[str]] = {}
    current = ""
    for line in text.splitlines():
        if re.fullmatch(r"[a-z][a-z ]*:", line):
            current = line[:-1]
            out[current] = []
        elif current and (m := re.match(r"  (--[a-z0-9-]+)", line)):
            out[current].append(m[1][2:])
    return out


@pytest.mark.parametrize("command", list(TABLES))
def test_help_lists_each_setting_under_its_concern(command: str) -> None:
    res = subprocess.run([sys.executable, "-m", "lightgate", command, "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True)
    usage = res.stdout.split("\n\n", 1)[0]
    assert len(usage.splitlines()) == 1, usage  # not every flag again in the usage
    got = sections(res.stdout)
    titles = [settings.GROUP_TITLES[g][0] for g in settings.GROUP_TITLES]
    listed = [t for t in got if t in titles]
    assert listed == [t for t in titles if got.get(t)], "sections out of order"
    for flag, *_ in TABLES[command]:
        title = settings.GROUP_TITLES[settings.GROUPS[flag]][0]
        assert flag in got[title], f"--{flag} not under {title!r}"
    logging_section = got["logging and observability"]
    assert "log-level" in logging_section and "log-format" in logging_section
    # A setting a running server takes anew on SIGHUP says so.
    if command != "store":
        assert re.search(r"--max-connections.*?re-read on SIGHUP\)", res.stdout, re.S)


def test_every_setting_has_a_known_concern() -> None:
    for key, row in settings.all_settings().items():
        assert settings.GROUPS.get(row[0]) in settings.GROUP_TITLES, key
    flags = {row[0] for row in settings.all_settings().values()}
    assert not settings.LIVE - flags
