"""The admin HTTP API with auth on: Basic or a login cookie; rights per method and path."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import Server
from tests.security.helpers import ADMIN, add_user, allow, auth_server


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = auth_server(tmp_path_factory.mktemp("http-auth"))
    add_user(s, "viewer", "viewer-pw")
    allow(s, "viewer", "Cluster", "GET")
    add_user(s, "nobody", "nobody-pw")
    yield s
    assert s.stop() == 0, s.logs()[-3000:]


def url(srv: Server, path: str) -> str:
    return f"http://{srv.addrs['http']}{path}"


def test_open_paths_stay_open(srv: Server) -> None:
    assert httpx.get(url(srv, "/healthz")).json() == {"status": "ok"}
    assert httpx.get(url(srv, "/metrics")).status_code == 200
    assert httpx.get(url(srv, "/")).status_code == 200  # the dashboard page (it logs in)
    assert httpx.get(url(srv, "/api/v1/whoami")).json() == {"auth": True, "user": None,
                                                            "super": False}


def test_api_needs_credentials_and_rights(srv: Server) -> None:
    r = httpx.get(url(srv, "/api/v1/clients"))
    assert r.status_code == 401 and r.json() == {"error": "authentication required"}
    assert httpx.get(url(srv, "/api/v1/clients"), auth=("viewer", "bad")).status_code == 401
    assert httpx.get(url(srv, "/api/v1/clients"), auth=("viewer", "viewer-pw")).status_code == 200
    assert httpx.get(url(srv, "/api/v1/clients"), auth=("nobody", "nobody-pw")).status_code == 403
    # changes need Cluster UPDATE, users and ACL a Super user
    kick = httpx.post(url(srv, "/api/v1/clients/x/kick"), auth=("viewer", "viewer-pw"))
    assert kick.status_code == 403 and "UPDATE" in kick.json()["error"]
    assert httpx.get(url(srv, "/api/v1/users"), auth=("viewer", "viewer-pw")).status_code == 403
    assert httpx.get(url(srv, "/api/v1/users"), auth=ADMIN).status_code == 200
    assert httpx.post(url(srv, "/api/v1/clients/none/kick"), auth=ADMIN).status_code == 404


def test_login_cookie_session(srv: Server) -> None:
    with httpx.Client(base_url=f"http://{srv.addrs['http']}") as web:
        assert web.post("/api/v1/login", json={"username": "viewer", "password": "x"}
                        ).status_code == 401
        r = web.post("/api/v1/login", json={"username": "viewer", "password": "viewer-pw"})
        assert r.status_code == 200 and r.json()["user"] == "viewer"
        assert "httponly" in r.headers["set-cookie"].lower()
        assert web.get("/api/v1/whoami").json() == {"auth": True, "user": "viewer",
                                                    "super": False}
        assert web.get("/api/v1/overview").status_code == 200
        web.post("/api/v1/logout")
        assert web.get("/api/v1/overview").status_code == 401


def test_login_body_is_bounded(srv: Server) -> None:
    """Login is open to anyone: a huge body is refused as it arrives, not buffered."""
    big = b'{"username":"' + b"x" * (8 << 20) + b'"}'
    r = httpx.post(url(srv, "/api/v1/login"), content=big,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "larger than" in r.json()["error"]

    def chunks():  # no Content-Length: the limit must hold while streaming too
        yield b'{"username":"'
        for _ in range(128):
            yield b"y" * 65536

    r = httpx.post(url(srv, "/api/v1/login"), content=chunks())
    assert r.status_code == 413
    ok = httpx.post(url(srv, "/api/v1/login"), json={"username": "viewer",
                                                       "password": "viewer-pw"})
    assert ok.status_code == 200


def test_users_and_acl_endpoints(srv: Server) -> None:
    with httpx.Client(base_url=f"http://{srv.addrs['http']}", auth=ADMIN) as api:
        r = api.post("/api/v1/users", json={"name": "frank", "password": "frank-pw"})
        assert r.status_code == 201 and r.json()["enabled"] is True
        assert "password" not in r.json()
        assert api.post("/api/v1/users", json={"name": "frank", "password": "x"}
                        ).status_code == 409
        assert api.post("/api/v1/users", json={"name": "*", "password": "x"}).status_code == 400
        r = api.post("/api/v1/acl", json={"user": "frank", "resource": "Topic:lab/",
                                          "match": "prefixed", "actions": ["PUB", "SUB"]})
        assert r.status_code == 201, r.text
        assert api.post("/api/v1/acl", json={"user": "ghost", "resource": "Cluster",
                                             "actions": "GET"}).status_code == 404
        assert api.post("/api/v1/acl", json={"user": "frank", "resource": "Queue:x",
                                             "actions": "GET"}).status_code == 400
        policies = api.get("/api/v1/acl", params={"user": "frank"}).json()["items"]
        assert policies == [{"user": "frank", "resource": "Topic:lab/", "match": "prefixed",
                             "actions": ["PUB", "SUB"], "ip": "", "decision": "allow"}]
        assert api.patch("/api/v1/users/frank", json={"enabled": False}).json()["enabled"] \
            is False
        assert httpx.get(url(srv, "/api/v1/clients"), auth=("frank", "frank-pw")
                         ).status_code == 401  # disabled
        assert api.delete("/api/v1/acl", params={"user": "frank"}).json() == {"deleted": 1}
        assert api.delete("/api/v1/users/frank").status_code == 200
        assert api.delete("/api/v1/users/frank").status_code == 404
        names = [u["name"] for u in api.get("/api/v1/users").json()["items"]]
        assert "frank" not in names and "admin" in names


def test_auth_failures_are_counted_in_metrics(srv: Server) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    httpx.get(url(srv, "/api/v1/clients"), auth=("viewer", "wrong"))
    text = httpx.get(url(srv, "/metrics")).text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert values["lightgate_auth_failures_total"] >= 1
    assert "lightgate_authorization_denials_total" in values


def test_audit_lines_go_to_their_own_file(tmp_path) -> None:
    audit = tmp_path / "audit.log"
    s = auth_server(tmp_path, "--audit-log", str(audit))
    try:
        assert httpx.get(url(s, "/api/v1/clients"), auth=ADMIN).status_code == 200
        assert httpx.get(url(s, "/api/v1/clients"), auth=("admin", "no")).status_code == 401
        lines = audit.read_text().splitlines()
        assert any("[AUTHENTICATION] user=admin" in x and "via=http result=success" in x
                   for x in lines)
        assert any("result=failure" in x for x in lines)
        assert "[AUTHENTICATION]" not in s.logs()
    finally:
        assert s.stop() == 0
