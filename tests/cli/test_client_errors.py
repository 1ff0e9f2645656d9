"""The client commands' failures as a user meets them: the installed `lightgate` script,
run from another directory, against a store that is not there, with wrong credentials,
and without an optional extra. Each ends with a non-zero status and one line on stderr
that says what is wrong and what to do; a traceback only with --log-level debug."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.conftest import ROOT, Server
from tests.security.helpers import ADMIN, auth_server

SCRIPT = Path(sys.executable).parent / "lightgate"


def run(args: list[str], cwd: Path, env: dict[str, str] | None = None,
        stdin: str = "") -> subprocess.Popen[str]:
    if not SCRIPT.exists():
        pytest.skip("no installed lightgate script beside this interpreter")
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LIGHTGATE_AUTH")}
    proc = subprocess.Popen([str(SCRIPT), *args], cwd=cwd, env={**base, **(env or {})},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdin is not None
    proc.stdin.write(stdin)
    proc.stdin.close()
    return proc


def one_line(proc: subprocess.Popen[str], *needles: str, timeout: float = 60) -> str:
    """A non-zero status and one line on stderr, naming every one of `needles`."""
    assert proc.stderr is not None
    err = proc.stderr.read()
    status = proc.wait(timeout)
    assert status != 0, err
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("lightgate"), lines
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture
def nowhere() -> str:
    """HOST:PORT nothing listens on (connections are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


CLIENT_COMMANDS = [
    ["produce", "t"], ["produce", "t", "--no-idempotent"], ["consume", "t", "--group", "g"],
    ["user", "list"], ["user", "add", "bob", "--password", "pw"], ["acl", "list"],
    ["acl", "add", "bob", "--resource", "Topic:t", "--actions", "PUB"],
]


def test_a_store_that_is_not_there(tmp_path: Path, nowhere: str) -> None:
    procs = [(cmd, run([*cmd, "--server", nowhere], tmp_path, stdin="a\n"))
             for cmd in CLIENT_COMMANDS]  # at once: each waits for its connect timeout
    for cmd, proc in procs:
        line = one_line(proc, f"cannot reach the store at {nowhere}", "connection refused",
                        "--server")
        assert line.startswith(f"lightgate {cmd[0]}: "), line


def test_wrong_credentials(tmp_path: Path) -> None:
    """One at a time, a success between: the store answers each failed login from an
    address later than the one before (0.2 s, doubling), past the client's 2 s."""
    srv = auth_server(tmp_path)
    server = ["--server", srv.native]
    try:
        for cmd, env in ((["produce", "t", "--as", "admin:nope"], None),
                         (["consume", "t", "--group", "g"], {"LIGHTGATE_AUTH": "admin:nope"}),
                         (["user", "list", "--as", ":".join(ADMIN)], None),  # (resets it)
                         (["acl", "list", "--as", "admin:nope"], None),
                         (["user", "add", "x", "--password", "p", "--as", "admin:nope"], None),
                         (["user", "list", "--as", ":".join(ADMIN)], None)):
            proc = run([*cmd, *server], tmp_path, env=env, stdin="a\n")
            if "admin:nope" not in cmd and not env:
                assert proc.wait(60) == 0
                continue
            one_line(proc, f"lightgate {cmd[0]}: the store refused the credentials of "
                     "'admin'", "401", "--as NAME:PASSWORD")
        # No credentials at all, to a store that needs them: said as such.
        one_line(run(["consume", "t", "--group", "g", *server], tmp_path),
                 "needs credentials", "401", "--as NAME:PASSWORD")
    finally:
        srv.stop()


def test_a_debug_log_level_shows_the_traceback(tmp_path: Path, nowhere: str) -> None:
    proc = run(["--log-level", "debug", "produce", "t", "--server", nowhere], tmp_path)
    assert proc.stderr is not None
    err = proc.stderr.read()
    assert proc.wait(60) == 1
    assert "Traceback" in err and err.splitlines()[-1].startswith("lightgate produce: ")


def test_simulate_with_no_broker_there(tmp_path: Path, nowhere: str) -> None:
    one_line(run(["simulate", "--mqtt", nowhere, "--devices", "2", "--seconds", "1"],
                 tmp_path), f"cannot connect to the MQTT broker at {nowhere}",
             "connection refused", "--mqtt")


def test_simulate_with_wrong_credentials(tmp_path: Path) -> None:
    srv = auth_server(tmp_path)
    try:
        one_line(run(["simulate", "--mqtt", f"127.0.0.1:{srv.port}", "--devices", "2",
                      "--seconds", "1", "--as", "admin:nope"], tmp_path),
                 "refused", "--as")
    finally:
        srv.stop()


@pytest.fixture
def without(tmp_path: Path) -> callable:
    """An environment where the given top-level modules cannot be imported, as on a
    machine without the extra that brings them."""

    def env(*modules: str) -> dict[str, str]:
        site = tmp_path / "site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(
            "import sys\n\n\n"
            "class Hide:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            f"        if name.partition('.')[0] in {set(modules)!r}:\n"
            "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n\n\n"
            "sys.meta_path.insert(0, Hide())\n")
        return {"PYTHONPATH": str(site)}

    return env


@pytest.mark.parametrize("args, module", [
    (["analytics", "run", "offline"], "pyspark"),
    (["simulate", "--seconds", "1"], "paho"),
])
def test_a_missing_extra_is_named(tmp_path: Path, without: callable, nowhere: str,
                                  args: list[str], module: str) -> None:
    extra = "--server" if args[0] == "analytics" else "--mqtt"
    proc = run([*args, extra, nowhere], tmp_path, env=without(module))
    one_line(proc, module, "pip install 'lightgate[spark]'")


def test_the_spark_extra_brings_what_its_commands_import() -> None:
    """docs/spark.md installs the `spark` extra for `lightgate analytics` and `lightgate
    simulate`: it brings pyspark, pyarrow and pandas, and paho-mqtt for simulate."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    names = {req.split("[")[0].split(">")[0].split("<")[0].split("=")[0].strip()
             for req in extras["spark"]}
    assert {"pyspark", "pyarrow", "pandas", "paho-mqtt"} <= names, names
    assert "pip install -e '.[spark]'" in (ROOT / "docs" / "spark.md").read_text()


def test_the_server_is_reached_when_it_is_there(tmp_path: Path) -> None:
    """(What the failures above are measured against: the same commands work.)"""
    srv = Server(tmp_path / "d").start()
    try:
        proc = run(["produce", "t", "--server", srv.native], tmp_path, stdin="a\nb\n")
        assert proc.stderr is not None
        err = proc.stderr.read()
        assert proc.wait(60) == 0, err
        assert err.strip() == "sent 2 messages to t"
    finally:
        srv.stop()
