"""The settings tables (lightgate.settings) against the config dataclasses they are read
from: each flag is defined once, and the command line with no flags builds the configs
the dataclasses' defaults make."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from gateway.auth.chain import BackendConfig
from gateway.config import GatewayConfig, GatewayOptions, ListenerConfig
from lightgate import cli, settings
from lightgate.embedded import ServeOptions
from serving.settings import settings_of
from store.config import AuthConfig, ReplicationConfig, StoreConfig

CONFIGS: list[tuple[type, str]] = [
    (GatewayConfig, ""), (ListenerConfig, ""), (GatewayOptions, ""), (StoreConfig, ""),
    (ReplicationConfig, ""), (AuthConfig, ""), (BackendConfig, "auth-"),
]
TABLES = {"serve": settings.SERVE_SETTINGS, "store": settings.STORE_CMD_SETTINGS,
          "gateway": settings.GATEWAY_CMD_SETTINGS}


def _default(f: dataclasses.Field[Any]) -> Any:
    return None if f.default is dataclasses.MISSING else f.default


def test_each_flag_is_defined_once() -> None:
    """A flag read by several commands is the same row everywhere (one help, one
    default), and appears once per command."""
    rows: dict[str, tuple[str, Any, Any, str]] = {}
    for command, table in TABLES.items():
        flags = [row[0] for row in table]
        assert len(flags) == len(set(flags)), f"{command} repeats a flag"
        for row in table:
            assert rows.setdefault(row[0], row) == row, f"--{row[0]} is defined twice"


@pytest.mark.parametrize(("cls", "prefix"), CONFIGS, ids=lambda c: getattr(c, "__name__", c))
def test_every_field_setting_is_a_row_with_the_fields_default(cls: type, prefix: str) -> None:
    known = {row[0]: row for table in TABLES.values() for row in table}
    fields = [f for f in dataclasses.fields(cls) if "setting" in f.metadata]
    assert fields, f"{cls.__name__} declares no settings"
    for f in fields:
        [row] = settings_of(cls, f.name, prefix=prefix)
        assert known.get(row[0]) == row, f"{cls.__name__}.{f.name}: --{row[0]} not in a table"
        default = _default(f)
        assert row[2] == (str(default) if row[1] is str and default is not None else default)


def test_the_shared_rows_have_the_configs_defaults() -> None:
    """The rows no one dataclass holds (addresses, the HTTP body limit) say what the
    dataclasses that take them default to."""
    known = settings.all_settings()
    assert known["native"][2] == ServeOptions().native == GatewayOptions().store
    assert known["http"][2] == ServeOptions().http == GatewayOptions().http
    assert known["http_max_body"][2] == GatewayConfig().http_max_body \
        == StoreConfig().http_max_body
    assert known["notify"][2] is GatewayOptions().notify is None


def test_no_flags_build_the_default_configs() -> None:
    """What the command line makes of the defaults is what the dataclasses make."""
    values = {key: row[2] for key, row in settings.all_settings().items()}
    assert cli._gateway_config(values) == GatewayConfig()
    assert cli._listener_config(values) == ListenerConfig()
    assert cli._store_config(values) == StoreConfig()
    assert cli._backend_config(values) == BackendConfig()
    assert cli._auth_config(values, BackendConfig()) == AuthConfig()
    assert cli._replication_config(values) == ReplicationConfig()


def test_a_shared_row_reaches_every_config_that_takes_it() -> None:
    values = {key: row[2] for key, row in settings.all_settings().items()}
    values["http_max_body"] = 4096
    assert cli._gateway_config(values).http_max_body == 4096
    assert cli._store_config(values).http_max_body == 4096
