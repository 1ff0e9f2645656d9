"""The settings of the server commands: (flag, type, default, help) tables, one per
group, and which command reads which. Most rows are read from the config dataclasses'
fields (serving.settings), which hold each default and help once; the few that no one
dataclass holds are written here, with defaults from serving.values. `cli.py` turns the
tables into flags and values; `config_example.py` into the example file. Their own
module, so that neither of those imports the other."""

from __future__ import annotations

from typing import Any

from gateway.auth.chain import BackendConfig
from gateway.config import GatewayConfig, GatewayOptions, ListenerConfig
from serving.settings import (
    Bounds,
    Setting,
    bounds_of,
    groups_of,
    live_of,
    setting_of,
    settings_of,
)
from serving.values import HTTP_ADDR, HTTP_MAX_BODY, NATIVE_ADDR
from store.config import AuthConfig, ReplicationConfig, StoreConfig

# `serve` and `store`: the storage node's (data directory, retention, memory ...).
STORE_SETTINGS: list[Setting] = settings_of(StoreConfig)
# A store group (docs/store-groups.md): `lightgate store` only.
REPLICATION_SETTINGS: list[Setting] = settings_of(ReplicationConfig)
HTTP_SETTING = ("http", str, HTTP_ADDR, "HTTP (dashboard, admin API, metrics) HOST:PORT")
HTTP_BODY_SETTING = ("http-max-body", int, HTTP_MAX_BODY,
                     "largest HTTP request body (413 past it)")
# The values each setting may take, by flag: the config dataclasses' (serving.settings),
# and those of the rows written here that are numbers.
BOUNDS: dict[str, Bounds] = {
    **bounds_of(StoreConfig), **bounds_of(ReplicationConfig), **bounds_of(AuthConfig),
    **bounds_of(GatewayConfig), **bounds_of(ListenerConfig), **bounds_of(GatewayOptions),
    **bounds_of(BackendConfig, "auth-"), HTTP_BODY_SETTING[0]: Bounds(least=1),
}
HTTP_HOSTS_SETTING = ("http-allowed-hosts", str, None,
                      "more Host names HTTP answers to, comma list (* for any): loopback "
                      "names, IP addresses and --http's own host always are")
NATIVE_SETTING = ("native", str, NATIVE_ADDR, "native protocol HOST:PORT")
NOTIFY_SETTING = ("notify", str, None, "notify between nodes: redis://HOST:PORT")
STORE_ADDR_SETTING = setting_of(GatewayOptions, "store")
STORE_WAIT_SETTING = setting_of(GatewayOptions, "store_wait_s")
# Where a gateway cut off from its store's master sends its clients (gateway.store_link).
GATEWAY_PEER_SETTINGS: list[Setting] = settings_of(GatewayOptions, "peers",
                                                   "master_unreachable_s")
LISTENER_SETTINGS: list[Setting] = settings_of(ListenerConfig)
AUDIT_SETTING = setting_of(AuthConfig, "audit_log")
AUTH_STRATEGY_SETTING = setting_of(AuthConfig, "strategy")
GATEWAY_SETTINGS: list[Setting] = [*LISTENER_SETTINGS, *settings_of(GatewayConfig),
                                   AUDIT_SETTING]
AUTH_SETTINGS: list[Setting] = settings_of(AuthConfig, "enabled", "init_user",
                                           "allow_anonymous", "strategy")
# Backends MQTT clients may authenticate with beside the built-in users (serve, gateway).
AUTH_BACKEND_SETTINGS: list[Setting] = settings_of(BackendConfig, prefix="auth-")
GATEWAY_AUTH_SETTINGS: list[Setting] = [setting_of(GatewayOptions, "store_auth"),
                                        AUTH_STRATEGY_SETTING]

SERVE_SETTINGS = [*STORE_SETTINGS, *GATEWAY_SETTINGS, *AUTH_SETTINGS, *AUTH_BACKEND_SETTINGS,
                  NATIVE_SETTING, HTTP_SETTING, HTTP_BODY_SETTING, HTTP_HOSTS_SETTING]
STORE_CMD_SETTINGS = [*STORE_SETTINGS, *AUTH_SETTINGS, AUDIT_SETTING, NATIVE_SETTING,
                      NOTIFY_SETTING, HTTP_SETTING, HTTP_BODY_SETTING, HTTP_HOSTS_SETTING,
                      *REPLICATION_SETTINGS]
GATEWAY_CMD_SETTINGS = [STORE_ADDR_SETTING, STORE_WAIT_SETTING, *GATEWAY_PEER_SETTINGS,
                        NOTIFY_SETTING, *GATEWAY_SETTINGS,
                        *GATEWAY_AUTH_SETTINGS, *AUTH_BACKEND_SETTINGS, HTTP_SETTING,
                        HTTP_BODY_SETTING, HTTP_HOSTS_SETTING]


# The concerns `--help`, the configuration page and the example file list the settings
# under, in this order: each one's title, and what it is about.
GROUP_TITLES: dict[str, tuple[str, str]] = {
    "listeners": ("listeners", "where MQTT clients, applications and browsers connect"),
    "security": ("security", "TLS, authentication, authorisation, audit"),
    "limits": ("limits", "what clients may make the node hold and do, and what it spends"),
    "store": ("store", "the log, its retention and memory"),
    "cluster": ("cluster", "store groups, and gateways on a store elsewhere"),
    "observability": ("logging and observability", "what the node says of itself"),
}
# Flag -> its concern: the config dataclasses say theirs (a field's own `group`, else
# the class's, given here); the rows written above, here.
GROUPS: dict[str, str] = {
    **groups_of(StoreConfig, "store"), **groups_of(ReplicationConfig, "cluster"),
    **groups_of(AuthConfig, "security"), **groups_of(GatewayConfig, "limits"),
    **groups_of(ListenerConfig, "listeners"), **groups_of(GatewayOptions, "cluster"),
    **groups_of(BackendConfig, "security", "auth-"),
    HTTP_SETTING[0]: "listeners", NATIVE_SETTING[0]: "listeners",
    HTTP_BODY_SETTING[0]: "limits", HTTP_HOSTS_SETTING[0]: "security",
    NOTIFY_SETTING[0]: "cluster",
}
# The flags a running server takes a new value of from its config file on SIGHUP
# (lightgate.reloading); every other one is read at start only.
LIVE: set[str] = {*live_of(StoreConfig), *live_of(GatewayConfig)}


def grouped(settings: list[Setting]) -> dict[str, list[Setting]]:
    """`settings` by concern, in GROUP_TITLES' order (each group's in theirs)."""
    out: dict[str, list[Setting]] = {name: [] for name in GROUP_TITLES}
    for row in settings:
        out[GROUPS[row[0]]].append(row)
    return {name: rows for name, rows in out.items() if rows}


def all_settings() -> dict[str, tuple[str, Any, Any, str]]:
    """Every setting of the server commands by config key (each is defined once)."""
    out: dict[str, tuple[str, Any, Any, str]] = {}
    for setting in (*SERVE_SETTINGS, *STORE_CMD_SETTINGS, *GATEWAY_CMD_SETTINGS):
        out.setdefault(setting[0].replace("-", "_"), setting)
    return out
