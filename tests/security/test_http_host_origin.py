"""The HTTP API without --auth (the default, on loopback) against what a web page on
another site can make a browser send: a cross-site form POST (Origin of that site) and
DNS rebinding (Host of that site's name). Real `lightgate serve` and `lightgate store`,
requests written as a browser would send them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import Server
from tests.mqtt.paho_client import Client


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(tmp_path_factory.mktemp("host-origin") / "data",
               "--http-allowed-hosts", "gw.example.net, other.example").start()
    yield s
    assert s.stop() == 0, s.logs()[-3000:]


def call(srv: Server, method: str, path: str, **headers: str) -> httpx.Response:
    url = f"http://{srv.addrs['http']}{path}"
    return httpx.request(method, url, headers=headers, timeout=10,
                         data={"x": "1"} if method == "POST" else None)


def test_a_cross_site_form_post_kicks_no_one(srv: Server) -> None:
    victim = Client(srv.port, "victim")
    try:
        port = srv.addrs["http"].rsplit(":", 1)[1]
        for origin in ("http://evil.example", "null", f"http://127.0.0.1:{int(port) + 1}",
                       f"https://127.0.0.1:{port}"):
            r = call(srv, "POST", "/api/v1/clients/victim/kick", Origin=origin)
            assert r.status_code == 403, (origin, r.text)
            assert "another site" in r.json()["error"]
        r = call(srv, "DELETE", "/api/v1/retained/a", Origin="http://evil.example")
        assert r.status_code == 403
        # Still connected: a round trip works and the session is on the clients list.
        victim.subscribe("still/here", 1)
        victim.publish("still/here", b"yes", 1)
        assert [m.payload for m in victim.expect(1)] == [b"yes"]
        clients = call(srv, "GET", "/api/v1/clients").json()["items"]
        assert "victim" in [c["client_id"] for c in clients]
        # The dashboard's own requests (same origin) and scripts (no Origin) still change.
        r = call(srv, "POST", "/api/v1/clients/victim/kick",
                 Origin=f"http://{srv.addrs['http']}")
        assert r.status_code == 200 and r.json() == {"kicked": "victim"}
    finally:
        victim.disconnect()
    other = Client(srv.port, "kicked-by-curl")
    try:
        assert call(srv, "POST", "/api/v1/clients/kicked-by-curl/kick").status_code == 200
    finally:
        other.disconnect()


@pytest.mark.parametrize("host", ["rebind.attacker.example", "rebind.attacker.example:18083",
                                  "localhost.attacker.example", "127.0.0.1.nip.io"])
def test_a_rebinding_host_reads_nothing(srv: Server, host: str) -> None:
    c = Client(srv.port, "retainer")
    c.publish("home/door/code", b"4711", 1, retain=True)
    c.disconnect()
    for path in ("/api/v1/retained", "/api/v1/messages?filter=%23", "/", "/api/v1/overview"):
        r = call(srv, "GET", path, Host=host)
        assert r.status_code == 403, (path, r.text)
        assert b"4711" not in r.content and "--http-allowed-hosts" in r.json()["error"]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "LOCALHOST:1", "[::1]:80",
                                  "dash.localhost", "192.0.2.7:18083", "gw.example.net",
                                  "other.example:443"])
def test_loopback_ip_addresses_and_allowed_names_are_served(srv: Server, host: str) -> None:
    r = call(srv, "GET", "/api/v1/retained", Host=host)
    assert r.status_code == 200, r.text


def test_health_and_metrics_answer_any_host(srv: Server) -> None:
    for path in ("/healthz", "/metrics"):
        assert call(srv, "GET", path, Host="gateway-1").status_code == 200


def test_a_store_node_checks_the_same(tmp_path: Path) -> None:
    store = Server(tmp_path / "store", command="store").start()
    try:
        assert call(store, "GET", "/api/v1/topics", Host="rebind.attacker.example"
                    ).status_code == 403
        assert call(store, "GET", "/api/v1/topics").status_code == 200
        assert call(store, "GET", "/healthz", Host="store-0.store").status_code == 200
    finally:
        assert store.stop() == 0, store.logs()[-2000:]
