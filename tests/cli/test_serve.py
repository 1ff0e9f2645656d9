"""`lightgate serve` as a user runs it: a subprocess, real ports, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def start_serve(data: Path, *extra: str) -> tuple[subprocess.Popen, dict[str, str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "lightgate", "serve", "--data-dir", str(data),
         "--http", "127.0.0.1:0", "--ws", "off", "--mqtt", "127.0.0.1:0",
         "--native", "127.0.0.1:0", *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    line = proc.stdout.readline()
    assert line.startswith("ready "), (line, proc.stderr.read() if proc.poll() is not None else "")
    addrs = dict(part.split("=", 1) for part in line.split()[1:])
    return proc, addrs


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def test_serve_reports_ready_answers_healthz_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    proc, addrs = start_serve(tmp_path / "data", "--flush", "sync")
    try:
        base = f"http://{addrs['http']}"
        assert get_json(f"{base}/healthz") == {"status": "ok"}
        stats = get_json(f"{base}/api/v1/store/stats")
        assert stats["commitlog"]["flush"] == "sync"
        try:
            urllib.request.urlopen(f"{base}/no/such/page", timeout=5)
        except urllib.error.HTTPError as err:
            assert err.code == 404 and json.loads(err.read()) == {"error": "Not Found"}
        else:
            raise AssertionError("expected a 404")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    # A clean stop leaves no crash marker behind.
    assert not (tmp_path / "data" / "commitlog" / "abort").exists()


def test_settings_come_from_env_and_config_file(tmp_path: Path) -> None:
    conf = tmp_path / "lightgate.toml"
    conf.write_text('flush = "sync"\nsegment_size = 1048576\n')
    env = {**os.environ, "LIGHTGATE_HTTP": "127.0.0.1:0", "LIGHTGATE_MQTT": "127.0.0.1:0",
           "LIGHTGATE_NATIVE": "127.0.0.1:0"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "lightgate", "serve", "--data-dir", str(tmp_path / "d"),
         "--config", str(conf)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        line = proc.stdout.readline()
        addrs = dict(part.split("=", 1) for part in line.split()[1:])
        assert addrs["http"].startswith("127.0.0.1:") and addrs["mqtt"].startswith("127.0.0.1:")
        stats = get_json(f"http://{addrs['http']}/api/v1/store/stats")
        assert stats["commitlog"]["flush"] == "sync"
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0


def test_bad_flag_value_is_a_clear_error(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "lightgate", "serve", "--data-dir", str(tmp_path),
         "--flush", "sometimes"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert res.returncode != 0 and "--flush must be sync or async" in res.stderr


def test_sigterm_right_at_ready_still_stops_cleanly(tmp_path: Path) -> None:
    """The signal handler is in place before `ready` is printed (a SIGTERM in between
    once killed the process with the default handler)."""
    for i in range(3):
        proc, _ = start_serve(tmp_path / f"d{i}")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0


def test_the_first_log_lines_are_words(tmp_path: Path) -> None:
    """What a newcomer reads first: the recovery said in words, not a dataclass's repr."""
    proc, _ = start_serve(tmp_path / "data")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0
    assert proc.stderr is not None
    err = proc.stderr.read()
    [recovered] = [ln for ln in err.splitlines() if "commitlog recovered" in ln]
    assert "Report(" not in err and "=" not in recovered.split(": ", 1)[1], recovered
    assert "commitlog recovered after a clean shutdown: 0 records verified from offset 0, " \
           "log end 0; in " in recovered, recovered
