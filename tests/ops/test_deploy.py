"""deploy/ cannot run here (no Docker engine, no cluster): check what can be checked.
Every file parses, every `lightgate` flag it uses exists in `lightgate CMD --help`, every
metric the Grafana dashboard queries is one /metrics serves, and ports match
the defaults of the settings (lightgate.settings)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path

import yaml

from tests.ops.dockerfile import dockerfile_instructions

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PORTS = {"mqtt": 1883, "native": 10911, "http": 18083, "ws": 8083, "wss": 8084, "mqtt_tls": 8883}


@cache  # one subprocess per command, not per key
def help_flags(command: str) -> set[str]:
    out = subprocess.run([sys.executable, "-m", "lightgate", command, "--help"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return set(re.findall(r"--[a-z][a-z-]*", out))


def lightgate_invocations() -> list[tuple[str, list[str]]]:
    """(file, argv after `lightgate`) for every command line in deploy/."""
    found = []
    for path in DEPLOY.rglob("*"):
        if path.suffix in (".yml", ".yaml"):
            for doc in yaml.safe_load_all(path.read_text()):
                found += [(path.name, argv) for argv in _argvs(doc)]
        elif path.name == "lightgate.service":
            line = next(ln for ln in path.read_text().splitlines() if ln.startswith("ExecStart"))
            found.append((path.name, line.split("lightgate ", 1)[1].split()))
        elif path.name == "Dockerfile":
            cmd = next(ln for ln in path.read_text().splitlines() if ln.startswith("CMD"))
            found.append((path.name, json.loads(cmd[3:])))
    return found


def _argvs(node: object) -> list[list[str]]:
    out = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("command", "args") and isinstance(value, list) and value and \
                    value[0] in ("serve", "store", "gateway"):
                out.append([str(v) for v in value])
            else:
                out += _argvs(value)
    elif isinstance(node, list):
        for item in node:
            out += _argvs(item)
    return out


def test_every_file_parses() -> None:
    for path in DEPLOY.rglob("*"):
        if path.suffix in (".yml", ".yaml"):
            assert list(yaml.safe_load_all(path.read_text())), path
        elif path.suffix == ".json":
            json.loads(path.read_text())
        elif path.suffix == ".toml":
            tomllib.loads(path.read_text())


def test_every_flag_exists() -> None:
    invocations = lightgate_invocations()
    assert {argv[0] for _, argv in invocations} == {"serve", "store", "gateway"}
    flags = {cmd: help_flags(cmd) for cmd in ("serve", "store", "gateway")}
    for name, argv in invocations:
        for arg in argv[1:]:
            if arg.startswith("--"):
                assert arg in flags[argv[0]], f"{name}: `lightgate {argv[0]}` has no {arg}"


def test_config_keys_are_flags() -> None:
    for path, cmd in ((DEPLOY / "lightgate.toml", "serve"),):
        keys = tomllib.loads(path.read_text())
        for key in keys:
            assert "--" + key.replace("_", "-") in help_flags(cmd), f"{path.name}: {key}"
    cm = yaml.safe_load((DEPLOY / "k8s" / "configmap.yaml").read_text())
    for file, cmd in (("store.toml", "store"), ("gateway.toml", "gateway")):
        for key in tomllib.loads(cm["data"][file]):
            assert "--" + key.replace("_", "-") in help_flags(cmd), f"{file}: {key}"


def test_ports_match_the_interfaces() -> None:
    text = "\n".join(p.read_text() for p in DEPLOY.rglob("*") if p.is_file())
    for port in re.findall(r"(?:--mqtt|--native|--http|containerPort:|port:)\D{0,20}(\d{4,5})",
                           text):
        # 7900: a store group's Raft port (--raft; no default, docs/store-groups.md)
        assert int(port) in {*PORTS.values(), 6379, 7077, 8080, 9090, 3000, 7900}, port
    assert "1883" in text and "10911" in text and "18083" in text


def test_grafana_queries_only_served_metrics() -> None:
    from gateway import metrics

    source = Path(metrics.__file__).read_text()
    dash = json.loads((DEPLOY / "grafana" / "lightgate-dashboard.json").read_text())
    for panel in dash["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"lightgate_[a-z_]+", target["expr"]):
                base = re.sub(r"_(total|bucket|count|sum)$", "", name)
                assert f'"{base}"' in source, f"dashboard uses unknown metric {name}"


def test_the_image_exposes_every_port_runs_as_a_user_and_checks_its_health() -> None:
    stages: list[list[tuple[str, str]]] = []
    for word, args in dockerfile_instructions((DEPLOY / "docker" / "Dockerfile").read_text()):
        if word == "FROM":
            stages.append([])
        stages[-1].append((word, args))
    runtime = dict(stages[-1])  # the image that runs: the last stage
    assert "rust" not in runtime["FROM"]  # no toolchain where Lightgate runs
    assert {int(p) for p in runtime["EXPOSE"].split()} == set(PORTS.values())
    assert runtime["USER"] not in ("root", "0")
    assert "/healthz" in runtime["HEALTHCHECK"] and f":{PORTS['http']}/" in runtime["HEALTHCHECK"]
    assert "--require-native" in dict(stages[0])["RUN"]  # no image without the native plane


def test_compose_and_kubernetes_run_that_image() -> None:
    """Every service or container that runs a `lightgate` command runs the image of
    deploy/docker/Dockerfile, as its non-root user."""
    for path in sorted((DEPLOY / "compose").glob("*.yml")):
        services = yaml.safe_load(path.read_text())["services"]
        for name, svc in services.items():
            if _argvs(svc):
                assert svc["image"] == "lightgate:latest", (path.name, name)
                assert svc["build"]["dockerfile"] == "deploy/docker/Dockerfile", (path.name, name)
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            pod = (doc.get("spec") or {}).get("template", {}).get("spec")
            if not pod or not _argvs(pod):
                continue
            assert pod["securityContext"]["runAsNonRoot"] is True, path.name
            for container in pod["containers"]:
                assert container["image"] == "lightgate:latest", path.name


def unit_settings() -> dict[str, str]:
    """The systemd unit's Key=Value lines (comments left out)."""
    lines = (DEPLOY / "systemd" / "lightgate.service").read_text().splitlines()
    return dict(ln.split("=", 1) for ln in lines if "=" in ln and not ln.startswith("#"))


