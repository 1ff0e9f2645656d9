"""`process_*` metrics (CPU, resident memory, open descriptors) on every `/metrics`: a
gateway's (serve, with the native plane's counters beside them) and a store's, read
against what /proc says of the same process."""

from __future__ import annotations

import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import Server
from tests.proc import open_fds, rss_kb


def samples(srv: Server) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{srv.addrs['http']}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if not s.labels}


def check_process_figures(srv: Server) -> dict[str, float]:
    assert srv.proc is not None
    got = samples(srv)
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes",
                 "process_virtual_memory_bytes", "process_open_fds", "process_max_fds",
                 "process_start_time_seconds"):
        assert name in got, f"{name} missing from /metrics"
    rss = rss_kb(srv.proc.pid) * 1024
    assert 0.5 * rss < got["process_resident_memory_bytes"] < 2 * rss
    assert abs(got["process_open_fds"] - open_fds(srv.proc.pid)) <= 10
    assert got["process_cpu_seconds_total"] > 0
    return got


def test_serve_metrics_have_the_process_and_the_native_plane(tmp_path: Path) -> None:
    srv = Server(tmp_path / "data").start()
    try:
        got = check_process_figures(srv)
        if srv.addrs["plane"] == "native":  # the native plane's own counters beside them
            assert "lightgate_native_connections" in got
            assert "lightgate_native_messages_in_total" in got
    finally:
        assert srv.stop() == 0


def test_store_metrics_have_the_process(tmp_path: Path) -> None:
    srv = Server(tmp_path / "data", command="store").start()
    try:
        check_process_figures(srv)
    finally:
        assert srv.stop() == 0
