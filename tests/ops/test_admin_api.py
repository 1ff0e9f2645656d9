"""The admin HTTP API and /metrics against a real `lightgate serve`."""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lightgate import Consumer, Producer
from tests.conftest import Server
from tests.mqtt.paho_client import Client


def call(srv: Server, path: str, method: str = "GET") -> tuple[int, Any]:
    req = urllib.request.Request(f"http://{srv.addrs['http']}{path}", method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            body, status = resp.read(), resp.status
            ctype = resp.headers.get("content-type", "")
    except urllib.error.HTTPError as err:
        body, status, ctype = err.read(), err.code, err.headers.get("content-type", "")
    return status, (json.loads(body) if "json" in ctype else body.decode())


def wait_for(fn: Any, timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


@pytest.fixture
def busy(server: Server) -> Iterator[tuple[Server, Client, Client]]:
    """A server with a persistent subscriber, a publisher, retained and live messages."""
    sub = Client(server.port, "ops-sub", clean=False)
    sub.subscribe("ops/+/t", 1)
    pub = Client(server.port, "ops-pub")
    pub.publish("ops/a/t", b"hello", 1)
    pub.publish("ops/state", b"on", 1, retain=True)
    sub.expect(1)
    # Its acknowledgement is in the store (a session the native plane carries reports
    # where it stands when a batch completes: a moment after the PUBACK).
    deadline = time.monotonic() + 10
    while next(r for r in call(server, "/api/v1/lag?q=ops/")[1]["items"]
               if r["reader"] == "mqtt:ops-sub")["lag"]:
        assert time.monotonic() < deadline, "the subscriber's acknowledgement never stored"
        time.sleep(0.05)
    yield server, sub, pub
    for c in (sub, pub):
        c.disconnect()


def test_healthz_config_and_store_stats(busy) -> None:
    srv, *_ = busy
    assert call(srv, "/healthz") == (200, {"status": "ok"})
    status, cfg = call(srv, "/api/v1/config")
    assert status == 200 and cfg["gateway"]["max_inflight"] == 32
    assert cfg["store"]["flush"] == "async"
    status, st = call(srv, "/api/v1/store/stats")
    assert status == 200 and st["commitlog"]["messages"] >= 2 and st["commitlog"]["segments"]


def test_clients_list_filter_inspect_and_kick(busy) -> None:
    srv, sub, pub = busy
    status, page = call(srv, "/api/v1/clients?q=ops-")
    assert status == 200 and page["total"] == 2
    assert {r["client_id"] for r in page["items"]} == {"ops-sub", "ops-pub"}
    row = next(r for r in page["items"] if r["client_id"] == "ops-sub")
    assert row["protocol_name"] == "3.1.1" and row["peer"].startswith("127.0.0.1:")
    assert row["connected_since"] <= time.time()
    _, page = call(srv, "/api/v1/clients?q=ops-&limit=1&offset=1")
    assert len(page["items"]) == 1 and page["total"] == 2
    assert call(srv, "/api/v1/clients?q=ops-&offset=5")[1]["items"] == []
    status, one = call(srv, "/api/v1/clients/ops-sub")
    assert status == 200 and one["subscriptions"][0]["filter"] == "ops/+/t"
    assert one["subscriptions"][0]["cursor"] == 1 and one["inflight"] == []
    assert one["persistent"] is True and one["connected"] is True
    status, res = call(srv, "/api/v1/clients/ops-pub/kick", "POST")
    assert status == 200 and res == {"kicked": "ops-pub"}
    assert pub.disconnected.wait(5)
    assert wait_for(lambda: call(srv, "/api/v1/clients?q=ops-pub")[1]["total"] == 0)


@pytest.mark.parametrize("path, method, status", [
    ("/api/v1/clients/nobody", "GET", 404),
    ("/api/v1/clients/nobody/kick", "POST", 404),
    ("/api/v1/clients?limit=x", "GET", 400),
    ("/api/v1/clients?limit=-1", "GET", 400),
    ("/api/v1/sessions?offset=1.5", "GET", 400),
    ("/api/v1/subscriptions?offset=-3", "GET", 400),
    ("/api/v1/retained?limit=ten", "GET", 400),
    ("/api/v1/lag?limit=%20", "GET", 400),
    ("/api/v1/topics?offset=x", "GET", 400),
    ("/api/v1/queues?limit=x", "GET", 400),
    ("/api/v1/messages/nothex", "GET", 400),
    ("/api/v1/messages/00000000DEADBEEF", "GET", 404),
    ("/api/v1/messages/0000000000000001", "GET", 404),  # inside a record, not at its start
    ("/api/v1/retained/no/such/topic", "DELETE", 404),
    ("/api/v1/retained/ops/state", "GET", 405),
    ("/api/v1/clients/ops-sub/kick", "PUT", 405),
    ("/api/v1/nothing", "GET", 404),
    ("/static/nothing.js", "GET", 404),
])
def test_errors_are_json(shared_server: Server, path: str, method: str, status: int) -> None:
    got, body = call(shared_server, path, method)
    assert got == status and isinstance(body, dict) and body["error"], (path, body)


def test_offline_persistent_session(busy) -> None:
    srv, sub, _ = busy
    sub.disconnect()
    rows = wait_for(lambda: [r for r in call(srv, "/api/v1/sessions?q=ops-sub")[1]["items"]
                             if not r["connected"]])
    assert rows and rows[0]["persistent"] and rows[0]["disconnected_at"]
    assert call(srv, "/api/v1/clients?q=ops-sub")[1]["total"] == 0
    status, one = call(srv, "/api/v1/clients/ops-sub")
    assert status == 200 and one["connected"] is False and one["peer"] is None
    status, err = call(srv, "/api/v1/clients/ops-sub/kick", "POST")
    assert status == 409 and "not connected" in err["error"]


def test_subscriptions_and_lag(busy) -> None:
    srv, sub, pub = busy
    _, page = call(srv, "/api/v1/subscriptions?q=ops/")
    assert page["items"] == [{"client_id": "ops-sub", "filter": "ops/+/t", "qos": 1,
                              "queue": "ops/+/t", "shared": False}]
    assert call(srv, "/api/v1/subscriptions?q=ops-sub")[1]["total"] == 1  # by client id too
    _, page = call(srv, "/api/v1/lag?q=ops/")
    row = next(r for r in page["items"] if r["reader"] == "mqtt:ops-sub")
    assert row["kind"] == "wildcard" and row["lag"] == 0 and row["end"] == row["offset"] == 1
    sub.disconnect()  # offline: what arrives now is lag
    # Only once the server has seen the DISCONNECT: published earlier, a message could
    # still be delivered to it (the two clients' packets race).
    assert wait_for(lambda: [r for r in call(srv, "/api/v1/sessions?q=ops-sub")[1]["items"]
                             if not r["connected"]])
    for i in range(3):
        pub.publish("ops/b/t", b"%d" % i, 1)
    rows = wait_for(lambda: [r for r in call(srv, "/api/v1/lag?q=mqtt:ops-sub")[1]["items"]
                             if r["lag"] == 3])
    assert rows and rows[0]["end"] == 4 and rows[0]["offset"] == 1


def test_topics_with_partitions_and_group_lag(busy) -> None:
    srv, *_ = busy
    p = Producer(srv.native)
    try:
        for i in range(6):
            p.send("billing", b"inv-%d" % i, key=f"k{i}")
    finally:
        p.close()
    c = Consumer(srv.native, group="accounts", topic="billing")
    try:
        got = wait_for(lambda: c.poll(timeout=1.0))
        c.ack(got[0])
    finally:
        c.close()  # commits the ack
    status, page = call(srv, "/api/v1/topics?q=billing")
    assert status == 200 and page["total"] == 1
    [t] = page["items"]
    assert t["topic"] == "billing" and t["partitions"] == 4 and t["messages"] == 6
    assert [q["queue"] for q in t["queues"]] == [f"billing#{i}" for i in range(4)]
    [g] = t["groups"]
    assert g["group"] == "accounts" and 0 <= g["lag"] <= 5
    # Topics created only by devices publishing are listed too (found in the index).
    ops = call(srv, "/api/v1/topics?q=ops")[1]["items"]
    assert [r["topic"] for r in ops] == ["ops"] and ops[0]["messages"] == 2
    _, lag = call(srv, "/api/v1/lag?q=group:accounts")
    assert {r["kind"] for r in lag["items"]} == {"partition", "retry"}
    status, queues = call(srv, "/api/v1/queues?prefix=billing")
    assert status == 200 and {q["kind"] for q in queues["queues"]} == {"partition"}


def test_retained_list_and_delete(busy) -> None:
    srv, _, pub = busy
    pub.publish("ops/bin", b"\xff\x00", 1, retain=True)
    _, page = call(srv, "/api/v1/retained?q=ops/")
    rows = {r["topic"]: r for r in page["items"]}
    assert rows["ops/state"]["body"] == "on" and rows["ops/state"]["body_base64"] is False
    assert base64.b64decode(rows["ops/bin"]["body"]) == b"\xff\x00"
    assert rows["ops/bin"]["body_base64"] is True
    assert call(srv, "/api/v1/retained/ops/state", "DELETE") == (200, {"deleted": "ops/state"})
    assert call(srv, "/api/v1/retained/ops/state", "DELETE")[0] == 404
    assert [r["topic"] for r in call(srv, "/api/v1/retained?q=ops/")[1]["items"]] == ["ops/bin"]


def test_message_lookup_traces_where_it_went(busy) -> None:
    srv, *_ = busy
    c = Consumer(srv.native, "ops-trace", "ops")
    try:
        [m] = [m for m in c.poll(timeout=2) if m.body == b"hello"]
    finally:
        c.close()
    status, msg = call(srv, f"/api/v1/messages/{m.msg_id}")
    assert status == 200 and msg["body"] == "hello" and msg["topic"] == "ops/a/t"
    assert msg["qos"] == 1 and msg["client_id"] == "ops-pub" and msg["store_time"] > 0
    assert {"queue": "ops/+/t", "offset": 0} in msg["queues"]
    assert {"queue": "ops/a/t", "offset": 0} in msg["queues"]
    assert {"client_id": "ops-sub", "queue": "ops/+/t", "offset": 0} in msg["delivered_to"]
    assert call(srv, f"/api/v1/messages/{m.msg_id.lower()}")[0] == 200


def test_alerts_feed_reads_the_wildcard_queue(busy) -> None:
    srv, _, pub = busy
    assert call(srv, "/api/v1/alerts") == (200, {"items": [], "queue": "alerts/#", "end": 0})
    pub.publish("alerts/dev-1", b'{"rule":"overheat"}', 1)  # registered by the first call
    pub.publish("alerts/dev-2", b'{"rule":"flood"}', 1)
    _, feed = call(srv, "/api/v1/alerts")
    assert [a["topic"] for a in feed["items"]] == ["alerts/dev-2", "alerts/dev-1"]
    assert feed["items"][1]["body"] == '{"rule":"overheat"}'
    assert len(feed["items"][0]["msg_id"]) == 16


def test_overview_runtime_and_dashboard_files(busy) -> None:
    srv, *_ = busy
    status, o = call(srv, "/api/v1/overview")
    assert status == 200 and o["connections"] == 2 and o["sessions"] == 2
    assert o["subscriptions"] == 1 and o["messages_in"] >= 2 and o["messages_out"] >= 1
    assert o["store"]["up"] and o["store"]["bytes"] > 0 and o["store"]["dispatch_lag"] >= 0
    status, rt = call(srv, "/api/v1/runtime")
    assert status == 200 and rt["connections"] == 2 and rt["tasks"] > 0 and rt["open_fds"] > 0
    status, html = call(srv, "/")
    assert status == 200 and "<canvas" in html and "/static/app.js" in html
    assert "http" not in html.split("<footer>")[0].replace("http-equiv", "")  # nothing remote
    for name in ("app.js", "chart.js", "history.js", "style.css"):
        assert call(srv, f"/static/{name}")[0] == 200


def test_metrics_parse_with_prometheus_client(busy) -> None:
    srv, *_ = busy
    status, text = call(srv, "/metrics")
    assert status == 200
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("lightgate_connections", "lightgate_sessions", "lightgate_subscriptions",
                 "lightgate_messages_received", "lightgate_messages_sent",
                 "lightgate_bytes_received", "lightgate_bytes_sent",
                 "lightgate_store_append_latency_seconds", "lightgate_commitlog_bytes",
                 "lightgate_commitlog_segments", "lightgate_dispatch_lag_bytes",
                 "lightgate_cache_hit_ratio", "lightgate_notify_events", "lightgate_inflight",
                 "lightgate_messages_dropped", "lightgate_messages_expired",
                 "lightgate_light_queues_active", "lightgate_wildcard_queues",
                 "lightgate_store_up"):
        assert name in fams, name
    # Ours, and the process's own (CPU, memory, descriptors: test_process_metrics.py).
    assert all(name.startswith(("lightgate_", "process_")) for name in fams)
    value = {(s.name, tuple(sorted(s.labels.items()))): s.value
             for f in fams.values() for s in f.samples}
    assert value[("lightgate_connections", ())] == 2
    assert value[("lightgate_subscriptions", ())] == 1
    assert value[("lightgate_messages_received_total", (("qos", "1"),))] >= 2
    assert value[("lightgate_messages_sent_total", (("qos", "1"),))] >= 1
    assert value[("lightgate_store_append_latency_seconds_count", ())] >= 2
    assert value[("lightgate_commitlog_bytes", ())] > 0
    assert value[("lightgate_wildcard_queues", ())] >= 1  # ops/+/t
    assert value[("lightgate_store_up", ())] == 1
    # Where the store's memory goes: the index has memtable data, each cache its bound.
    assert value[("lightgate_store_memory_bytes", (("part", "index_memtables"),))] > 0
    for part, mib in (("index_block_cache", 32), ("metadata_block_cache", 16),
                      ("recent_messages", 32)):
        used = value[("lightgate_store_memory_bytes", (("part", part),))]
        limit = value[("lightgate_store_memory_limit_bytes", (("part", part),))]
        assert limit == mib << 20 and 0 <= used <= limit, part
