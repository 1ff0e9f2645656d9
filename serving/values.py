"""Values several commands share, written once: the default addresses and the HTTP body
limit, and the shapes settings and clients take, each parsed in one place (HOST:PORT,
NAME:PASSWORD). No imports: the Spark workers use them too."""

from __future__ import annotations

# Where a store listens for the native protocol, and where its clients look, by default.
NATIVE_ADDR = "127.0.0.1:10911"
HTTP_ADDR = "127.0.0.1:18083"  # the dashboard, admin API and metrics
# Bytes of an HTTP request body (413 past it): a policy, a user, a Spark rule file are
# all far smaller.
HTTP_MAX_BODY = 1024 * 1024


def split_hostport(addr: str, default_host: str = "0.0.0.0") -> tuple[str, int]:
    """'127.0.0.1:1883' -> ('127.0.0.1', 1883); ':1883' and '1883' use `default_host`."""
    host, sep, port = addr.rpartition(":")
    if not sep:
        host, port = "", addr
    host = host.strip("[]") or default_host
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"bad address {addr!r}: expected HOST:PORT") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"bad port in {addr!r}")
    return host, number


def split_credentials(spec: str, what: str) -> tuple[str, str]:
    """'NAME:PASSWORD' -> (name, password) (the password may hold ':'); ValueError naming
    `what` (the flag or variable it came from) without a name and a colon."""
    name, sep, password = spec.partition(":")
    if not sep or not name:
        raise ValueError(f"{what} takes NAME:PASSWORD")
    return name, password
