"""The admin HTTP API and /metrics against a real `lightgate serve`."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.mqtt.paho_client import Client


def call(srv, path: str, method: str = "GET") -> tuple[int, object]:
    req = urllib.request.Request(f"http://{srv.addrs['http']}{path}", method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            body = resp.read()
            status = resp.status
            ctype = resp.headers.get("content-type", "")
    except urllib.error.HTTPError as err:
        body, status, ctype = err.read(), err.code, err.headers.get("content-type", "")
    return status, (json.loads(body) if "json" in ctype else body.decode())


@pytest.fixture
def busy(server):
    """A server with a persistent client, a subscriber, retained and live messages."""
    sub = Client(server.port, "ops-sub", clean=False)
    sub.subscribe("ops/+/t", 1)
    pub = Client(server.port, "ops-pub")
    pub.publish("ops/a/t", b"hello", 1)
    pub.publish("ops/state", b"on", 1, retain=True)
    sub.expect(1)
    yield server, sub, pub
    for c in (sub, pub):
        c.disconnect()


def test_healthz_and_config(busy) -> None:
    srv, *_ = busy
    assert call(srv, "/healthz") == (200, {"status": "ok"})
    status, cfg = call(srv, "/api/v1/config")
    assert status == 200 and cfg["gateway"]["max_inflight"] == 32
    assert cfg["store"]["flush"] == "async"


def test_clients_list_filter_inspect_and_kick(busy) -> None:
    srv, sub, pub = busy
    status, page = call(srv, "/api/v1/clients?q=ops-")
    assert status == 200 and page["total"] == 2
    assert {r["client_id"] for r in page["items"]} == {"ops-sub", "ops-pub"}
    status, page = call(srv, "/api/v1/clients?q=ops-&limit=1&offset=1")
    assert len(page["items"]) == 1 and page["total"] == 2
    status, one = call(srv, "/api/v1/clients/ops-sub")
    assert status == 200 and one["subscriptions"][0]["filter"] == "ops/+/t"
    assert one["persistent"] is True and one["connected"] is True
    assert call(srv, "/api/v1/clients/nobody")[0] == 404
    assert call(srv, "/api/v1/clients?limit=x")[0] == 400
    assert call(srv, "/api/v1/clients?limit=-1")[0] == 400
    status, res = call(srv, "/api/v1/clients/ops-pub/kick", "POST")
    assert status == 200 and res == {"kicked": "ops-pub"}
    assert pub.disconnected.wait(5)
    assert call(srv, "/api/v1/clients/nobody/kick", "POST")[0] == 404


def test_sessions_subscriptions_topics_lag(busy) -> None:
    srv, sub, _ = busy
    status, page = call(srv, "/api/v1/sessions?q=ops-sub")
    assert status == 200 and page["items"][0]["client_id"] == "ops-sub"
    status, page = call(srv, "/api/v1/subscriptions?q=ops/")
    assert page["items"] == [{"client_id": "ops-sub", "filter": "ops/+/t", "qos": 1,
                              "queue": "ops/+/t", "shared": False}]
    assert call(srv, "/api/v1/topics")[0] == 200
    status, page = call(srv, "/api/v1/lag?q=ops/")
    row = next(r for r in page["items"] if r["reader"] == "mqtt:ops-sub")
    assert row["lag"] == 0 and row["end"] == row["offset"] == 1


def test_retained_list_and_delete(busy) -> None:
    srv, *_ = busy
    status, page = call(srv, "/api/v1/retained?q=ops/")
    assert page["items"][0]["topic"] == "ops/state" and page["items"][0]["body"] == "on"
    assert call(srv, "/api/v1/retained/ops/state", "DELETE") == (200, {"deleted": "ops/state"})
    assert call(srv, "/api/v1/retained/ops/state", "DELETE")[0] == 404
    assert call(srv, "/api/v1/retained?q=ops/")[1]["total"] == 0


def test_message_lookup_traces_where_it_went(busy) -> None:
    srv, *_ = busy
    status, page = call(srv, "/api/v1/queues?prefix=ops/a/t")
    assert status == 200
    # The id of the first message on ops/a/t: found through the store's queue listing.
    from lightgate import Consumer

    c = Consumer(srv.native, "ops-trace", "ops")
    try:
        [m] = [m for m in c.poll(timeout=2) if m.body == b"hello"]
    finally:
        c.close()
    status, msg = call(srv, f"/api/v1/messages/{m.msg_id}")
    assert status == 200 and msg["body"] == "hello" and msg["topic"] == "ops/a/t"
    assert {"queue": "ops/+/t", "offset": 0} in msg["queues"]
    assert {"client_id": "ops-sub", "queue": "ops/+/t", "offset": 0} in msg["delivered_to"]
    assert call(srv, "/api/v1/messages/00000000DEADBEEF")[0] == 404
    assert call(srv, "/api/v1/messages/nothex")[0] == 404


def test_runtime_and_unknown_path(busy) -> None:
    srv, *_ = busy
    status, rt = call(srv, "/api/v1/runtime")
    assert status == 200 and rt["connections"] >= 2 and rt["tasks"] > 0
    assert call(srv, "/api/v1/nothing") == (404, {"error": "Not Found"})


def test_metrics_parse_with_prometheus_client(busy) -> None:
    srv, *_ = busy
    status, text = call(srv, "/metrics")
    assert status == 200
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("lightgate_connections", "lightgate_sessions", "lightgate_subscriptions",
                 "lightgate_messages_received", "lightgate_messages_sent",
                 "lightgate_bytes_received", "lightgate_store_append_latency_seconds",
                 "lightgate_commitlog_bytes", "lightgate_commitlog_segments",
                 "lightgate_dispatch_lag_bytes", "lightgate_cache_hit_ratio",
                 "lightgate_notify_events", "lightgate_inflight",
                 "lightgate_messages_dropped", "lightgate_messages_expired"):
        assert name in fams, name
    value = {(s.name, tuple(sorted(s.labels.items()))): s.value
             for f in fams.values() for s in f.samples}
    assert value[("lightgate_connections", ())] >= 2
    assert value[("lightgate_messages_received_total", (("qos", "1"),))] >= 2
    assert value[("lightgate_store_append_latency_seconds_count", ())] >= 2
    assert value[("lightgate_commitlog_bytes", ())] > 0
