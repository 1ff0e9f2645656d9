"""Shared fixtures: a real `lightgate serve` subprocess on free ports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


class Server:
    """`lightgate serve` in a subprocess; restartable on the same data directory."""

    def __init__(self, data_dir: Path, *extra: str) -> None:
        self.data_dir = data_dir
        self.extra = list(extra)
        self.proc: subprocess.Popen | None = None
        self.addrs: dict[str, str] = {}
        self.log: list[str] = []
        self.mqtt_port = 0

    def start(self) -> Server:
        args = [sys.executable, "-m", "lightgate", "--log-level", "DEBUG", "serve",
                "--data-dir", str(self.data_dir), "--mqtt", f"127.0.0.1:{self.mqtt_port}",
                "--native", "127.0.0.1:0", "--http", "127.0.0.1:0", "--sys-interval", "1",
                *self.extra]
        self.proc = subprocess.Popen(
            args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        line = self.proc.stdout.readline()
        if not line.startswith("ready "):
            self.proc.wait(10)
            raise RuntimeError(f"server did not start: {line!r} {self.proc.stderr.read()}")
        self.addrs = dict(part.split("=", 1) for part in line.split()[1:])
        # Keep the port on restart, as clients of a real broker would expect.
        self.mqtt_port = int(self.addrs["mqtt"].rsplit(":", 1)[1])
        threading.Thread(target=self._drain, args=(self.proc,), daemon=True).start()
        return self

    def _drain(self, proc: subprocess.Popen) -> None:
        for line in proc.stderr:
            self.log.append(line)

    @property
    def port(self) -> int:
        return self.mqtt_port

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        code = self.proc.wait(30)
        self.proc = None
        return code

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def logs(self) -> str:
        return "".join(self.log)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    srv = Server(tmp_path / "data").start()
    yield srv
    if srv.proc is not None:
        assert srv.stop() == 0, srv.logs()[-3000:]


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("shared") / "data").start()
    yield srv
    if srv.proc is not None:
        assert srv.stop() == 0, srv.logs()[-3000:]
