"""A TCP proxy a test controls: it forwards a client's connections to a server, and cuts
one where the test says, e.g. after the client's request reached the server but before
the server's answer reaches the client (the answer is thrown away), or makes one go
silent: the connection stays open, the client's requests still reach the server, and no
answer comes back (a stateful firewall or NAT that lost the flow, a half-dead link)."""

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
        self._silence_answers = 0  # silence at the next this many server -> client chunks
        self._silent: set[socket.socket] = set()  # server sockets whose answers vanish
        self.silenced = 0  # connections silenced so far
        self.cuts = 0  # connections cut so far
        self.answers_lost = 0  # server -> client bytes thrown away with them
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def cut_next_answer(self) -> None:
        """Cut the connection that next brings bytes from the server, throwing them
        away: the server did what the client asked, the client never hears of it."""
        with self._lock:
            self._cut_answers += 1

    def silence_next_answer(self) -> None:
        """Make the connection that next brings bytes from the server go silent: those
        bytes and all after them are thrown away, the connection stays open, and what the
        client sends still reaches the server."""
        with self._lock:
            self._silence_answers += 1

    def cut_all(self) -> None:
        """Cut every connection now."""
        with self._lock:
            conns, self._conns = self._conns, []
        for pair in conns:
            self._close(pair)
        self.cuts += len(conns)

    def close(self) -> None:
        """Cut every connection and refuse new ones (a listener closed while a thread
        waits in accept() would go on accepting: shut down first, which wakes it)."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
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
                if answers and self._goes_silent(src):
                    self.answers_lost += len(data)
                    continue
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

    def _goes_silent(self, server: socket.socket) -> bool:
        with self._lock:
            if server not in self._silent and self._silence_answers:
                self._silence_answers -= 1
                self._silent.add(server)
                self.silenced += 1
            return server in self._silent

    @staticmethod
    def _close(pair: tuple[socket.socket, socket.socket]) -> None:
        for s in pair:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()
