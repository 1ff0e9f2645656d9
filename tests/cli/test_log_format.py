"""`--log-format json`: every line a real server writes to stderr is one JSON object (ts,
level, logger, message, and exc_info with a traceback), on every command."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import paho.mqtt.client as mqtt

from tests.conftest import ROOT, Server


def parsed(text: str) -> list[dict]:
    """Each line of `text` as JSON: a line that is not one object fails the test."""
    rows = []
    for line in text.splitlines():
        row = json.loads(line)
        assert isinstance(row, dict), line
        assert {"ts", "level", "logger", "message"} <= row.keys(), line
        datetime.fromisoformat(row["ts"])
        rows.append(row)
    return rows


def test_every_line_of_a_serve_run_is_json(tmp_path: Path) -> None:
    srv = Server(tmp_path / "data", "--log-format", "json").start()
    try:
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="json-logs")
        client.connect("127.0.0.1", srv.port)
        client.loop_start()
        client.publish("a/b", b"x", qos=1).wait_for_publish(5)
        client.disconnect()
        client.loop_stop()
        with socket.create_connection(("127.0.0.1", srv.port)) as raw:
            raw.sendall(b"\x10\x02\x00\x00")  # a CONNECT cut short: a refusal is logged
            raw.recv(16)
        # A client command's summary line is an object too.
        res = subprocess.run(
            [sys.executable, "-m", "lightgate", "--log-format", "json", "produce", "t",
             "--server", srv.native], cwd=ROOT, capture_output=True, text=True, timeout=60,
            input="one\ntwo\n")
        assert res.returncode == 0, res.stderr
        assert [r["message"] for r in parsed(res.stderr)] == ["sent 2 messages to t"]
    finally:
        assert srv.stop() == 0
    rows = parsed(srv.logs())
    assert len(rows) > 5
    assert "INFO" in {r["level"] for r in rows}
    assert any(r["logger"] == "lightgate.store.app" for r in rows)
    assert any("shutting down" in r["message"] for r in rows)


def test_a_client_commands_failure_is_json_with_its_traceback() -> None:
    """A client command's one-line failure, with --log-level debug's traceback, is one
    object too (the variable stands for the flag)."""
    env = {**os.environ, "LIGHTGATE_LOG_FORMAT": "json"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens there once closed
    res = subprocess.run(
        [sys.executable, "-m", "lightgate", "clients", "list", "--http", f"127.0.0.1:{port}",
         "--log-level", "debug"], cwd=ROOT, capture_output=True, text=True, timeout=60,
        env=env)
    assert res.returncode == 1, res.stderr
    [row] = [r for r in parsed(res.stderr) if r["level"] == "ERROR"]
    assert row["logger"] == "lightgate" and "cannot reach the admin API" in row["message"]
    assert "Traceback" in row["exc_info"]


def test_an_unknown_log_format_is_refused() -> None:
    res = subprocess.run([sys.executable, "-m", "lightgate", "--log-format", "xml", "config",
                          "--example"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--log-format" in res.stderr and "json" in res.stderr