def test_the_systemd_unit_is_installed_as_the_docs_say() -> None:
    """docs/deployment.md makes the unit's user, its virtual environment (where ExecStart
    runs from) and its config file, and reloads it with systemctl."""
    unit = unit_settings()
    docs = (ROOT / "docs" / "deployment.md").read_text()
    binary, _, args = unit["ExecStart"].partition(" ")
    venv = binary.removesuffix("/bin/lightgate")
    assert f"useradd --system --home-dir /var/lib/lightgate --shell /usr/sbin/nologin " \
           f"{unit['User']}" in docs
    assert f"python3 -m venv {venv}" in docs and f"{venv}/bin/pip install dist/" in docs
    assert "--config /etc/lightgate/lightgate.toml" in args
    assert "cp deploy/lightgate.toml /etc/lightgate/" in docs
    assert unit["StateDirectory"] == "lightgate" and "--data-dir /var/lib/lightgate" in args
    assert "systemctl reload lightgate" in docs


def test_the_units_reload_command_reloads_a_running_server(tmp_path: Path) -> None:
    """ExecReload run as systemd runs it ($MAINPID: the server's pid) on a real server."""
    from tests.conftest import Server

    srv = Server(tmp_path / "data").start()
    assert srv.proc is not None
    try:
        argv = unit_settings()["ExecReload"].replace("$MAINPID", str(srv.proc.pid)).split()
        subprocess.run(argv, check=True, timeout=10)
        assert srv.wait_log("SIGHUP: re-reading")
    finally:
        assert srv.stop() == 0, srv.logs()[-3000:]
