"""A TCP forwarder the test owns and can cut: what a link between two hosts is. Cut, it
forwards nothing more and leaves the connections it holds open and silent (packets
dropped, as in a partition), and new ones hang the same way; healed, those are closed
and new connections are forwarded again."""

from __future__ import annotations

import socket
import threading

from tests.conftest import reserved_port


class Proxy:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.sock = socket.create_server(("127.0.0.1", reserved_port()))
        self.addr = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self._cut = threading.Event()
        self._lock = threading.Lock()
        self._held: list[socket.socket] = []  # every socket of the connections it has
        threading.Thread(target=self._serve, daemon=True).start()

    def cut(self) -> None:
        self._cut.set()

    def heal(self) -> None:
        with self._lock:
            held, self._held = self._held, []
            self._cut.clear()
        for s in held:
            _close(s)

    def close(self) -> None:
        self.sock.close()
        self.heal()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                self._held.append(client)
            if self._cut.is_set():
                continue  # held, silent, until healed
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _close(client)
                continue
            upstream.settimeout(None)
            with self._lock:
                self._held.append(upstream)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                if self._cut.is_set():
                    continue  # dropped
                b.sendall(data)
        except OSError:
            pass
        finally:
            if not self._cut.is_set():
                _close(a)
                _close(b)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()
