"""GET /api/v1/messages against real servers: a filter's stored messages page by page,
every field, clear 400s, the cut flag after retention, the caller's rights with --auth,
and the same answers from a gateway in separated mode."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from tests.conftest import Server
from tests.mqtt.paho_client import Client
from tests.security.helpers import add_user, allow, auth_server


def get(srv: Server, auth: tuple[str, str] | None = None, **params: Any) -> httpx.Response:
    return httpx.get(f"http://{srv.addrs['http']}/api/v1/messages?{urlencode(params)}",
                     auth=auth, timeout=10)


def pages(srv: Server, auth: tuple[str, str] | None = None, **params: Any
          ) -> tuple[list[dict], list[dict]]:
    """Every message of the history, and every page's answer."""
    answers = [get(srv, auth, **params).json()]
    while answers[-1]["next"]:
        answers.append(get(srv, auth, **{**params, "cursor": answers[-1]["next"]}).json())
    return [m for a in answers for m in a["messages"]], answers


def publish_plant(port: int) -> int:
    """Eight messages on plant/+/temp (and one elsewhere); the store time after four."""
    dev = Client(port, "boiler", version=5)
    props = Properties(PacketTypes.PUBLISH)
    props.UserProperty = [("unit", "C")]
    mark = 0
    for i in range(8):
        dev.publish(f"plant/{i % 2}/temp", b"%d" % (60 + i), qos=1, properties=props)
        if i == 3:
            time.sleep(0.02)
            mark = int(time.time() * 1000)
            time.sleep(0.02)
    dev.publish("plant/1/raw", b"\x00\xff\x10", qos=0, retain=True)
    dev.publish("other/x", b"no", qos=1)
    dev.disconnect()
    return mark


def test_pages_of_a_filter_in_store_order(server: Server) -> None:
    mark = publish_plant(server.port)
    msgs, answers = pages(server, filter="plant/+/temp", limit=3)
    assert [m["payload"] for m in msgs] == [str(60 + i) for i in range(8)]
    assert len(answers) >= 3 and all(len(a["messages"]) <= 3 for a in answers)
    assert answers[-1]["next"] is None and not any(a["cut"] for a in answers)
    first = msgs[0]
    assert first["topic"] == "plant/0/temp" and first["qos"] == 1 and not first["retain"]
    assert first["client_id"] == "boiler" and first["offset"] == 0
    assert first["payload_base64"] is False and first["time"] > 1_700_000_000_000
    assert first["properties"]["user_property"] == [["unit", "C"]]
    assert len(first["msg_id"]) == 16
    assert [m["offset"] for m in msgs if m["topic"] == "plant/1/temp"] == [0, 1, 2, 3]

    raw = get(server, filter="plant/1/raw").json()["messages"]
    assert raw[0]["payload_base64"] and base64.b64decode(raw[0]["payload"]) == b"\x00\xff\x10"
    assert raw[0]["retain"] is True
    later, _ = pages(server, filter="plant/#", since=str(mark))
    assert [m["payload"] for m in later][:4] == ["64", "65", "66", "67"]
    before, _ = pages(server, filter="plant/#", since="-1h", until=str(mark))
    assert [m["payload"] for m in before] == ["60", "61", "62", "63"]
    last, _ = pages(server, filter="#", since="last")
    assert {m["topic"]: m["payload"] for m in last} == {
        "plant/0/temp": "66", "plant/1/temp": "67", "plant/1/raw": raw[0]["payload"],
        "other/x": "no"}


@pytest.mark.parametrize(("params", "why"), [
    ({}, "filter"),
    ({"filter": "a/#/b"}, "'#' must be a whole last level"),
    ({"filter": "a/#", "since": "yesterday"}, "is not a time"),
    ({"filter": "a/#", "since": "2999-01-01T00:00:00Z"}, "in the future"),
    ({"filter": "a/#", "until": "soon"}, "is not a time"),
    ({"filter": "a/#", "limit": "0"}, "limit must be between 1 and 1000"),
    ({"filter": "a/#", "limit": "1001"}, "limit must be between 1 and 1000"),
    ({"filter": "a/#", "limit": "ten"}, "limit must be an integer"),
    ({"filter": "a/#", "cursor": "bm9wZQ"}, "not a history cursor"),
    ({"filter": "a/#", "until": "earliest"}, "is a start, not an end"),
])
def test_bad_requests_say_what_is_wrong(shared_server: Server, params: dict, why: str) -> None:
    r = get(shared_server, **params)
    assert r.status_code == 400 and why in r.json()["error"], r.text


