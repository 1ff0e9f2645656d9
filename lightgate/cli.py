"""The `lightgate` command line. Parsing and wiring only; the logic lives in the rooms.

Every setting comes, in order of precedence, from a flag, an environment variable
(`LIGHTGATE_<NAME>`, e.g. LIGHTGATE_HTTP=0.0.0.0:18083), the TOML file given with
--config (keys named like the flags, with underscores), or the built-in default.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tomllib
from pathlib import Path
from typing import Any

import trio

# (flag, type, default, help) for the settings of `serve`/`store`.
STORE_SETTINGS: list[tuple[str, Any, Any, str]] = [
    ("data-dir", str, "data", "directory for the CommitLog, index and metadata"),
    ("flush", str, "async", "sync: ack after fsync (group commit); async: fsync periodically"),
    ("flush-interval-ms", int, 500, "async mode: fsync at least this often"),
    ("segment-size", int, 1 << 30, "CommitLog segment size in bytes"),
    ("retention-hours", float, 72.0, "delete whole segments older than this"),
    ("retention-bytes", int, None, "delete the oldest segments beyond this total size"),
    ("partitions", int, 4, "default partitions of a first-level topic"),
    ("full-verify", bool, False, "verify every CommitLog record on start, not just the tail"),
]
HTTP_SETTING = ("http", str, "127.0.0.1:18083", "HTTP (dashboard, admin API, metrics) HOST:PORT")
GATEWAY_SETTINGS: list[tuple[str, Any, Any, str]] = [
    ("mqtt", str, "0.0.0.0:1883", "MQTT over TCP HOST:PORT"),
    ("notify", str, None, "notify transport between nodes (default: in-process)"),
    ("max-inflight", int, 32, "unacknowledged QoS 1/2 messages per client"),
    ("max-packet-size", int, 16 * 1024 * 1024, "largest MQTT packet accepted, in bytes"),
    ("max-pending-publishes", int, 64, "publishes per client in the store pipeline at once"),
    ("max-offline-messages", int, 10_000,
     "per queue of an offline persistent session; older ones are dropped on reconnect"),
    ("sys-interval", float, 10.0, "seconds between $SYS/broker/... updates"),
    ("max-keepalive", int, 0, "longest keepalive allowed; v5 clients get Server Keep Alive"),
]


def _add_settings(
    parser: argparse.ArgumentParser, settings: list[tuple[str, Any, Any, str]]
) -> None:
    for flag, typ, default, help_text in settings:
        if typ is bool:
            parser.add_argument(f"--{flag}", action="store_true", default=None, help=help_text)
        else:
            parser.add_argument(
                f"--{flag}", type=typ, default=None, help=f"{help_text} (default: {default})"
            )


def resolve(args: argparse.Namespace, settings: list[tuple[str, Any, Any, str]]) -> dict[str, Any]:
    """Flag > environment > config file > default, for each setting."""
    file_values: dict[str, Any] = {}
    if getattr(args, "config", None):
        with open(args.config, "rb") as fh:
            file_values = {k.replace("-", "_"): v for k, v in tomllib.load(fh).items()}
    out: dict[str, Any] = {}
    for flag, typ, default, _ in settings:
        name = flag.replace("-", "_")
        value = getattr(args, name, None)
        env = os.environ.get(f"LIGHTGATE_{name.upper()}")
        if value is None and env is not None:
            value = env.lower() in ("1", "true", "yes") if typ is bool else typ(env)
        if value is None:
            value = file_values.get(name, default)
        out[name] = value
    return out


def _store_config(values: dict[str, Any]) -> Any:
    from store.service import StoreConfig

    if values["flush"] not in ("sync", "async"):
        raise SystemExit("--flush must be sync or async")
    return StoreConfig(
        data_dir=Path(values["data_dir"]),
        flush=values["flush"],
        flush_interval_ms=values["flush_interval_ms"],
        segment_size=values["segment_size"],
        retention_hours=values["retention_hours"],
        retention_bytes=values["retention_bytes"],
        default_partitions=values["partitions"],
        full_verify=bool(values["full_verify"]),
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from gateway.app import ServeOptions, run_serve
    from gateway.broker import GatewayConfig

    values = resolve(args, [*STORE_SETTINGS, *GATEWAY_SETTINGS, HTTP_SETTING])
    gateway = GatewayConfig(
        max_inflight=values["max_inflight"],
        max_packet_size=values["max_packet_size"],
        max_pending_publishes=values["max_pending_publishes"],
        max_offline_messages=values["max_offline_messages"],
        sys_interval=values["sys_interval"],
        max_keepalive=values["max_keepalive"],
    )
    opts = ServeOptions(
        store=_store_config(values), gateway=gateway, mqtt=values["mqtt"],
        http=values["http"], notify=values["notify"],
    )
    trio.run(run_serve, opts)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightgate", description=__doc__.split("\n")[0])
    parser.add_argument("--log-level", default=os.environ.get("LIGHTGATE_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="embedded mode: store + gateway + HTTP in one process")
    serve.add_argument("--config", help="TOML file with settings (keys named like the flags)")
    _add_settings(serve, [*STORE_SETTINGS, *GATEWAY_SETTINGS, HTTP_SETTING])
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        sys.exit(args.func(args))
    except KeyboardInterrupt:
        sys.exit(0)
