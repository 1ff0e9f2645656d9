"""Start-up failures as a user meets them: real processes, real busy ports, a real second
Lightgate on the data directory. Each ends with status 2 and one line on stderr that
says what is wrong and which flag fixes it; a traceback only with --log-level debug."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightgate import settings
from tests.cli.test_serve import start_serve
from tests.conftest import Server

ROOT = Path(__file__).resolve().parents[2]
LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (DEBUG|INFO) ")
FREE = "127.0.0.1:0"


def lightgate(*args: str, env: dict[str, str] | None = None,
              timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lightgate", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def the_line(res: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Status 2, no traceback, and exactly one line besides the INFO log records (which a
    user asked for with the default --log-level); it names every one of `needles`."""
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if not LOG_RECORD.match(ln)]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("lightgate"), lines
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture
def busy() -> Iterator[str]:
    """HOST:PORT of a socket another process (this test) listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield f"127.0.0.1:{sock.getsockname()[1]}"


SERVE_FREE = {"--mqtt": FREE, "--ws": FREE, "--http": FREE, "--native": FREE}


@pytest.mark.parametrize("flag, what", [("--mqtt", "MQTT over TCP"),
                                        ("--ws", "MQTT over WebSocket"),
                                        ("--http", "HTTP"), ("--native", "native protocol")])
def test_serve_port_in_use_names_the_listener_and_its_flag(
        tmp_path: Path, busy: str, flag: str, what: str) -> None:
    ports = {**SERVE_FREE, flag: busy}
    res = lightgate("serve", "--data-dir", str(tmp_path / "d"),
                    *(x for kv in ports.items() for x in kv))
    the_line(res, what, busy, "already in use", f"{flag} HOST:PORT")
    # Ports are checked before the store opens: that one line is all, at the default
    # log level too (no recovery records before it).
    assert len(res.stderr.splitlines()) == 1, res.stderr


def test_every_port_in_use_is_named_in_one_run(tmp_path: Path) -> None:
    """The default ports taken (another broker runs): one run names them all, not one a
    run."""
    with contextlib.ExitStack() as stack:
        taken = {}
        for flag in SERVE_FREE:
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            sock.listen()
            taken[flag] = f"127.0.0.1:{sock.getsockname()[1]}"
        res = lightgate("serve", "--data-dir", str(tmp_path / "d"),
                        *(x for kv in taken.items() for x in kv))
    line = the_line(res, "already in use", "choose others with", "port 0 picks a free one",
                    *taken.values(), *taken)
    assert line.count("already in use") == 1, line  # one reason, said once
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("flag, what", [("--native", "native protocol"), ("--http", "HTTP")])
def test_store_port_in_use(tmp_path: Path, busy: str, flag: str, what: str) -> None:
    ports = {"--native": FREE, "--http": FREE, flag: busy}
    res = lightgate("store", "--data-dir", str(tmp_path / "d"),
                    *(x for kv in ports.items() for x in kv))
    the_line(res, what, busy, flag)
    assert len(res.stderr.splitlines()) == 1, res.stderr  # checked before the store opens


def test_gateway_port_in_use_and_missing_store(tmp_path: Path, busy: str) -> None:
    store = Server(tmp_path / "store", command="store").start()
    try:
        for flag, what in (("--mqtt", "MQTT over TCP"), ("--http", "HTTP")):
            ports = {"--mqtt": FREE, "--ws": "off", "--http": FREE, flag: busy}
            res = lightgate("--log-level", "error", "gateway", "--store", store.native,
                            *(x for kv in ports.items() for x in kv))
            the_line(res, what, busy, flag)
    finally:
        assert store.stop() == 0
    # The store is gone now: nothing answers on its port. A gateway waits for its store
    # (tests/separated), or for --store-wait-s only, then says so in one line.
    res = lightgate("--log-level", "error", "gateway", "--store", store.native, "--mqtt", FREE,
                    "--ws", "off", "--http", FREE, "--store-wait-s", "1")
    the_line(res, f"cannot reach the store at {store.native}", "connection refused",
             "--store", "--store-wait-s")


def test_data_dir_locked_by_another_lightgate(tmp_path: Path) -> None:
    proc, _ = start_serve(tmp_path / "d")
    try:
        for command, *ports in (("serve", "--mqtt", FREE, "--ws", "off"), ("store",)):
            res = lightgate(command, "--data-dir", str(tmp_path / "d"), *ports,
                            "--http", FREE, "--native", FREE)
            the_line(res, f"data directory {tmp_path / 'd'} is in use by another Lightgate",
                     f"pid {proc.pid}", "--data-dir")
    finally:
        proc.terminate()
        assert proc.wait(20) == 0
    # Released with the first process: the next start is fine.
    proc, _ = start_serve(tmp_path / "d")
    proc.terminate()
    assert proc.wait(20) == 0


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory nobody may write to: a read-only tmpfs for root (whom permission bits
    do not stop), mode 0555 for anyone else."""
    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {res.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.parametrize("sub", ["", "data"])
def test_data_dir_not_writable(read_only_dir: Path, sub: str) -> None:
    data = read_only_dir / sub if sub else read_only_dir
    res = lightgate("serve", "--data-dir", str(data), "--mqtt", FREE, "--http", FREE,
                    "--native", FREE)
    the_line(res, f"data directory {data} is not writable", "--data-dir")


def test_data_dir_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    res = lightgate("store", "--data-dir", str(tmp_path / "f"))
    the_line(res, "is a file, not a directory", "--data-dir")


@pytest.mark.parametrize("text, needles", [
    ('flush = "sync\n', ("is not valid TOML", "line 1")),
    ('flush_interval_ms = "often"\n', ("flush_interval_ms = 'often' is not an integer",)),
    ("partitions = true\n", ("partitions = True is not an integer",)),
    ('full_verify = "yes"\n', ("full_verify = 'yes' is not true or false",)),
    ("flush_intervl_ms = 5\n", ("unknown key 'flush_intervl_ms'",)),
    ('flush = "maybe"\n', ("--flush must be sync or async, not 'maybe'",)),
])
def test_bad_config_file(tmp_path: Path, text: str, needles: tuple[str, ...]) -> None:
    conf = tmp_path / "lightgate.toml"
    conf.write_text(text)
    res = lightgate("serve", "--data-dir", str(tmp_path / "d"), "--config", str(conf))
    the_line(res, *needles)
    assert not (tmp_path / "d").exists()  # refused before anything was touched


def test_missing_config_file(tmp_path: Path) -> None:
    res = lightgate("store", "--data-dir", str(tmp_path), "--config", str(tmp_path / "no.toml"))
    the_line(res, f"--config {tmp_path / 'no.toml'}", "No such file")


@pytest.mark.parametrize("args, env, needles", [
    (["--flush", "maybe"], {}, ("--flush must be sync or async, not 'maybe'",)),
    (["--flush-interval-ms", "soon"], {}, ("--flush-interval-ms", "invalid int value: 'soon'")),
    ([], {"LIGHTGATE_PARTITIONS": "four"}, ("LIGHTGATE_PARTITIONS='four' is not an integer",
                                             "--partitions")),
    (["--tls-client-auth", "always"], {}, ("--tls-client-auth must be",)),
    (["--io-threads", "0"], {}, ("--io-threads must be at least 1, not 0",)),
    # Each of these used to start, and then fail every publish (a division by zero
    # partitions), or run with no window, a log of one record a segment, no retention.
    (["--partitions", "0"], {}, ("--partitions must be at least 1, not 0",)),
    (["--max-inflight", "-5"], {}, ("--max-inflight must be at least 1, not -5",)),
    (["--segment-size", "10"], {}, ("--segment-size must be at least 4096, not 10",)),
    (["--retention-hours", "-1"], {}, ("--retention-hours must be more than 0, not -1",)),
    ([], {"LIGHTGATE_MAX_KEEPALIVE": "70000"},
     ("--max-keepalive must be at most 65535, not 70000 (LIGHTGATE_MAX_KEEPALIVE)",)),
])
def test_bad_value(tmp_path: Path, args: list[str], env: dict[str, str],
                   needles: tuple[str, ...]) -> None:
    res = lightgate("serve", "--data-dir", str(tmp_path / "d"), *args, env=env)
    the_line(res, *needles)


def test_missing_tls_files(tmp_path: Path, tls_files: tuple[str, str]) -> None:
    cert, key = tls_files
    for flags, needle in (
        (["--tls-cert", str(tmp_path / "nope.pem"), "--tls-key", key],
         f"--tls-cert {tmp_path / 'nope.pem'}: the file does not exist"),
        (["--tls-cert", cert, "--tls-key", str(tmp_path / "nope.key")],
         f"--tls-key {tmp_path / 'nope.key'}: the file does not exist"),
        (["--tls-cert", key, "--tls-key", key], "does not load"),  # a key is no certificate
    ):
        res = lightgate("serve", "--data-dir", str(tmp_path / "d"), "--mqtt", FREE,
                        "--mqtt-tls", FREE, "--ws", "off", "--wss", FREE, "--http", FREE,
                        "--native", FREE, *flags)
        the_line(res, needle)


@pytest.fixture
def tls_files(tmp_path: Path) -> tuple[str, str]:
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    server = ca.issue_cert("localhost")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    server.cert_chain_pems[0].write_to_path(str(cert))
    server.private_key_pem.write_to_path(str(key))
    return str(cert), str(key)


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_log_level_shows_the_traceback(tmp_path: Path, busy: str, where: str) -> None:
    """--log-level before the command or after it, as the README's "`--log-level debug`
    adds the traceback" reads either way."""
    level = ["--log-level", "debug"]
    serve = ["serve", "--data-dir", str(tmp_path / "d"), "--mqtt", busy, "--ws", "off",
             "--http", FREE, "--native", FREE]
    res = lightgate(*(level + serve if where == "before" else serve + level))
    assert res.returncode == 2
    assert "Traceback" in res.stderr and "Address already in use" in res.stderr
    assert res.stderr.splitlines()[-1].startswith("lightgate: MQTT over TCP cannot listen")


def test_usage_errors_are_one_line(tmp_path: Path) -> None:
    res = lightgate("serve", "--no-such-flag")
    the_line(res, "unrecognized arguments: --no-such-flag", "--help")


@pytest.mark.parametrize("command", ["serve", "store", "gateway"])
def test_every_setting_out_of_bounds_is_named_in_one_run(tmp_path: Path, command: str
                                                         ) -> None:
    """Walks the command's table: every number and choice set past what it takes, and
    the one line names each flag, before anything opens."""
    table = {"serve": settings.SERVE_SETTINGS, "store": settings.STORE_CMD_SETTINGS,
             "gateway": settings.GATEWAY_CMD_SETTINGS}[command]
    args: list[str] = []
    for flag, typ, _, _ in table:
        b = settings.BOUNDS.get(flag)
        if b is None or not b.bounded or typ is bool:
            continue
        if b.choices:
            bad = "nope"
        else:  # just below the least, or the bound it must be above
            bad = str(typ(b.least) - 1 if b.least is not None else typ(b.above))
        args += [f"--{flag}", bad]
    flags = args[::2]
    assert len(flags) >= 25, flags  # the tables, not a few
    data = ["--data-dir", str(tmp_path / "d")] if command != "gateway" else []
    res = lightgate(command, *data, *args)
    line = the_line(res, *(f"{flag} must be" for flag in flags))
    assert line.count(" must be ") == len(flags), line
    assert not (tmp_path / "d").exists()
