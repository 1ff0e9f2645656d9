"""A store group with --auth: users and policies copied to a replica take effect there
as they arrive, not at its next promotion (a deleted user must not go on reading from a
replica)."""

from __future__ import annotations

import base64
import json
import urllib.request
from pathlib import Path
from typing import Any

import trio

from store import protocol as p
from store.client import AuthFailed, NativeClient
from tests.ha.cluster import Group, wait_for

ROOT_USER = ("root", "root-pw")
DEV = ("dev", "dev-pw")


def role(node: Any) -> str | None:
    """The node's role from its admin API (which wants credentials with --auth)."""
    req = urllib.request.Request(f"http://{node.addrs['http']}/api/v1/cluster")
    token = base64.b64encode(":".join(ROOT_USER).encode()).decode()
    req.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())["role"]
    except OSError:
        return None


def call(addr: str, code: int, header: dict[str, Any],
         creds: tuple[str, str]) -> dict[str, Any] | Exception:
    """One request on a fresh connection; a refusal is returned, not raised."""

    async def main() -> dict[str, Any] | Exception:
        try:
            async with NativeClient.open(addr, credentials=creds, connect_timeout=2.0) as c:
                try:
                    out, _ = await c.request(code, header)
                except p.RemoteError as exc:
                    return exc
                return out
        except p.RemoteError as exc:  # HELLO refused
            return exc
        except BaseExceptionGroup as group:  # the same, wrapped by the client's nursery
            return next(e for e in group.exceptions if isinstance(e, p.RemoteError))

    return trio.run(main)


def users_on(addr: str) -> set[str]:
    out = call(addr, p.META_ITEMS, {"cf": "users"}, ROOT_USER)
    assert isinstance(out, dict), out
    return {k for k, _ in out["items"]}


def dev_reads(addr: str) -> bool:
    """Whether `dev` logs in at `addr` and reads its topic there."""
    out = call(addr, p.PULL, {"queue": "orders#0", "offset": 0, "max": 1}, DEV)
    return isinstance(out, dict)


def add_dev(master: str) -> None:
    for code, header in ((p.USER_ADD, {"name": DEV[0], "password": DEV[1]}),
                         (p.ACL_ADD, {"user": DEV[0], "resource": "Topic:orders",
                                      "actions": "SUB"})):
        out = call(master, code, header, ROOT_USER)
        assert isinstance(out, dict), out


def test_a_replica_applies_user_changes_as_it_copies_them(tmp_path: Path) -> None:
    root = ":".join(ROOT_USER)
    g = Group(tmp_path, 3, "--auth", "--init-user", root).start()  # replicas: the secret
    try:
        m = wait_for(lambda: next((i + 1 for i, n in enumerate(g.nodes)
                                   if role(n) == "master"), None), 20, "a master") - 1
        master = g.nodes[m].native
        r = (m + 1) % 3
        replica = g.nodes[r]
        assert role(replica) == "replica"
        add_dev(master)
        wait_for(lambda: DEV[0] in users_on(replica.native), 15, "the user copied")
        # A restart loads what was copied (so far, the one way a replica took it up).
        replica.stop()
        replica.start()
        wait_for(lambda: role(replica) == "replica", 15, "the node back as a replica")
        wait_for(lambda: dev_reads(replica.native), 10, "dev to log in on the replica")

        # Deleted on the master: once the replica's copy shows it gone, it is refused
        # there too, and a connection it already has is refused its next request.
        async def open_then_delete() -> tuple[Any, Any]:
            async with NativeClient.open(replica.native, credentials=DEV) as c:
                await c.request(p.PULL, {"queue": "orders#0", "offset": 0, "max": 1})
                out = await trio.to_thread.run_sync(
                    call, master, p.USER_DELETE, {"name": DEV[0]}, ROOT_USER)
                await trio.to_thread.run_sync(
                    wait_for, lambda: DEV[0] not in users_on(replica.native), 15,
                    "the deletion copied")
                with trio.fail_after(5):
                    while True:
                        try:
                            await c.request(p.PULL, {"queue": "orders#0", "offset": 0})
                        except p.RemoteError as exc:
                            return out, exc
                        await trio.sleep(0.1)

        deleted, refusal = trio.run(open_then_delete)
        assert isinstance(deleted, dict)
        assert refusal.status == 403 and "disabled or deleted" in str(refusal)
        refused = call(replica.native, p.PULL, {"queue": "orders#0", "offset": 0}, DEV)
        assert isinstance(refused, AuthFailed), refused

        # Added again on the master: taken up by the replica as it is copied.
        add_dev(master)
        wait_for(lambda: dev_reads(replica.native), 15, "dev to log in on the replica again")
    finally:
        g.stop()
