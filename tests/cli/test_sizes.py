"""The store's memory sizes are settings: given by flag or config file, they reach the
caches of a running `lightgate serve` (its stats API, /metrics and RocksDB's own OPTIONS
file say so); left alone, they are the sizes the store had built in."""

from __future__ import annotations

import re
import signal
import urllib.request
from pathlib import Path

from lightgate import cli
from store.service import StoreConfig
from tests.cli.test_serve import get_json, start_serve

MiB = 1024 * 1024


def rocksdb_option(db_dir: Path, name: str) -> list[int]:
    """Every value of `name` in the newest OPTIONS file RocksDB wrote for `db_dir`."""
    newest = max(db_dir.glob("OPTIONS-*"), key=lambda p: int(p.name.split("-")[1]))
    return [int(v) for v in re.findall(rf"^\s*{name}=(\d+)$", newest.read_text(), re.M)]


def test_cache_and_memtable_sizes_reach_the_store(tmp_path: Path) -> None:
    conf = tmp_path / "small.toml"
    conf.write_text("metadata_cache_mb = 3\nmetadata_memtable_mb = 2\nrecent_per_queue = 1000\n")
    data = tmp_path / "d"
    proc, addrs = start_serve(data, "--config", str(conf), "--index-cache-mb", "5",
                              "--index-memtable-mb", "6", "--recent-cache-mb", "7")
    try:
        stats = get_json(f"http://{addrs['http']}/api/v1/store/stats")
        assert stats["memory"]["index"]["block_cache_capacity"] == 5 * MiB
        assert stats["memory"]["metadata"]["block_cache_capacity"] == 3 * MiB
        assert stats["recent"]["max_bytes"] == 7 * MiB
        assert stats["recent"]["per_queue"] == 1000
        with urllib.request.urlopen(f"http://{addrs['http']}/metrics", timeout=5) as resp:
            metrics = resp.read().decode()
        limit = re.search(r'^lightgate_store_memory_limit_bytes\{part="recent_messages"\} (\S+)$',
                          metrics, re.M)
        assert limit and float(limit[1]) == 7 * MiB
        assert rocksdb_option(data / "index", "write_buffer_size") == [6 * MiB]
        # Two column families' memtables fit in the metadata's whole budget.
        assert set(rocksdb_option(data / "meta", "write_buffer_size")) == {1 * MiB}
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0


def test_defaults_are_the_sizes_built_in() -> None:
    args = cli.build_parser().parse_args(["serve"])
    built = cli._store_config(cli.resolve(args, cli.SERVE_SETTINGS))
    for name in ("index_cache_mb", "index_memtable_mb", "metadata_cache_mb",
                 "metadata_memtable_mb", "recent_cache_mb", "recent_per_queue"):
        assert getattr(built, name) == getattr(StoreConfig(), name), name
    assert StoreConfig().recent_cache_mb == 32 and StoreConfig().index_cache_mb == 32