@pytest.mark.parametrize(("query", "why"), [
    # Typed into a URL as is: `#` starts the fragment (not sent), `+` is a space.
    ("filter=plant/#", "percent-encode # as %23 and + as %2B"),
    ("filter=#", "percent-encode # as %23 and + as %2B"),
    ("filter=", "percent-encode # as %23 and + as %2B"),
    ("filter=plant/+/temp", "percent-encode # as %23 and + as %2B"),
    ("filter=plant%2F%2B/x+y", "percent-encode # as %23 and + as %2B"),
    ("filter=a%2F%23&until=earliest", "until: 'earliest' is a start"),
    ("filter=a%2F%23&until=last", "until: 'last' is a start"),
    ("filter=a%2F%23&cursor=abc", "cursor: not a history cursor this store gave out"),
    ("filter=a%2F%23&cursor=bm9wZQ.bm9wZQ", "cursor: not a history cursor this store gave"),
])
def test_a_url_typed_by_hand_gets_a_400_that_says_how_to_write_it(
        shared_server: Server, query: str, why: str) -> None:
    r = httpx.get(f"http://{shared_server.addrs['http']}/api/v1/messages?{query}", timeout=10)
    assert r.status_code == 400 and why in r.json()["error"], r.text
    error = r.json()["error"]
    assert "earliest, last" not in error or "until" not in query  # no start offered as end
    for internals in ("padding", "orjson", "JSONDecodeError", "unexpected character",
                      "Traceback"):
        assert internals not in error


def test_percent_encoded_filters_and_a_topic_ending_in_a_slash_are_read(
        shared_server: Server) -> None:
    dev = Client(shared_server.port, "slashes", version=5)
    dev.publish("slash/", b"empty last level", qos=1)
    dev.publish("slash/a b", b"a space", qos=1)
    dev.disconnect()
    base = f"http://{shared_server.addrs['http']}/api/v1/messages"
    for query, want in (("filter=slash%2F%23", 2), ("filter=slash%2F%2B", 2),
                        ("filter=slash%2F", 1), ("filter=slash/%2F", 0),
                        ("filter=slash/a%20b", 1)):  # a space of its own: %20
        r = httpx.get(f"{base}?{query}", timeout=10)
        assert r.status_code == 200, (query, r.text)
        assert len(r.json()["messages"]) == want, (query, r.json())


def test_retention_cut_is_reported(tmp_path) -> None:
    srv = Server(tmp_path / "data", "--segment-size", "65536", "--retention-bytes", "131072",
                 "--retention-check-s", "0.2").start()
    try:
        pub = Client(srv.port, "filler")
        for i in range(3):
            pub.publish("kept/t", b"old%d" % i, qos=1)
        for _ in range(400):
            pub.publish("kept/t", b"f" * 1000, qos=1)
        assert srv.wait_log("retention: segment 00000000000000000000 removed"), srv.logs()[-2000:]
        pub.disconnect()
        answer = get(srv, filter="kept/t", limit=5).json()
        assert answer["cut"] is True and answer["messages"][0]["offset"] > 0
        assert all(m["payload"] != "old0" for m in answer["messages"])
        newest = get(srv, filter="kept/t", since="last").json()["messages"][0]["time"]
        assert get(srv, filter="kept/t", since=str(newest)).json()["cut"] is False
    finally:
        assert srv.stop() == 0, srv.logs()[-3000:]


@pytest.fixture(scope="module")
def auth_srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = auth_server(tmp_path_factory.mktemp("history-http"))
    add_user(s, "ops", "ops-pw")
    allow(s, "ops", "Cluster", "GET")
    allow(s, "ops", "Topic:plant/#", "SUB")
    allow(s, "ops", "Topic:plant/1/temp", "SUB", deny=True)
    add_user(s, "boiler", "pw")
    allow(s, "boiler", "Topic:#", "PUB")
    dev = Client(s.port, "boiler", username="boiler", password="pw")
    for i in range(6):
        dev.publish(f"plant/{i % 2}/temp", b"%d" % i, qos=1)
    dev.disconnect()
    yield s
    assert s.stop() == 0, s.logs()[-3000:]


def test_the_callers_rights_decide(auth_srv: Server) -> None:
    ops = ("ops", "ops-pw")
    msgs, _ = pages(auth_srv, ops, filter="plant/+/temp", limit=2)
    assert [m["payload"] for m in msgs] == ["0", "2", "4"]  # plant/1/temp is denied
    r = get(auth_srv, ops, filter="#")
    assert r.status_code == 403 and "needs SUB" in r.json()["error"]
    assert get(auth_srv, ops, filter="plant/1/temp").status_code == 403
    assert get(auth_srv, None, filter="plant/#").status_code == 401
    every, _ = pages(auth_srv, ("admin", "admin-secret"), filter="plant/#")
    assert len(every) == 6


def test_a_separated_gateway_answers_the_same(tmp_path) -> None:
    store = Server(tmp_path / "store", command="store").start()
    gateway = Server(None, "--store", store.native, command="gateway").start()
    try:
        publish_plant(gateway.port)
        msgs, _ = pages(gateway, filter="plant/+/temp", limit=3)
        assert [m["payload"] for m in msgs] == [str(60 + i) for i in range(8)]
        assert get(gateway, filter="a/#", since="soon").status_code == 400
    finally:
        for srv in (gateway, store):
            assert srv.stop() == 0, srv.logs()[-2000:]
