"""`lightgate serve` with LIGHTGATE_NATIVE=1: the native engine writes the log. A process
killed with SIGKILL after acknowledging QoS 1 publishes (the Python gateway's, through
the engine) loses none of them, across segment rolls, and starts again on the log it
left."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from lightqueue.index import ConsumeQueueIndex
from serving import plane
from store.commitlog import CommitLog
from tests.conftest import Server
from tests.mqtt.paho_client import Client

if plane.NATIVE is None:
    if os.environ.get("LIGHTGATE_NATIVE") == "1":
        pytest.fail("LIGHTGATE_NATIVE=1 but the native extension is not installed")
    pytest.skip("the native extension is not installed", allow_module_level=True)


def _publish(port: int, start: int, count: int) -> list[bytes]:
    """QoS 1 publishes, each acknowledged before the next; their payloads."""
    sub = Client(port, "reader")
    sub.subscribe("dev/+/t", 1)  # a wildcard queue, routed by Python and the engine alike
    pub = Client(port, f"pub{start}")
    sent = []
    for i in range(start, start + count):
        body = b"m%05d-" % i + random.randbytes(random.randint(10, 200))
        pub.publish(f"dev/{i % 5}/t", body, qos=1)
        sent.append(body)
    got = [m.payload for m in sub.expect(count)]
    assert sorted(got) == sorted(sent)  # delivered live, too
    return sent


@pytest.mark.parametrize("flush", ["async", "sync"])
def test_sigkill_after_acks_loses_nothing(tmp_path: Path, flush: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTGATE_NATIVE", "1")
    server = Server(tmp_path / "d", "--segment-size", "4096", "--flush", flush,
                    "--io-threads", "2")
    acked: list[bytes] = []
    for run in range(2):
        server.start()
        assert server.addrs["plane"] == "native"
        try:
            acked += _publish(server.port, run * 1000, 150)
        finally:
            server.kill()

    log = CommitLog(tmp_path / "d" / "commitlog", ConsumeQueueIndex(tmp_path / "d" / "index"),
                    segment_size=4096)
    report = log.open()
    try:
        assert not report.clean_shutdown and report.truncated_at is None
        assert len(log.segments()) > 10  # rolled, by the engine
        stored = [m.body for m in log.scan(0) if m.topic.startswith("dev/")]
        assert sorted(stored) == sorted(acked)  # every acknowledged one, once
        for k in range(5):  # each queue's offsets: 0, 1, 2, ... in the order acked
            entries = log.index.read(f"dev/{k}/t", 0, 10_000)
            assert [e.offset for e in entries] == list(range(len(entries)))
            assert [log.read(e.phys_offset, e.size).body for e in entries] == \
                [b for i, b in enumerate(acked) if i % 150 % 5 == k]
    finally:
        log.close()
        log.index.close()


def test_the_native_plane_is_the_default(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LIGHTGATE_NATIVE", raising=False)
    server = Server(tmp_path / "d").start()
    try:
        assert server.addrs["plane"] == "native"
    finally:
        assert server.stop() == 0


def test_the_installed_command_runs_the_native_plane(tmp_path: Path) -> None:
    """`lightgate serve` as `make serve` and a user run it: the installed script, from
    another directory, nothing on PYTHONPATH. The extension used to be a top-level module
    that an editable install builds at the checkout's root, where only `python -m` from
    the checkout found it: the script ran the Python plane."""
    script = Path(sys.executable).parent / "lightgate"
    if not script.exists():
        pytest.skip("no installed lightgate script beside this interpreter")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LIGHTGATE_NATIVE")}
    proc = subprocess.Popen([str(script), "serve", "--data-dir", str(tmp_path / "d"),
                             "--mqtt", "127.0.0.1:0", "--ws", "off", "--native", "127.0.0.1:0",
                             "--http", "127.0.0.1:0"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("ready "):
                break
        assert lines and lines[-1].startswith("ready "), "".join(lines)
        assert "plane=native" in lines[-1], lines[-1]
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def test_the_python_plane_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTGATE_NATIVE", "0")
    server = Server(tmp_path / "d").start()
    try:
        assert server.addrs["plane"] == "python"
    finally:
        assert server.stop() == 0


def test_a_separated_gateway_takes_io_threads_and_runs_native(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTGATE_NATIVE", "1")
    store = Server(tmp_path / "d", command="store").start()
    try:
        gateway = Server(None, "--store", store.native, "--io-threads", "3",
                         command="gateway").start()
        try:
            # Its engine keeps no log: it sends its publishes to the store.
            assert gateway.addrs["plane"] == "native"
        finally:
            assert gateway.stop() == 0
    finally:
        assert store.stop() == 0


# Put in place, before anything imports it, as `serving.lightgate_native`: the module of
# this source, or None (an import that fails) when the source raises ImportError.
STUB_SITECUSTOMIZE = """\
import importlib.util, sys
spec = importlib.util.spec_from_file_location("serving.lightgate_native", {path!r})
module = importlib.util.module_from_spec(spec)
try:
    spec.loader.exec_module(module)
except ImportError:
    module = None
sys.modules["serving.lightgate_native"] = module
"""


def _serve_with_stub(tmp_path: Path, stub_source: str) -> subprocess.CompletedProcess[str]:
    """`lightgate serve` with LIGHTGATE_NATIVE=1 and this source as the extension
    (`serving.lightgate_native`): a missing or an older extension, as a user has it."""
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "native_stub.py").write_text(stub_source)
    (stub / "sitecustomize.py").write_text(
        STUB_SITECUSTOMIZE.format(path=str(stub / "native_stub.py")))
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "LIGHTGATE_NATIVE": "1",
           "PYTHONPATH": os.pathsep.join([str(stub), str(root)])}
    return subprocess.run([sys.executable, "-m", "lightgate", "serve", "--data-dir",
                           str(tmp_path / "d"), "--mqtt", "127.0.0.1:0", "--ws", "off",
                           "--native", "127.0.0.1:0", "--http", "127.0.0.1:0"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)


def _one_line(res: subprocess.CompletedProcess[str], start: str) -> None:
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith(start), res.stderr


def test_native_asked_for_but_not_installed_is_one_line(tmp_path: Path) -> None:
    res = _serve_with_stub(tmp_path, "raise ImportError('not built')\n")
    _one_line(res, "lightgate: LIGHTGATE_NATIVE=1 but the native data plane is not installed")


def test_an_extension_older_than_the_writer_is_one_line(tmp_path: Path) -> None:
    stub = ("def encode_record(*args):\n    raise ValueError('stub')\n\n\n"
            "class Engine:  # what the extension had before it wrote Python's appends\n"
            "    pass\n")
    res = _serve_with_stub(tmp_path, stub)
    _one_line(res, "lightgate: the native data plane installed is older than this Lightgate")
