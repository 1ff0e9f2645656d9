"""The peer brokers, installed on first use (CI machines start empty): Debian's mosquitto
and rabbitmq-server (apt-get), and rumqttd built from its crate into bench/.peers (git
ignores it). `make bench` runs `python -m bench.mqtt.installs mosquitto rabbitmq rumqttd
rumqttd-mtls` first, so that a long build is not counted in a scenario's row."""

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
PEERS = ROOT / "bench" / ".peers"
# Two builds of it, both with rustls for its TLS listeners: rumqttd 0.20 decides at compile
# time whether every TLS listener asks for client certificates (feature verify-client-cert),
# so the mutual-TLS rows get a build of their own. They share one target directory: the
# second build recompiles only rumqttd itself.
RUMQTTD = PEERS / "rumqttd" / "bin" / "rumqttd"
RUMQTTD_MTLS = PEERS / "rumqttd-mtls" / "bin" / "rumqttd"
RUMQTTD_FEATURES = {RUMQTTD: "use-rustls", RUMQTTD_MTLS: "use-rustls,verify-client-cert"}


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


def ensure_rumqttd(binary: Path = RUMQTTD) -> None:
    """Build the broker from its crate: the pinned version with rustls and without
    WebSocket, a few minutes on 2 cores (the mutual-TLS build, RUMQTTD_MTLS, a minute
    more). Not --locked: the crate's Cargo.lock holds metrics 0.22.1, which current
    compilers reject (E0521); the newest compatible dependencies build."""
    if binary.exists():
        return
    cargo = shutil.which("cargo") or str(Path.home() / ".cargo" / "bin" / "cargo")
    if not Path(cargo).exists():
        raise RuntimeError("cargo missing: rumqttd is built from its crate (install Rust)")
    features = RUMQTTD_FEATURES[binary]
    progress(f"building rumqttd {RUMQTTD_VERSION} with {features} (cargo install, a few "
             "minutes)")
    res = subprocess.run([cargo, "install", "--quiet", "--no-default-features", "--features",
                          features, "rumqttd", "--version", RUMQTTD_VERSION, "--root",
                          str(binary.parents[1]), "--target-dir", str(PEERS / "target")],
                         capture_output=True, text=True, timeout=3600)
    if res.returncode != 0 or not binary.exists():
        raise RuntimeError(f"could not build rumqttd: {res.stderr[-500:]}")


def ensure_rumqttd_mtls() -> None:
    ensure_rumqttd(RUMQTTD_MTLS)


ENSURE = {"mosquitto": ensure_mosquitto, "rabbitmq": ensure_rabbitmq,
          "rumqttd": ensure_rumqttd, "rumqttd-mtls": ensure_rumqttd_mtls}


if __name__ == "__main__":
    for name in sys.argv[1:] or list(ENSURE):
        ENSURE[name]()
