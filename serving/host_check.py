"""Which HTTP requests a node answers: DNS rebinding and cross-site requests.

A web page on any site can make a browser send requests to a node's HTTP port. Two
ways matter when the API is open (no --auth, the default on loopback):
- **Cross-site requests** (a form POST): the browser sends them with the page's
  Origin. A request that changes something (any method but GET, HEAD and OPTIONS)
  carrying an Origin other than the node's own is refused. Scripts and command line
  tools send no Origin and are not affected; the dashboard is served from the node
  itself, so its Origin is the node's own.
- **DNS rebinding**: a page whose DNS name the attacker points at 127.0.0.1 reads the
  answers too, and its requests carry that name as Host. A Host must be a loopback
  name, an IP address (a rebinding page's Host is always its own name), --http's own
  host or a name in --http-allowed-hosts (`*`: any).
`/healthz` and `/metrics` answer any Host: they carry counters only, and probes and
scrapers reach nodes by whatever name their network gives them.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

import orjson

ANY_HOST = "*"
LOOPBACK_NAMES = frozenset({"localhost"})
OPEN_PATHS = frozenset({"/healthz", "/metrics"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
DEFAULT_PORTS = {"http": 80, "https": 443}


def _split_host(host: str) -> tuple[str, int | None]:
    """(name, port) of a Host header or a URL's netloc: lower case, no brackets, no
    trailing dot; port None when not given or not a number."""
    host = host.strip().lower()
    if host.startswith("["):  # [::1]:8080
        name, _, rest = host[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif host.count(":") == 1:
        name, _, port_text = host.partition(":")
    else:  # no port, or a bare IPv6 address
        name, port_text = host, ""
    port = int(port_text) if port_text.isdigit() else None
    return name.rstrip("."), port


def allowed_names(bind_host: str, extra: Iterable[str]) -> frozenset[str]:
    """The names a node answers to beside IP addresses: loopback's, its --http host's
    and `extra` (--http-allowed-hosts)."""
    names = {_split_host(n)[0] for n in extra if n.strip()}
    names.add(_split_host(bind_host)[0])
    return frozenset(LOOPBACK_NAMES | names)


def host_allowed(host: str, names: frozenset[str]) -> bool:
    name, _ = _split_host(host)
    if ANY_HOST in names or name in names or name.endswith(".localhost"):
        return True  # *.localhost: browsers resolve it to loopback themselves
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def same_origin(origin: str, scheme: str, host: str) -> bool:
    """Whether a browser's Origin is the site the request went to (`scheme`, Host)."""
    parts = urlsplit(origin.strip())
    if parts.scheme != scheme or scheme not in DEFAULT_PORTS or not parts.netloc:
        return False  # `null` (a sandboxed page, a file) and anything else
    default = DEFAULT_PORTS[scheme]
    o_name, o_port = _split_host(parts.netloc)
    h_name, h_port = _split_host(host)
    return (o_name, o_port or default) == (h_name, h_port or default)


def refusal(method: str, path: str, scheme: str, host: str | None, origin: str | None,
            names: frozenset[str]) -> str:
    """Why a request is refused ('' if it is not)."""
    if path in OPEN_PATHS:
        return ""
    if host is not None and not host_allowed(host, names):
        return (f"Host {host!r} is not a name this node answers to: add it with "
                "--http-allowed-hosts (loopback names, IP addresses and --http's own host "
                "need not be)")
    if method not in SAFE_METHODS and origin is not None and \
            not same_origin(origin, scheme, host or ""):
        return (f"a request from another site (Origin {origin!r}) may not change anything "
                "here")
    return ""


class HostCheck:
    """ASGI middleware: refuses (403) what `refusal` refuses, before the app sees it."""

    def __init__(self, app: Any, names: frozenset[str]) -> None:
        self.app = app
        self.names = names
        self.refused = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", ()))
        host, origin = headers.get(b"host"), headers.get(b"origin")
        why = refusal(scope["method"], scope["path"], scope.get("scheme", "http"),
                      None if host is None else host.decode("latin-1"),
                      None if origin is None else origin.decode("latin-1"), self.names)
        if not why:
            await self.app(scope, receive, send)
            return
        self.refused += 1
        body = orjson.dumps({"error": why})
        await send({"type": "http.response.start", "status": 403, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
