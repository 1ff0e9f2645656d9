"""Shared by the security tests: a server with auth on, and admin calls to it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from store import protocol as p
from store.client import NativeClient
from tests.conftest import Server

ADMIN = ("admin", "admin-secret")


def auth_server(tmp_path: Path, *extra: str) -> Server:
    return Server(tmp_path / "data", "--auth", "--init-user", f"{ADMIN[0]}:{ADMIN[1]}",
                  *extra).start()


def native(server: Server, code: str, header: dict[str, Any] | None = None,
           creds: tuple[str, str] | None = ADMIN, body: bytes = b"") -> dict[str, Any]:
    """One native request as `creds` (with `body`, for the requests that carry one);
    raises p.RemoteError on refusal."""

    async def call() -> dict[str, Any] | Exception:
        async with NativeClient.open(server.native, credentials=creds) as client:
            try:  # returned, not raised: the client's nursery would wrap it in a group
                reply, _ = await client.request(getattr(p, code), header or {}, body)
            except p.RemoteError as exc:
                return exc
            return reply

    out = trio.run(call)
    if isinstance(out, Exception):
        raise out
    return out


def add_user(server: Server, name: str, password: str, *, super_user: bool = False,
             node: bool = False) -> None:
    native(server, "USER_ADD", {"name": name, "password": password, "super": super_user,
                                "node": node})


def allow(server: Server, user: str, resource: str, actions: str, **kw: Any) -> None:
    native(server, "ACL_ADD", {"user": user, "resource": resource, "actions": actions, **kw})
