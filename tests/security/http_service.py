"""A real HTTP service on loopback for the auth backend tests: an operator's auth hook
or a JWKS endpoint, answering from a function the test supplies."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# (status, body or None, delay before answering in seconds)
Answer = tuple[int, Any, float]


class HttpService:
    """`answer(method, path, json_body)` decides each reply; every request is recorded."""

    def __init__(self, answer: Callable[[str, str, Any], Answer]) -> None:
        self.answer = answer
        self.requests: list[tuple[str, str, Any]] = []
        service = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as a real service would

            def _reply(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                service.requests.append((method, self.path, body))
                status, out, delay = service.answer(method, self.path, body)
                if delay:
                    time.sleep(delay)
                data = b"" if out is None else (
                    out if isinstance(out, bytes) else json.dumps(out).encode())
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass  # the client gave up waiting (the timeout tests)

            def do_POST(self) -> None:
                self._reply("POST")

            def do_GET(self) -> None:
                self._reply("GET")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}"

    def start(self) -> HttpService:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)

    def bodies(self, **match: Any) -> list[dict]:
        """Recorded JSON bodies whose fields equal `match`."""
        return [b for _, _, b in self.requests
                if isinstance(b, dict) and all(b.get(k) == v for k, v in match.items())]


def closed_port_url() -> str:
    """A loopback URL nothing listens on (the port was just free)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/auth"
