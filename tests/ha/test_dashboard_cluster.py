"""The gateway's view of the store group: `GET /api/v1/cluster` on the gateway's admin
API (one master row for the embedded store; the group's nodes, asked of the master with
the native CLUSTER request, for `lightgate gateway --store a,b,c`) and the dashboard's
Store panel drawing it, in Debian's headless Chromium."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from store import protocol as p
from store.sdk import Producer
from tests.conftest import Server
from tests.ha.cluster import Group, native_call, wait_for
from tests.ops.browser import browser_page


def gw_cluster(srv: Server) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"http://{srv.addrs['http']}/api/v1/cluster",
                                    timeout=5) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:  # 503 while the group has no master
        return json.loads(exc.read())


def test_embedded_store_is_one_master_row(server: Server) -> None:
    with Producer(server.native) as prod:
        prod.send("dash", b"x")
    view = gw_cluster(server)
    assert view["up"] is True and view["role"] == "master"
    [row] = view["nodes"]
    assert row["addr"] == server.native and row["role"] == "master"
    assert row["replicated_offset"] == row["offset"] == view["log_end"] > 0
    assert row["lag_bytes"] == 0 and row["insync"] is True


@pytest.fixture
def group_and_gateway(tmp_path: Path):
    g = Group(tmp_path, 3, "--replication", "sync", "--min-insync", "2").start()
    gw: Server | None = None
    try:
        m = g.master(20)
        wait_for(lambda: len(g.insync(m)) == 3, 15, "all three in sync")
        gw = Server(None, "--store", g.addrs, command="gateway").start()
        yield g, gw
    finally:
        if gw is not None and gw.proc is not None:
            gw.kill()
        g.stop()


def test_group_view_through_the_gateway_and_panel(group_and_gateway, tmp_path: Path) -> None:
    g, gw = group_and_gateway
    m = g.master()
    with Producer(g.addrs) as prod:
        for i in range(20):
            prod.send("dash", f"m{i}".encode())
    natives = {n.native for n in g.nodes}

    def settled() -> dict[str, Any] | None:
        v = gw_cluster(gw)
        ok = (v.get("up") and len(v["nodes"]) == 3
              and all(r["lag_bytes"] == 0 and r["insync"] for r in v["nodes"]))
        return v if ok else None

    view = wait_for(settled, 10, "three nodes in sync in the gateway's view")
    rows = {r["addr"]: r for r in view["nodes"]}
    assert set(rows) == natives
    assert rows[g.nodes[m].native]["role"] == "master"
    assert sorted(r["role"] for r in rows.values()) == ["master", "replica", "replica"]
    assert {r["epoch"] for r in rows.values()} == {view["epoch"]}
    assert {r["replicated_offset"] for r in rows.values()} == {view["log_end"]}
    # The native CLUSTER request answers what the master's own HTTP does.
    direct = native_call(g.nodes[m].native, p.CLUSTER, {})
    assert direct["node"] == view["node"] and len(direct["nodes"]) == 3

    others = [i for i in range(3) if i != m]
    with browser_page() as page:
        page.goto(f"http://{gw.addrs['http']}/")
        for n in g.nodes:
            page.wait_for_selector(f"#store-nodes tr[data-node='{n.native}']",
                                   timeout=10_000)
        master_row = page.locator(f"#store-nodes tr[data-node='{g.nodes[m].native}']")
        cells = master_row.locator("td").all_text_contents()
        assert cells[0] == g.nodes[m].native and cells[1] == "master"
        assert cells[2] == str(view["epoch"]) and cells[5] == "yes"
        assert int(cells[3]) >= view["log_end"]
        assert "sync replication, min in-sync 2" in page.inner_text("#store-group")
        page.screenshot(path=str(tmp_path / "store-panel.png"), full_page=True)
        assert (tmp_path / "store-panel.png").stat().st_size > 10_000
        # The master is killed: the panel follows the gateway to the new master,
        # which shows a higher epoch and the old master absent, out of the in-sync set.
        g.nodes[m].kill()
        row = "#store-nodes tr[data-node='{}'] td:nth-child({})"
        page.wait_for_function(
            "[" + ",".join(f"document.querySelector(\"{row.format(g.nodes[i].native, 2)}\")"
                           for i in others)
            + "].some(td => td && td.textContent === 'master')", timeout=20_000)
        new = next(i for i in others if page.inner_text(row.format(g.nodes[i].native, 2))
                   == "master")
        assert int(page.inner_text(row.format(g.nodes[new].native, 3))) > view["epoch"]
        page.wait_for_function(
            f"document.querySelector(\"{row.format(g.nodes[m].native, 6)}\")"
            "?.textContent === 'no'", timeout=20_000)
        assert page.inner_text(row.format(g.nodes[m].native, 2)) == "absent"
