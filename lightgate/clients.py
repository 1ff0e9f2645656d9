"""`lightgate clients list|kick`: the MQTT clients connected to a gateway, over its admin
HTTP API (`--http HOST:PORT`, what `serve` and `gateway` listen on; with --auth, a user's
credentials from --as NAME:PASSWORD or LIGHTGATE_AUTH, sent as HTTP Basic: listing needs
Cluster GET, kicking Cluster UPDATE). A failure is one line and status 1 (CommandError)."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import httpx

from serving.startup import CommandError
from serving.values import HTTP_ADDR

PAGE = 1000  # the admin API's largest page
COLUMNS = (("CLIENT ID", "client_id"), ("PEER", "peer"), ("PROTOCOL", "protocol_name"),
           ("PLANE", "plane"), ("CONNECTED SINCE", "connected_since"),
           ("SUBSCRIPTIONS", "subscriptions"))
Credentials = Callable[[argparse.Namespace], dict[str, str]]


def add_commands(sub: Any, credentials: Credentials) -> None:
    """`clients list` and `clients kick` under `sub`; `credentials`: the command line's
    reading of --as and LIGHTGATE_AUTH ({"username", "password"} or {})."""
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--http", default=HTTP_ADDR, metavar="HOST:PORT",
                       help=f"the gateway's HTTP (admin API) address (default: {HTTP_ADDR})")
    flags.add_argument("--as", dest="as_user", metavar="NAME:PASSWORD",
                       help="credentials, with --auth (or env LIGHTGATE_AUTH)")
    clients = sub.add_parser("clients", help="list or disconnect the MQTT clients of a "
                             "gateway (its admin API)")
    ops = clients.add_subparsers(dest="clients_op", required=True)
    listing = ops.add_parser("list", parents=[flags], help="the connected clients, a table")
    listing.add_argument("--json", action="store_true",
                         help="one JSON object a client, for machines")
    kick = ops.add_parser("kick", parents=[flags], help="disconnect a client (MQTT 5: "
                          "reason 0x98, administrative action); its session stays")
    kick.add_argument("client_id")
    clients.set_defaults(func=lambda args: run(args, credentials(args)))


def run(args: argparse.Namespace, creds: dict[str, str]) -> int:
    auth = (creds["username"], creds["password"]) if creds else None
    with httpx.Client(base_url=f"http://{args.http}", auth=auth, timeout=10) as http:
        api = AdminApi(http, args.http, auth[0] if auth else None)
        if args.clients_op == "kick":
            api.kick(args.client_id)
            print(f"kicked {args.client_id}")
        elif args.json:
            for row in api.clients():
                print(json.dumps(row))
        else:
            print(table(api.clients()), end="")
    return 0


class AdminApi:
    """The few requests the command makes, each failure said in one line."""

    def __init__(self, http: httpx.Client, addr: str, user: str | None) -> None:
        self.http = http
        self.addr = addr
        self.user = user

    def clients(self) -> list[dict[str, Any]]:
        """Every connected client, page after page (bounded by the total the first
        page says, and a page that comes back empty)."""
        rows: list[dict[str, Any]] = []
        total = None
        while total is None or len(rows) < total:
            page = self._call("GET", "/api/v1/clients",
                              params={"limit": PAGE, "offset": len(rows)}).json()
            rows += page["items"]
            total = page["total"] if total is None else total
            if not page["items"]:
                break
        return rows

    def kick(self, client_id: str) -> None:
        res = self._call("POST", f"/api/v1/clients/{quote(client_id, safe='')}/kick",
                         missing=f"no client {client_id!r} is connected to the gateway "
                                 f"at {self.addr}")
        if res.status_code == 409:
            raise CommandError(f"client {client_id!r} is not connected (its session is "
                               "kept)")

    def _call(self, method: str, path: str, *, missing: str | None = None,
              params: dict[str, Any] | None = None) -> httpx.Response:
        try:
            res = self.http.request(method, path, params=params)
        except httpx.HTTPError as exc:
            raise CommandError(f"cannot reach the admin API at http://{self.addr} ({exc}); "
                               "give the gateway's HTTP HOST:PORT with --http") from None
        if res.status_code == 401:
            said = (f"the admin API refused the credentials of {self.user!r}" if self.user
                    else "the admin API needs credentials")
            raise CommandError(f"{said}: give a user's with --as NAME:PASSWORD or "
                               "LIGHTGATE_AUTH")
        if res.status_code == 404 and missing is not None:
            raise CommandError(missing)
        if res.status_code >= 400 and res.status_code != 409:
            raise CommandError(f"the admin API at http://{self.addr} answered "
                               f"{res.status_code}: {_error(res)}")
        return res


def _error(res: httpx.Response) -> str:
    try:
        return str(res.json().get("error", res.text))
    except ValueError:
        return res.text[:200]


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a table with a header line, columns as wide as their widest cell."""
    cells = [[title for title, _ in COLUMNS]]
    for row in rows:
        cells.append([_cell(key, row.get(key)) for _, key in COLUMNS])
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    return "".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
                   + "\n" for line in cells)


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key == "connected_since":
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(value))
    return str(value)
