"""Lightgate off Linux, as far as a Linux machine can show it. macOS's Python has no
`select.epoll` and no `os.fdatasync`, and macOS no /proc; Windows' Python has no `fcntl`
or `resource` either. Each is taken away from a real `lightgate` process here (trio and
`selectors` keep the epoll they bound first, as on macOS they bind kqueue; /proc is
covered by an empty tmpfs in a mount namespace of the server's own), and the process
must still do its job on the Python plane."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import Server
from tests.mqtt.paho_client import Client

ROOT = Path(__file__).resolve().parents[2]

MACOS = '''\
import os, select, selectors, sys, types
import trio  # noqa: F401 - binds its epoll first (on macOS: kqueue)


class _Select(types.ModuleType):
    def __getattr__(self, name):
        if name.lower().startswith("epoll"):
            raise AttributeError(f"module 'select' has no attribute {name!r}")
        return getattr(select, name)


sys.modules["select"] = _Select("select")  # what is imported from now on
del os.fdatasync
'''

WINDOWS = '''\
import sys
sys.modules["fcntl"] = None  # an import of either fails, as on Windows
sys.modules["resource"] = None
'''

# A mount namespace of the server's own, its /proc an empty tmpfs: no /proc/self/fd.
NO_PROC = ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs none /proc && exec "$@"', "sh"]


def _site(tmp_path: Path, source: str) -> str:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(source)
    return str(site)


def test_help_and_config_without_fcntl_or_resource(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": _site(tmp_path, WINDOWS)}
    for args in (["--help"], ["serve", "--help"], ["store", "--help"],
                 ["gateway", "--help"], ["config", "--example"]):
        res = subprocess.run([sys.executable, "-m", "lightgate", *args], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, (args, res.stderr)
        assert "Traceback" not in res.stderr


def _no_proc_namespace() -> bool:
    if shutil.which("unshare") is None:
        return False
    res = subprocess.run([*NO_PROC, "test", "!", "-e", "/proc/self"], capture_output=True,
                         timeout=30)
    return res.returncode == 0


def test_serve_without_epoll_fdatasync_or_proc(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    if not _no_proc_namespace():
        pytest.skip("no mount namespace to hide /proc in (needs unshare and root)")
    monkeypatch.setenv("PYTHONPATH", _site(tmp_path, MACOS))
    monkeypatch.setenv("LIGHTGATE_NATIVE", "0")
    server = Server(tmp_path / "d", "--flush", "sync", prefix=NO_PROC).start()
    try:
        assert server.addrs["plane"] == "python"
        sub = Client(server.port, "mac-sub")
        sub.subscribe("mac/+/t", 1)
        pub = Client(server.port, "mac-pub")
        for i in range(20):  # each one fdatasync'ed (--flush sync) before its PUBACK
            pub.publish(f"mac/{i % 3}/t", b"m%d" % i, qos=1)
        got = sorted(m.payload for m in sub.expect(20))
        assert got == sorted(b"m%d" % i for i in range(20))
        base = f"http://{server.addrs['http']}"
        with urllib.request.urlopen(f"{base}/api/v1/runtime", timeout=10) as resp:
            runtime = json.loads(resp.read())
        assert runtime["connections"] == 2 and runtime["open_fds"] is None  # not listed
        with urllib.request.urlopen(f"{base}/metrics", timeout=10) as resp:
            assert b"lightgate_messages_received_total" in resp.read()
        pub.disconnect()
        sub.disconnect()
    finally:
        assert server.stop() == 0, "".join(server.log)
    assert not any("Traceback" in line for line in server.log), "".join(server.log)
