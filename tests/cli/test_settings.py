"""The settings tables (lightgate.settings) against the config dataclasses they are read
from: each flag is defined once, and the command line with no flags builds the configs
the dataclasses' defaults make."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from gateway.auth.chain import BackendConfig
from gateway.config import MAX_PACKET, GatewayConfig, GatewayOptions, ListenerConfig
from gateway.mqtt.codec import MAX_PACKET_SIZE
from lightgate import cli, settings
from lightgate.embedded import ServeOptions
from serving.settings import Setting, settings_of
from serving.startup import StartupError
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


# -- the values each setting may take ----------------------------------------------------
CHOICES = {"flush", "replication", "auth-strategy", "tls-client-auth", "tls-username-from",
           "auth-http-on-error"}


def _rows() -> list[tuple[str, Setting]]:
    return [(command, row) for command, table in TABLES.items() for row in table]


def _out_of_bounds(flag: str, typ: type) -> list[str]:
    """Values just past what --`flag` takes: below its least (or at its `above`), above
    its most, not a finite number, not one of its choices."""
    b = settings.BOUNDS[flag]
    if b.choices:
        return ["nope", b.choices[0].upper()]
    out = []
    if b.least is not None:
        out.append(str(typ(b.least) - 1))
    if b.above is not None:
        out.append(str(typ(b.above)))
    if b.most is not None:
        out.append(str(typ(b.most) + 1))
    if typ is float:
        out += ["nan", "inf"]
    return out


def test_every_number_and_choice_says_what_it_takes() -> None:
    """A new numeric setting without bounds fails here: `setting(..., least=...)`."""
    for _, (flag, typ, default, _) in _rows():
        b = settings.BOUNDS.get(flag)
        if typ in (int, float):
            assert b is not None and (b.least is not None or b.above is not None), flag
        if flag in CHOICES:
            assert b is not None and b.choices and default in b.choices, flag
        if b is not None:
            assert b.refusal(default) is None, (flag, default)


@pytest.mark.parametrize("command", TABLES)
def test_each_command_refuses_every_value_out_of_bounds(command: str) -> None:
    """Walks the command's table: each value past a bound stops start-up with a line
    naming the flag; the bounds themselves are taken."""
    parser = cli.build_parser()
    table = TABLES[command]
    cli.resolve(parser.parse_args([command]), table)  # the defaults
    for flag, typ, _, _ in table:
        b = settings.BOUNDS.get(flag)
        if b is None or not b.bounded or typ is bool:
            continue
        for bad in _out_of_bounds(flag, typ):
            with pytest.raises(StartupError, match=f"^--{flag} must be .*, not "):
                cli.resolve(parser.parse_args([command, f"--{flag}", bad]), table)
        for good in [*b.choices, b.least, b.most]:
            if good is not None:
                cli.resolve(parser.parse_args([command, f"--{flag}", str(typ(good))]), table)


def test_a_value_from_the_environment_or_a_file_names_where_it_came_from(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parser = cli.build_parser()
    monkeypatch.setenv("LIGHTGATE_PARTITIONS", "0")
    with pytest.raises(StartupError, match=r"^--partitions must be at least 1, not 0 "
                       r"\(LIGHTGATE_PARTITIONS\)$"):
        cli.resolve(parser.parse_args(["store"]), settings.STORE_CMD_SETTINGS)
    monkeypatch.delenv("LIGHTGATE_PARTITIONS")
    conf = tmp_path / "l.toml"
    conf.write_text("max_inflight = -5\n")
    with pytest.raises(StartupError, match=r"^--max-inflight must be at least 1, not -5 "
                       rf"\(--config {conf}: max_inflight\)$"):
        cli.resolve(parser.parse_args(["gateway", "--config", str(conf)]),
                    settings.GATEWAY_CMD_SETTINGS)


def test_the_written_out_bounds_are_those_of_the_modules_they_stand_for() -> None:
    """Two the settings name without loading their modules (the command line stays
    light): MQTT's largest packet, and what the HTTP hook does when it fails."""
    from gateway.auth.http_hook import ON_ERROR

    assert MAX_PACKET == MAX_PACKET_SIZE
    assert settings.BOUNDS["auth-http-on-error"].choices == ON_ERROR
