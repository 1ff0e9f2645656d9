"""The admin API's route functions called directly (gateway.admin.GatewayApi): no HTTP
server, no store process; a broker over a store that holds only what a test puts in."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from gateway.admin import GatewayApi
from gateway.broker import Broker, GatewayConfig
from gateway.mqtt import SubscriptionOptions
from gateway.session import Session, Subscription
from store.api import PullResult


@dataclass
class MetaOnlyStore:
    """Enough of store.api.Store for the routes tested here: metadata in a dict."""

    meta: dict[tuple[str, str], Any] = field(default_factory=dict)

    async def meta_get(self, cf: str, key: str) -> Any:
        return self.meta.get((cf, key))

    async def meta_delete(self, cf: str, key: str) -> None:
        self.meta.pop((cf, key), None)

    async def meta_items(self, cf: str, prefix: str = "", limit: int | None = None
                         ) -> list[tuple[str, Any]]:
        return sorted((k, v) for (c, k), v in self.meta.items()
                      if c == cf and k.startswith(prefix))

    async def pull(self, queue: str, offset: int, max_count: int = 32) -> PullResult:
        raise AssertionError("not read by these routes")


class Device:
    """A connected client, as the broker sees it (gateway.session.Client)."""

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.keepalive = 30
        self.connected_at = 1.0
        self.kicked: list[str] = []

    def kick(self, why: str = "kicked by an operator", not_authorized: bool = False) -> None:
        self.kicked.append(why)


def request(path_params: dict[str, str] | None = None, query: str = "") -> Request:
    return Request({"type": "http", "method": "GET", "path": "/", "headers": [],
                    "query_string": query.encode(), "path_params": path_params or {}})


def body(resp: JSONResponse) -> Any:
    return json.loads(bytes(resp.body))


def api_with(*sessions: Session, store: MetaOnlyStore | None = None) -> GatewayApi:
    broker = Broker(store or MetaOnlyStore(), GatewayConfig(max_inflight=7))  # type: ignore[arg-type]
    for s in sessions:
        broker.sessions[s.client_id] = s
    return GatewayApi(broker)


async def test_clients_lists_the_connected_and_kick_reaches_the_connection() -> None:
    online = Session("dev-1", persistent=False, version=5)
    online.connection = device = Device("10.0.0.7:40000")  # type: ignore[assignment]
    online.add_subscription(Subscription("a/+", SubscriptionOptions(1)))
    offline = Session("dev-2", persistent=True, expiry=60)
    api = api_with(online, offline)

    listed = body(await api.clients(request()))
    assert [c["client_id"] for c in listed["items"]] == ["dev-1"]
    assert listed["items"][0] | {"subscriptions": 1, "keepalive": 30,
                                 "protocol_name": "5.0"} == listed["items"][0]

    assert body(await api.kick(request({"client_id": "dev-1"}))) == {"kicked": "dev-1"}
    assert device.kicked == ["kicked by an operator"]
    with pytest.raises(HTTPException) as offline_kick:
        await api.kick(request({"client_id": "dev-2"}))
    assert offline_kick.value.status_code == 409
    with pytest.raises(HTTPException) as unknown:
        await api.client(request({"client_id": "nobody"}))
    assert unknown.value.status_code == 404


async def test_retained_delete_and_config() -> None:
    store = MetaOnlyStore({("retained", "lamp/1"): {"body": b"on", "qos": 1}})
    api = api_with(store=store)

    with pytest.raises(HTTPException) as missing:
        await api.retained_delete(request({"topic": "lamp/2"}))
    assert missing.value.status_code == 404
    assert body(await api.retained_delete(request({"topic": "lamp/1"}))) == {
        "deleted": "lamp/1"}
    assert store.meta == {}

    config = body(await api.config(request()))
    assert config["gateway"]["max_inflight"] == 7 and "store" not in config
