"""The peer brokers, installed on first use (CI machines start empty): Debian's mosquitto
and rabbitmq-server (apt-get), and rumqttd built from its crate into bench/.peers (git
ignores it). `make bench` runs `python -m bench.mqtt.installs rabbitmq rumqttd` first, so
that a long build is not counted in a scenario's row."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from . import ROOT, progress

MOSQUITTO = Path("/usr/sbin/mosquitto")
RABBITMQ_SERVER = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
EPMD = Path("/usr/bin/epmd")
# The config our rumqttd gets (brokers.py) follows this version's format (its lib.rs).
RUMQTTD_VERSION = "0.20.0"
RUMQTTD = ROOT / "bench" / ".peers" / "bin" / "rumqttd"


def _apt_install(package: str, binary: Path) -> None:
    if binary.exists():
        return
    progress(f"installing Debian's {package} (apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    res = subprocess.run(f"apt-get update -qq && apt-get install -y -qq {package}", shell=True,
                         env=env, capture_output=True, text=True, timeout=900)
    if res.returncode != 0 or not binary.exists():
        raise RuntimeError(f"could not install {package}: {res.stderr[-500:]}")


def ensure_mosquitto() -> None:
    # Debian's package starts a system broker on 1883; ours get their own ports and config.
    _apt_install("mosquitto", MOSQUITTO)


def ensure_rabbitmq() -> None:
    # Debian's package may start a system node (where a service manager lets it); ours
    # run apart from it: their own epmd, node name, ports, cookie and directories.
    _apt_install("rabbitmq-server", RABBITMQ_SERVER)


def ensure_rumqttd() -> None:
    """Build the broker from its crate: the pinned version without TLS and WebSocket
    (plain TCP is all the benchmark speaks), a few minutes on 2 cores. Not --locked: the
    crate's Cargo.lock holds metrics 0.22.1, which current compilers reject (E0521);
    the newest compatible dependencies build."""
    if RUMQTTD.exists():
        return
    cargo = shutil.which("cargo") or str(Path.home() / ".cargo" / "bin" / "cargo")
    if not Path(cargo).exists():
        raise RuntimeError("cargo missing: rumqttd is built from its crate (install Rust)")
    progress(f"building rumqttd {RUMQTTD_VERSION} (cargo install, a few minutes)")
    res = subprocess.run([cargo, "install", "--quiet", "--no-default-features",
                          "rumqttd", "--version", RUMQTTD_VERSION, "--root",
                          str(RUMQTTD.parents[1])], capture_output=True, text=True,
                         timeout=3600)
    if res.returncode != 0 or not RUMQTTD.exists():
        raise RuntimeError(f"could not build rumqttd: {res.stderr[-500:]}")


ENSURE = {"mosquitto": ensure_mosquitto, "rabbitmq": ensure_rabbitmq,
          "rumqttd": ensure_rumqttd}


if __name__ == "__main__":
    for name in sys.argv[1:] or list(ENSURE):
        ENSURE[name]()
