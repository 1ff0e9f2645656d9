"""SIGHUP on real processes (serve, store, gateway): the config file read again, its
live settings taking effect at once and the others said to wait for a restart; users
and policies read again; one log line per thing that changed; a bad file changes
nothing and stops nothing. (TLS certificates: tests/security/test_tls.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.conftest import ROOT, Server
from tests.mqtt.paho_client import Client
from tests.mqtt.raw import RawClient

ADMIN = "admin:admin-pw"


def hup(srv: Server) -> None:
    assert srv.proc is not None
    os.kill(srv.proc.pid, signal.SIGHUP)


def refused(srv: Server, client_id: str) -> bool:
    """Whether an MQTT 5 CONNECT gets 0x97, Quota exceeded (raw: paho may see the close
    before it reports the CONNACK)."""
    raw = RawClient(srv.port, version=5)
    try:
        return raw.connect(client_id).reason_code == 0x97
    finally:
        raw.close()


def test_serve_takes_a_live_setting_and_says_which_wait_for_a_restart(tmp_path: Path) -> None:
    conf = tmp_path / "lightgate.toml"
    conf.write_text("max_connections = 0\nmax_inflight = 32\n")
    srv = Server(tmp_path / "data", "--config", str(conf)).start()
    said = f"SIGHUP: the configuration file {conf}"
    try:
        first = Client(srv.port, "first", version=5)
        conf.write_text("max_connections = 1\nmax_inflight = 64\n")
        hup(srv)
        assert srv.wait_log(f"{said}: --max-connections is now 1 (was 0)")
        assert srv.wait_log(f"{said}: --max-inflight is 64 in the file, 32 in effect: it "
                            "takes effect at the next start")
        assert refused(srv, "second")  # one is the limit now
        # A file that does not read: one line, the settings in effect stay, it serves on.
        conf.write_text('max_connections = "many"\n')
        hup(srv)
        assert srv.wait_log(f"{said} not re-read, those in effect are kept: --config {conf}:"
                            " max_connections = 'many' is not an integer")
        with urllib.request.urlopen(f"http://{srv.addrs['http']}/healthz", timeout=5) as r:
            assert r.status == 200
        assert refused(srv, "third"), "the limit in effect stays"
        first.disconnect()
        assert srv.logs().count(f"{said}:") == 2  # one line per change, no more
    finally:
        assert srv.stop() == 0, srv.logs()[-3000:]


def test_store_rereads_its_file_and_its_users(tmp_path: Path) -> None:
    conf = tmp_path / "store.toml"
    conf.write_text("retention_hours = 72\n")
    srv = Server(tmp_path / "data", "--config", str(conf), "--auth", "--init-user", ADMIN,
                 command="store").start()
    try:
        conf.write_text("retention_hours = 1.5\n")
        hup(srv)
        assert srv.wait_log(f"SIGHUP: the configuration file {conf}: --retention-hours is "
                            "now 1.5 (was 72.0)")
        assert srv.wait_log("SIGHUP: users and policies unchanged")  # the store keeps them
    finally:
        assert srv.stop() == 0, srv.logs()[-3000:]


def lightgate(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "lightgate", *args], cwd=ROOT, check=True,
                   capture_output=True, timeout=60)


def test_gateway_rereads_users_and_policies_from_its_store(tmp_path: Path) -> None:
    """A gateway keeps a copy of the store's users and policies, refreshed every few
    seconds; SIGHUP reads them at once and names each change."""
    conf = tmp_path / "gateway.toml"
    conf.write_text("max_subscriptions = 1000\n")
    store = Server(tmp_path / "store", "--auth", "--init-user", ADMIN, command="store").start()
    gw = Server(None, "--store", store.native, "--store-auth", ADMIN, "--config", str(conf),
                command="gateway")
    try:
        gw.start()
        conf.write_text("max_subscriptions = 10\n")
        admin = ["--server", store.native, "--as", ADMIN]
        for attempt in range(3):  # the periodic refresh may read it first: again, anew
            name = f"bob{attempt}"
            lightgate("user", "add", name, "--password", "pw", *admin)
            lightgate("acl", "add", name, "--resource", "Topic:plant/#", "--actions",
                      "PUB,SUB", *admin)
            mark = len(gw.logs())
            hup(gw)
            deadline = time.monotonic() + 10
            while "SIGHUP: users and policies" not in gw.logs()[mark:]:
                assert time.monotonic() < deadline, gw.logs()[-3000:]
                time.sleep(0.05)
            time.sleep(0.2)  # the step's other lines
            said = gw.logs()[mark:]
            if "users and policies unchanged" not in said:
                break
        assert f"SIGHUP: users and policies: user '{name}' added" in said, said
        assert gw.wait_log(f"SIGHUP: the configuration file {conf}: --max-subscriptions is "
                           "now 10 (was 1000)")
        assert f"SIGHUP: users and policies: policy added: allow '{name}' PUB,SUB on " \
               "Topic:plant/#" in said, said
        client = Client(gw.port, "dev", version=5, username=name, password="pw")
        assert client.connack[1].value == 0
        client.disconnect()
    finally:
        for srv in (gw, store):
            if srv.proc is not None:
                assert srv.stop() == 0, srv.logs()[-3000:]
