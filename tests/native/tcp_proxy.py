"""A TCP proxy a test controls: it forwards a client's connections to a server, and cuts
one where the test says, e.g. after the client's request reached the server but before
the server's answer reaches the client (the answer is thrown away)."""

from __future__ import annotations

import contextlib
import socket
import threading


class TcpProxy:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._conns: list[tuple[socket.socket, socket.socket]] = []
        self._cut_answers = 0  # cut at the next this many server -> client chunks
        self.cuts = 0  # connections cut so far
        self.answers_lost = 0  # server -> client bytes thrown away with them
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def cut_next_answer(self) -> None:
        """Cut the connection that next brings bytes from the server, throwing them
        away: the server did what the client asked, the client never hears of it."""
        with self._lock:
            self._cut_answers += 1

    def cut_all(self) -> None:
        """Cut every connection now."""
        with self._lock:
            conns, self._conns = self._conns, []
        for pair in conns:
            self._close(pair)
        self.cuts += len(conns)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        self.cut_all()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            pair = (client, server)
            with self._lock:
                self._conns.append(pair)
            threading.Thread(target=self._pump, args=(client, server, pair, False),
                             daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, pair, True),
                             daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket,
              pair: tuple[socket.socket, socket.socket], answers: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if answers and self._take_cut():
                    self.answers_lost += len(data)
                    self.cuts += 1
                    break
                dst.sendall(data)
        except OSError:
            pass
        with self._lock:
            if pair in self._conns:
                self._conns.remove(pair)
        self._close(pair)

    def _take_cut(self) -> bool:
        with self._lock:
            if self._cut_answers:
                self._cut_answers -= 1
                return True
            return False

    @staticmethod
    def _close(pair: tuple[socket.socket, socket.socket]) -> None:
        for s in pair:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()
