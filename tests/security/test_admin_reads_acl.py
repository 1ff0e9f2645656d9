"""Every admin read that hands out a payload decides per topic, as history does: a user
with Cluster GET but no right on secret/# reads none of it by message id, from the
retained list, the alerts feed, or natively by id or key. Real `lightgate serve`, paho
and native clients."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from store import protocol as p
from store.record import Message
from tests.conftest import Server
from tests.mqtt.paho_client import Client
from tests.security.helpers import ADMIN, add_user, allow, auth_server, native

VIEWER = ("viewer", "viewer-pw")


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = auth_server(tmp_path_factory.mktemp("admin-reads"))
    add_user(s, *VIEWER)
    allow(s, "viewer", "Cluster", "GET")
    allow(s, "viewer", "Topic:open/#", "SUB")
    allow(s, "viewer", "Topic:alerts/open", "SUB")
    allow(s, "viewer", "Topic:keyed", "SUB")
    api(s, "/api/v1/alerts", ADMIN)  # the alerts feed indexes alerts/# from here on
    c = Client(s.port, "publisher", username=ADMIN[0], password=ADMIN[1])
    for topic in ("open/x", "secret/keys", "alerts/open", "alerts/secret"):
        c.publish(topic, f"payload of {topic}".encode(), qos=1, retain=True)
    c.disconnect()
    # Messages with a key, one on a topic the viewer may read and one it may not.
    for topic in ("keyed", "hidden"):
        metas, body = p.pack_messages([Message("", f"{topic} by key".encode(), key="k1")])
        native(s, "SEND", {"topic": topic, "messages": metas}, body=body)
    yield s
    assert s.stop() == 0, s.logs()[-3000:]


def api(srv: Server, path: str, auth: tuple[str, str]) -> httpx.Response:
    return httpx.get(f"http://{srv.addrs['http']}{path}", auth=auth, timeout=10)


def _ids(srv: Server) -> dict[str, str]:
    """topic -> msg_id, read as the admin."""
    rows = api(srv, "/api/v1/messages?filter=%23", ADMIN).json()["messages"]
    return {m["topic"]: m["msg_id"] for m in rows}


def test_a_message_by_id_needs_a_right_on_its_topic(srv: Server) -> None:
    ids = _ids(srv)
    assert api(srv, f"/api/v1/messages/{ids['open/x']}", VIEWER).json()["body"] == \
        "payload of open/x"
    r = api(srv, f"/api/v1/messages/{ids['secret/keys']}", VIEWER)
    assert r.status_code == 403, r.text
    assert "secret" not in r.text  # neither its payload nor its topic
    assert api(srv, f"/api/v1/messages/{ids['secret/keys']}", ADMIN).json()["body"] == \
        "payload of secret/keys"


def test_the_retained_list_holds_only_readable_topics(srv: Server) -> None:
    mine = {r["topic"]: r["body"] for r in api(srv, "/api/v1/retained", VIEWER).json()["items"]}
    assert mine == {"open/x": "payload of open/x", "alerts/open": "payload of alerts/open"}
    every = {r["topic"] for r in api(srv, "/api/v1/retained", ADMIN).json()["items"]}
    assert {"secret/keys", "alerts/secret"} <= every


def test_the_alerts_feed_holds_only_readable_topics(srv: Server) -> None:
    assert [r["topic"] for r in api(srv, "/api/v1/alerts", VIEWER).json()["items"]] == \
        ["alerts/open"]
    assert sorted(r["topic"] for r in api(srv, "/api/v1/alerts", ADMIN).json()["items"]) == \
        ["alerts/open", "alerts/secret"]


def _native_bodies(srv: Server, code: str, header: dict[str, Any],
                   creds: tuple[str, str]) -> list[bytes]:
    import trio

    from store.client import NativeClient

    async def call() -> list[bytes]:
        async with NativeClient.open(srv.native, credentials=creds) as client:
            reply, body = await client.request(getattr(p, code), header)
            return [m.body for m in p.unpack_messages(reply["messages"], body)]

    return trio.run(call)


def test_native_get_message_and_find_key_decide_per_topic(srv: Server) -> None:
    ids = _ids(srv)
    assert _native_bodies(srv, "GET_MESSAGE", {"msg_id": ids["open/x"]}, VIEWER) == \
        [b"payload of open/x"]
    with pytest.raises(p.RemoteError) as err:
        native(srv, "GET_MESSAGE", {"msg_id": ids["secret/keys"]}, VIEWER)
    assert err.value.status == 403 and "secret" not in err.value.message
    assert _native_bodies(srv, "GET_MESSAGE", {"msg_id": ids["secret/keys"]}, ADMIN) == \
        [b"payload of secret/keys"]
    assert _native_bodies(srv, "FIND_KEY", {"key": "k1"}, VIEWER) == [b"keyed by key"]
    assert sorted(_native_bodies(srv, "FIND_KEY", {"key": "k1"}, ADMIN)) == \
        [b"hidden by key", b"keyed by key"]
