"""`lightgate user …` and `lightgate acl …` against a server with auth on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT
from tests.mqtt.paho_client import Client
from tests.security.helpers import ADMIN, auth_server


def lightgate(*args: str, auth: str | None = ":".join(ADMIN)) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "LIGHTGATE_AUTH"}
    if auth:
        env["LIGHTGATE_AUTH"] = auth
    return subprocess.run([sys.executable, "-m", "lightgate", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def test_user_and_acl_commands(tmp_path) -> None:
    s = auth_server(tmp_path)
    server = ("--server", s.native)
    try:
        r = lightgate("user", "add", "sensor", "--password", "s-pw", *server)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["name"] == "sensor"
        r = lightgate("acl", "add", "sensor", "--resource", "Topic:plant/+/temp", "--actions",
                      "PUB", "--ip", "127.0.0.0/8", *server)
        assert r.returncode == 0, r.stderr
        listed = [json.loads(x) for x in lightgate("acl", "list", "sensor", *server
                                                   ).stdout.splitlines()]
        assert listed == [{"user": "sensor", "resource": "Topic:plant/+/temp",
                           "match": "literal", "actions": ["PUB"], "ip": "127.0.0.0/8",
                           "decision": "allow"}]
        c = Client(s.port, "sensor-1", version=5, username="sensor", password="s-pw")
        assert c.pub_codes[c.publish("plant/1/temp", b"20", qos=1)] == 0
        assert c.pub_codes[c.publish("plant/1/hum", b"20", qos=1)] == 0x87
        c.disconnect()
        users = [json.loads(x)["name"] for x in lightgate("user", "list", *server
                                                           ).stdout.splitlines()]
        assert sorted(users) == ["admin", "sensor"]
        # wrong or missing credentials: a clear message, exit code != 0
        r = lightgate("user", "list", *server, auth="admin:nope")
        assert r.returncode != 0 and "authentication failed" in r.stderr
        r = lightgate("user", "add", "x", "--password", "p", *server, auth="sensor:s-pw")
        assert r.returncode != 0 and "Super" in r.stderr
        assert lightgate("user", "disable", "sensor", *server).returncode == 0
        assert lightgate("acl", "del", "sensor", *server).stdout.strip() == '{"deleted": 1}'
        assert lightgate("user", "del", "sensor", *server).returncode == 0
        r = lightgate("user", "del", "sensor", *server)
        assert r.returncode != 0 and "no user" in r.stderr
    finally:
        assert s.stop() == 0


def test_auth_without_any_user_refuses_to_start(tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "lightgate", "serve", "--data-dir",
                        str(tmp_path / "d"), "--auth", "--mqtt", "127.0.0.1:0", "--ws", "off",
                        "--native", "127.0.0.1:0", "--http", "127.0.0.1:0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "--init-user" in r.stderr
