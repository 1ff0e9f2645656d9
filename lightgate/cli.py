"""The `lightgate` command line: flags, environment and config file turned into the
options each command's module runs with (the logic lives in gateway/, store/ and the
other packages, not here).

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
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

import trio

from gateway.auth.chain import BackendConfig, split_list
from gateway.config import GatewayConfig, GatewayOptions, ListenerConfig
from lightgate import clients
from lightgate.reloading import ConfigFile, Target
from lightgate.settings import (
    BOUNDS,
    GATEWAY_CMD_SETTINGS,
    GROUP_TITLES,
    GROUPS,
    LIVE,
    SERVE_SETTINGS,
    STORE_CMD_SETTINGS,
    all_settings,
)
from serving import logs, plane
from serving.fd_budget import raise_fd_limit
from serving.logs import LOG_FORMATS
from serving.reload import Reload
from serving.settings import Setting, flag_values
from serving.startup import (
    HTTP_LISTENER,
    NATIVE_LISTENER,
    CommandError,
    StartupError,
    check_ports,
    first_of,
    read_secret,
)
from serving.values import NATIVE_ADDR, split_credentials
from serving.version import version_line
from store.config import AuthConfig, ReplicationConfig, StoreConfig

DESCRIPTION = """\
Lightgate: an MQTT 3.1.1 and 5.0 broker that keeps every message in a log, where
devices' messages can be replayed, and read by server applications and Spark.

`lightgate serve` runs everything in one process. To run storage and MQTT on separate
machines, run `lightgate store` on one and `lightgate gateway` on others. Every server
setting may also come from a LIGHTGATE_<NAME> environment variable or a TOML file
(--config FILE; `lightgate config --example` prints one with every setting)."""

COMMANDS = {  # name: (one line for the list, what `lightgate NAME --help` explains)
    "serve": ("run the broker: storage, MQTT and the web console in one process",
              "Run Lightgate in one process: the message store (in --data-dir), the MQTT "
              "listeners and HTTP (dashboard, admin API, Prometheus metrics)."),
    "store": ("run a storage node, for gateways on other machines",
              "Run a storage node: the message log and metadata that gateways (`lightgate "
              "gateway`) and applications reach over the native protocol. Nodes listed in "
              "--group-peers form a store group with replication and automatic failover."),
    "gateway": ("run MQTT listeners in front of a store on another machine",
                "Run an MQTT gateway on a store that runs elsewhere (--store HOST:PORT). Run "
                "as many as the clients need; with --notify redis://... they hear of new "
                "messages at once, without it they poll the store."),
}


def _add_settings(
    parser: argparse.ArgumentParser, settings: list[tuple[str, Any, Any, str]]
) -> dict[str, Any]:
    """Each setting's flag, in the group of its concern (GROUPS): `--help` lists them so,
    as the configuration page does. The groups by name."""
    used = {GROUPS[row[0]] for row in settings} | {"observability"}  # (--log-level)
    groups = {name: parser.add_argument_group(title, about)
              for name, (title, about) in GROUP_TITLES.items() if name in used}
    for flag, typ, default, help_text in settings:
        group = groups[GROUPS[flag]]
        said = [BOUNDS[flag].describe() if flag in BOUNDS else "",
                "re-read on SIGHUP" if flag in LIVE else ""]
        if typ is bool:
            more = "; ".join(x for x in said if x)
            group.add_argument(f"--{flag}", action="store_true", default=None,
                               help=f"{help_text} ({more})" if more else help_text)
        else:
            more = "".join(f"; {x}" for x in said if x)
            group.add_argument(f"--{flag}", type=typ, default=None,
                               help=f"{help_text} (default: {default}{more})")
    return groups


def resolve(args: argparse.Namespace, settings: list[tuple[str, Any, Any, str]]) -> dict[str, Any]:
    """Flag > environment > config file > default, for each setting. A value that is not
    of the setting's type is a StartupError naming the variable or key; values outside
    what their settings take (BOUNDS) are one StartupError naming every one."""
    file_values = load_config(args.config) if getattr(args, "config", None) else {}
    out: dict[str, Any] = {}
    refused: list[str] = []
    for flag, typ, default, _ in settings:
        name = flag.replace("-", "_")
        value, origin = getattr(args, name, None), ""
        env = os.environ.get(f"LIGHTGATE_{name.upper()}")
        if value is None and env is not None:
            try:
                value = env.lower() in ("1", "true", "yes") if typ is bool else typ(env)
            except ValueError:
                raise StartupError(f"LIGHTGATE_{name.upper()}={env!r} is not {_a(typ)} "
                                   f"(--{flag})") from None
            origin = f" (LIGHTGATE_{name.upper()})"
        if value is None and name in file_values:
            value = _config_value(args.config, name, typ, file_values[name])
            origin = f" (--config {args.config}: {name})"
        out[name] = default if value is None else value
        why = BOUNDS[flag].refusal(out[name]) if flag in BOUNDS else None
        if why is not None:
            refused.append(f"--{flag} {why}{origin}")
    if refused:
        raise StartupError("; ".join(refused))
    return out


def _a(typ: Any) -> str:
    return {int: "an integer", float: "a number", bool: "true or false"}.get(typ, "a string")


def _config_value(path: str, name: str, typ: Any, value: Any) -> Any:
    """`value` of key `name` from the TOML file, checked against the setting's type."""
    if typ is bool or isinstance(value, bool):  # TOML true is no number, 1 no boolean
        ok = typ is bool and isinstance(value, bool)
    else:
        ok = isinstance(value, int | float if typ is float else typ)
    if not ok:
        raise StartupError(f"--config {path}: {name} = {value!r} is not {_a(typ)}")
    return typ(value)


def load_config(path: str) -> dict[str, Any]:
    """The TOML file's settings by key. One file may serve every command (a store ignores
    the gateway's keys), but a key no command knows is a typo, and an error."""
    try:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    except OSError as exc:
        raise StartupError(f"--config {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise StartupError(f"--config {path} is not valid TOML: {exc}") from None
    values = {k.replace("-", "_"): v for k, v in raw.items()}
    unknown = sorted(set(values) - set(all_settings()))
    if unknown:
        raise StartupError(f"--config {path}: unknown key {unknown[0]!r} (every key: "
                           "`lightgate config --example`)")
    return values


def _store_config(values: dict[str, Any]) -> Any:
    return _config(StoreConfig, values, data_dir=Path(values["data_dir"]), **_http(values))


def _gateway_config(values: dict[str, Any]) -> GatewayConfig:
    why = plane.require_native()
    if why is not None:
        raise StartupError(why)
    cfg: GatewayConfig = _config(GatewayConfig, values, **_http(values))
    return cfg


def _http(values: dict[str, Any]) -> dict[str, Any]:
    """--http-max-body and --http-allowed-hosts: every command's (no one config's
    settings), given to each config here."""
    return {"http_max_body": values["http_max_body"],
            "http_allowed_hosts": split_list(values.get("http_allowed_hosts")) or ()}


def _listener_config(values: dict[str, Any]) -> ListenerConfig:
    cfg = _config(ListenerConfig, values)
    try:
        cfg.check()
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    return cfg


def _config(cls: Any, values: dict[str, Any], prefix: str = "", **special: Any) -> Any:
    """A config dataclass from resolved settings: each field that is a setting takes the
    value of its flag, but for those given in `special` (converted)."""
    given = flag_values(cls, values, prefix)
    return cls(**{k: v for k, v in given.items() if k not in special}, **special)


def _backend_config(values: dict[str, Any]) -> BackendConfig:
    if "auth_order" not in values:  # `lightgate store`: its clients are not MQTT devices
        return BackendConfig()
    cfg = _config(BackendConfig, values, "auth-", order=split_list(values["auth_order"]),
                  jwt_algorithms=split_list(values["auth_jwt_algorithms"]))
    try:
        cfg.check()
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    return cfg


def _auth_config(values: dict[str, Any], backends: BackendConfig) -> AuthConfig:
    """The store's auth settings; `backends` (MQTT's, _backend_config) may turn it on."""
    cfg: AuthConfig = _config(AuthConfig, values, audit_log=values.get("audit_log"),
                              mqtt_chain=backends.chain)
    return cfg


def _listener_ports(listeners: ListenerConfig) -> list[tuple[str, str, str | None]]:
    from gateway.listener import LISTENERS

    return [(*label, listeners.address(name)) for name, label in LISTENERS.items()]


def _reload(args: argparse.Namespace, settings: list[Setting], values: dict[str, Any],
            *targets: Target) -> Reload:
    """SIGHUP's steps as far as the command line knows them: the config file, whose live
    settings go to `targets` (the configs the server runs with). The server adds its
    own (users and policies, TLS certificates)."""
    reload = Reload()
    if getattr(args, "config", None):
        reload.add(f"the configuration file {args.config}",
                   ConfigFile(partial(resolve, args, settings), values, list(targets)))
    return reload


def cmd_serve(args: argparse.Namespace) -> int:
    from lightgate.embedded import ServeOptions, run_serve

    values = resolve(args, SERVE_SETTINGS)
    backends = _backend_config(values)
    opts = ServeOptions(
        store=_store_config(values), gateway=_gateway_config(values),
        listeners=_listener_config(values), auth=_auth_config(values, backends),
        auth_backends=backends, native=values["native"], http=values["http"],
    )
    check_ports([*_listener_ports(opts.listeners), (*NATIVE_LISTENER, opts.native),
                 (*HTTP_LISTENER, opts.http)])
    raise_fd_limit()
    reload = _reload(args, SERVE_SETTINGS, values, (opts.store, StoreConfig, ""),
                     (opts.gateway, GatewayConfig, ""))
    trio.run(run_serve, opts, reload)
    return 0


async def _store_main(cfg: Any, native: str, http: str, notify: str | None,
                      auth: Any, repl: Any, reload: Reload) -> None:
    from notify import open_bus
    from store.app import run_store

    if notify:
        # A store only tells: what gateways publish back is no business of its own.
        async with open_bus(notify, receive=False) as bus:
            await run_store(cfg, native, http, bus.publish_from_thread, auth, repl, reload)
    else:
        await run_store(cfg, native, http, None, auth, repl, reload)


def _replication_config(values: dict[str, Any]) -> ReplicationConfig:
    raft, advertise = values["raft"], values["raft_advertise"] or values["raft"]
    peers = [x.strip() for x in (values["group_peers"] or "").split(",")
             if x.strip() and x.strip() != advertise]  # the list may name this node
    if peers and not raft:
        raise StartupError("--group-peers needs --raft HOST:PORT (this node's Raft address)")
    if peers and values["replica_of"]:
        raise StartupError("--replica-of and --group-peers exclude each other: in a group "
                           "the controller says who is master")
    group = len(peers) + 1 if peers else None
    if group is not None and values["min_insync"] > group:
        raise StartupError(f"--min-insync must be between 1 and the group's size, not "
                           f"{values['min_insync']}")
    if values["failover_after_s"] < values["controller_lease_s"] + 0.5:
        raise StartupError("--failover-after-s must be at least --controller-lease-s + 0.5: "
                           "a master's lease must end before another may be elected")
    secret = None
    if values["raft_secret"]:
        secret = read_secret(values["raft_secret"], "--raft-secret")
    if peers and secret is None:
        # Raft frames are pickles: without the secret anyone who reaches the port (on
        # loopback: any local process) could run code in this node.
        raise StartupError("a store group needs a secret: --raft-secret VALUE|@FILE, the "
                           "same on every node (Raft messages without it are dropped)")
    creds = None
    if values["replica_auth"]:
        try:
            creds = split_credentials(values["replica_auth"], "--replica-auth")
        except ValueError as exc:
            raise StartupError(str(exc)) from None
    return _config(ReplicationConfig, values, raft_advertise=advertise, raft_secret=secret,
                   group_peers=peers, credentials=creds)


def cmd_store(args: argparse.Namespace) -> int:
    values = resolve(args, STORE_CMD_SETTINGS)
    repl = _replication_config(values)
    raft = [("the store group's Raft controller", "--raft", repl.raft)] if repl.raft else []
    check_ports([(*NATIVE_LISTENER, values["native"]), (*HTTP_LISTENER, values["http"]),
                 *raft])
    raise_fd_limit()
    cfg = _store_config(values)
    trio.run(_store_main, cfg, values["native"], values["http"], values["notify"],
             _auth_config(values, _backend_config(values)), repl,
             _reload(args, STORE_CMD_SETTINGS, values, (cfg, StoreConfig, "")))
    return 0


def cmd_gateway(args: argparse.Namespace) -> int:
    from gateway.app import run_gateway

    values = resolve(args, GATEWAY_CMD_SETTINGS)
    opts = _config(GatewayOptions, values, notify=values["notify"],
                   peers=list(split_list(values["peers"]) or ()),
                   gateway=_gateway_config(values), listeners=_listener_config(values),
                   http=values["http"], auth_strategy=values["auth_strategy"],
                   audit_log=values["audit_log"], auth_backends=_backend_config(values))
    check_ports([*_listener_ports(opts.listeners), (*HTTP_LISTENER, opts.http)])
    raise_fd_limit()
    trio.run(run_gateway, opts,
             _reload(args, GATEWAY_CMD_SETTINGS, values, (opts.gateway, GatewayConfig, "")))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from lightgate.config_example import example

    print(example(), end="")
    return 0


def _credentials(args: argparse.Namespace) -> dict[str, str]:
    auth = getattr(args, "as_user", None) or os.environ.get("LIGHTGATE_AUTH")
    if not auth:
        return {}
    try:
        name, password = split_credentials(auth, "--as (or LIGHTGATE_AUTH)")
    except ValueError as exc:
        raise SystemExit(f"lightgate: {exc}") from None
    return {"username": name, "password": password}


def cmd_produce(args: argparse.Namespace) -> int:
    """Each line of stdin becomes one message."""
    from store.sdk import Producer

    n = 0
    with Producer(args.server, idempotent=args.idempotent, **_credentials(args)) as producer:
        for line in sys.stdin:
            body = line.rstrip("\n").encode()
            try:
                res = producer.send(args.topic, body, mqtt_topic=args.mqtt_topic,
                                    key=args.key, qos=args.qos)
            except Exception as exc:
                if n:  # (the line `main` prints says what failed; this, what went before)
                    exc.add_note(f"{n} messages were sent before it")
                raise
            n += 1
            if args.verbose:
                print(res.msg_id, flush=True)
    logs.say(f"sent {n} messages to {args.topic}")
    return 0


def cmd_consume(args: argparse.Namespace) -> int:
    import json

    from store.sdk import Consumer

    seen = 0
    with Consumer(args.server, args.group, args.topic, start=args.start,
                  **_credentials(args)) as consumer:
        while args.max is None or seen < args.max:
            for msg in consumer.poll(timeout=1.0):
                row = {"msg_id": msg.msg_id, "mqtt_topic": msg.mqtt_topic, "qos": msg.qos,
                       "client_id": msg.client_id, "queue": msg.queue, "offset": msg.offset,
                       "body": msg.body.decode("utf-8", "replace")}
                print(json.dumps(row), flush=True)
                consumer.ack(msg)
                seen += 1
                if args.max is not None and seen >= args.max:
                    break
    return 0


def _admin_request(args: argparse.Namespace, code_name: str, header: dict[str, Any]) -> dict:
    """One users/ACL request to the store (Super credentials from --as or LIGHTGATE_AUTH);
    a refusal is raised, and `main` says it in one line."""
    from store import protocol as p
    from store.client import NativeClient

    creds = _credentials(args)

    async def call() -> dict:
        async with NativeClient.open(
            args.server, credentials=(creds["username"], creds["password"]) if creds else None
        ) as client:
            reply, _ = await client.request(getattr(p, code_name), header)
            return reply

    return trio.run(call)


def cmd_user(args: argparse.Namespace) -> int:
    import json

    op = args.user_op
    if op == "add":
        out = _admin_request(args, "USER_ADD", {"name": args.name, "password": args.password,
                                                "super": args.super, "node": args.node})
    elif op == "passwd":
        out = _admin_request(args, "USER_UPDATE", {"name": args.name, "password": args.password})
    elif op in ("enable", "disable"):
        out = _admin_request(args, "USER_UPDATE", {"name": args.name, "enabled": op == "enable"})
    elif op == "del":
        out = _admin_request(args, "USER_DELETE", {"name": args.name})
    else:
        for user in _admin_request(args, "USER_LIST", {})["users"]:
            print(json.dumps(user))
        return 0
    print(json.dumps(out.get("user", out)))
    return 0


def cmd_acl(args: argparse.Namespace) -> int:
    import json

    if args.acl_op == "add":
        out = _admin_request(args, "ACL_ADD", {
            "user": args.user, "resource": args.resource, "match": args.match,
            "actions": args.actions, "ip": args.ip or "", "deny": args.deny})
        print(json.dumps(out["policy"]))
    elif args.acl_op == "del":
        out = _admin_request(args, "ACL_DELETE", {"user": args.user, "resource": args.resource,
                                                  "match": args.match})
        print(json.dumps(out))
    else:
        for policy in _admin_request(args, "ACL_LIST", {"user": args.user})["policies"]:
            print(json.dumps(policy))
    return 0


def _add_auth_commands(sub: Any, client_flags: argparse.ArgumentParser) -> None:
    user = sub.add_parser("user", help="manage users (needs a Super user: --as NAME:PASSWORD)")
    user_ops = user.add_subparsers(dest="user_op", required=True)
    add = user_ops.add_parser("add", parents=[client_flags], help="add a user")
    add.add_argument("name")
    add.add_argument("--password", required=True)
    add.add_argument("--super", action="store_true", help="a Super user (all rights)")
    add.add_argument("--node", action="store_true",
                     help="a node: what a gateway joins the store as (--store-auth)")
    passwd = user_ops.add_parser("passwd", parents=[client_flags], help="set a password")
    passwd.add_argument("name")
    passwd.add_argument("--password", required=True)
    for op, text in (("del", "delete a user and its policies"),
                     ("enable", "enable a user"),
                     ("disable", "disable a user: its live sessions end at once")):
        cmd = user_ops.add_parser(op, parents=[client_flags], help=text)
        cmd.add_argument("name")
    user_ops.add_parser("list", parents=[client_flags], help="list users")
    user.set_defaults(func=cmd_user)

    acl = sub.add_parser("acl", help="manage policies (needs a Super user)")
    acl_ops = acl.add_subparsers(dest="acl_op", required=True)
    add = acl_ops.add_parser("add", parents=[client_flags], help="add (or replace) a policy")
    add.add_argument("user", help="user name, 'anonymous', or '*' for everyone")
    add.add_argument("--resource", required=True, help="Topic:PATTERN, Group:NAME or Cluster")
    add.add_argument("--match", default="literal", choices=("literal", "prefixed", "any"))
    add.add_argument("--actions", required=True,
                     help="comma list of PUB,SUB,CREATE,UPDATE,DELETE,LIST,GET or ALL")
    add.add_argument("--ip", help="only from this address or CIDR")
    add.add_argument("--deny", action="store_true", help="a Deny policy (default Allow)")
    delete = acl_ops.add_parser("del", parents=[client_flags], help="delete policies")
    delete.add_argument("user")
    delete.add_argument("--resource", help="only this resource (default: all of the user's)")
    delete.add_argument("--match", choices=("literal", "prefixed", "any"))
    listing = acl_ops.add_parser("list", parents=[client_flags], help="list policies")
    listing.add_argument("user", nargs="?")
    acl.set_defaults(func=cmd_acl)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lightgate", description=DESCRIPTION,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=version_line(),
                        help="print the installed version and exit")
    parser.add_argument("--log-level", help=LOG_LEVEL_HELP)
    parser.add_argument("--log-format", help=LOG_FORMAT_HELP)
    sub = parser.add_subparsers(dest="command", required=True)

    for name, func, settings in (("serve", cmd_serve, SERVE_SETTINGS),
                                 ("store", cmd_store, STORE_CMD_SETTINGS),
                                 ("gateway", cmd_gateway, GATEWAY_CMD_SETTINGS)):
        help_text, description = COMMANDS[name]
        cmd = sub.add_parser(name, help=help_text, description=description,
                             usage=f"lightgate {name} [--config FILE] [--SETTING VALUE ...]")
        cmd.add_argument("--config", metavar="FILE", help="TOML file with settings (keys "
                         "named like the flags); SIGHUP re-reads it")
        watching = _add_settings(cmd, settings)["observability"]
        for flag, flag_help in LOGGING_FLAGS:
            watching.add_argument(flag, default=argparse.SUPPRESS, help=flag_help)
        cmd.set_defaults(func=func)

    client_flags = argparse.ArgumentParser(add_help=False)
    client_flags.add_argument("--server", default=NATIVE_ADDR,
                              help="the store's native HOST:PORT")
    client_flags.add_argument("--as", dest="as_user", metavar="NAME:PASSWORD",
                              help="credentials (or env LIGHTGATE_AUTH)")
    produce = sub.add_parser("produce", parents=[client_flags],
                             help="send stdin lines as messages to a first-level topic")
    produce.add_argument("topic")
    produce.add_argument("--mqtt-topic", help="also deliver to MQTT subscribers of this topic")
    produce.add_argument("--key", default="", help="message key (partitioning, lookup)")
    produce.add_argument("--qos", type=int, default=1, choices=(0, 1, 2))
    produce.add_argument("-v", "--verbose", action="store_true", help="print message ids")
    produce.add_argument("--idempotent", action=argparse.BooleanOptionalAction, default=True,
                         help="number the messages so that a send retried after a lost "
                              "answer is stored once (--no-idempotent: at least once)")
    produce.set_defaults(func=cmd_produce)
    consume = sub.add_parser("consume", parents=[client_flags],
                             help="print messages of a first-level topic as JSON lines")
    consume.add_argument("topic")
    consume.add_argument("--group", required=True)
    consume.add_argument("--start", choices=("earliest", "latest"), default="earliest")
    consume.add_argument("--max", type=int, help="stop after this many messages")
    consume.set_defaults(func=cmd_consume)
    _add_auth_commands(sub, client_flags)
    clients.add_commands(sub, _credentials)
    config = sub.add_parser("config", help="print a config file with every setting")
    config.add_argument("--example", action="store_true", required=True,
                        help="every key with its default, as TOML")
    config.set_defaults(func=cmd_config)
    _add_room_commands(sub)
    _logging_everywhere(parser)
    return parser


LOG_LEVEL_HELP = ("debug, info, warning or error (default: LIGHTGATE_LOG_LEVEL, else INFO "
                  "for the servers and WARNING for the client commands); debug adds the "
                  "traceback to an error")
LOG_FORMAT_HELP = ("text, or json: one JSON object a line (ts, level, logger, message, "
                   "exc_info) (default: LIGHTGATE_LOG_FORMAT, else text)")
LOGGING_FLAGS = (("--log-level", LOG_LEVEL_HELP), ("--log-format", LOG_FORMAT_HELP))


def _logging_everywhere(parser: argparse.ArgumentParser) -> None:
    """--log-level and --log-format after any command too (`lightgate serve --log-level
    debug`), not only before it: each command's parser takes them, and says nothing
    when one is not given (SUPPRESS), so that one given before the command stands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                for flag, help_text in LOGGING_FLAGS:
                    if not any(flag in a.option_strings for a in command._actions):
                        command.add_argument(flag, default=argparse.SUPPRESS,
                                             help=help_text)
                _logging_everywhere(command)


def _add_room_commands(sub: Any) -> None:
    """Commands that live with their package (`analytics`, `simulate` in spark_streaming):
    each may offer `add_commands(subparsers)` in its `cli` module."""
    import importlib

    for room in ("spark_streaming",):
        try:
            module = importlib.import_module(f"{room}.cli")
        except ModuleNotFoundError as exc:
            if exc.name != f"{room}.cli":
                raise
            continue
        module.add_commands(sub)


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (the full usage of `serve` is forty), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    server = args.command in COMMANDS
    level = (args.log_level or os.environ.get("LIGHTGATE_LOG_LEVEL")
             or ("INFO" if server else "WARNING"))
    fmt = (args.log_format or os.environ.get("LIGHTGATE_LOG_FORMAT") or "text").lower()
    debug = level.upper() == "DEBUG"
    if fmt not in LOG_FORMATS:
        print(f"lightgate: --log-format {fmt!r} is not one of {', '.join(LOG_FORMATS)}",
              file=sys.stderr)
        sys.exit(2)
    try:
        logs.configure(level, fmt)
    except ValueError:
        print(f"lightgate: --log-level {level!r} is not one of debug, info, "
              "warning, error", file=sys.stderr)
        sys.exit(2)
    try:
        sys.exit(args.func(args))
    except KeyboardInterrupt:
        sys.exit(0)
    except BaseException as exc:
        # The one place a failure the user fixes becomes a line: a server's start-up
        # failure with status 2, a client command's with 1. trio hands it over inside
        # exception groups, from whichever nursery it crossed.
        if isinstance(exc, SystemExit):
            raise
        line, status = None, 2
        failure = first_of(exc, StartupError)
        if failure is not None:
            line = str(failure)
        elif not server:
            line, status = client_failure(exc, args), 1
        if line is None and fmt == "text":
            raise
        prefix = "lightgate" if server else f"lightgate {args.command}"
        if line is None:  # a bug, in JSON: one object, with the traceback in it
            logs.say(f"{prefix}: failed", logging.ERROR, exc)
            sys.exit(1)
        logs.say(f"{prefix}: {line}", logging.ERROR, exc if debug else None)
        sys.exit(status)


# Optional modules, by the extra that installs them (pyproject.toml).
EXTRAS = {"pyspark": "spark", "pyarrow": "spark", "pandas": "spark", "py4j": "spark",
          "paho": "spark"}


def client_failure(exc: BaseException, args: argparse.Namespace) -> str | None:
    """A client command's failure in one line that says what to do, or None for what
    is not the user's to fix (a bug: the traceback)."""
    from store import protocol as p
    from store.client import AuthFailed
    from store.common import StoreError
    from store.sdk import DeliveryTimeout

    notes = "; ".join(getattr(exc, "__notes__", []))
    if (found := first_of(exc, CommandError)) is not None:
        line = str(found)
    elif (found := first_of(exc, AuthFailed)) is not None:
        who = _credentials(args).get("username")
        said = (f"the store refused the credentials of {who!r}" if who else
                "the store needs credentials")
        line = (f"{said}: {found.message} ({found.status}); give a user's with --as "
                "NAME:PASSWORD or LIGHTGATE_AUTH")
    elif (found := first_of(exc, p.RemoteError)) is not None:
        line = f"{found.message} ({found.status})"
    elif (found := first_of(exc, DeliveryTimeout)) is not None:
        line = str(found)
    elif (found := first_of(exc, StoreError)) is not None:
        line = f"{found}; give the store's native HOST:PORT with --server"
    elif (found := first_of(exc, ModuleNotFoundError)) is not None:
        root = (found.name or "").partition(".")[0]
        if root not in EXTRAS:
            return None
        extra = EXTRAS[root]
        line = (f"needs {root}, which is not installed: pip install 'lightgate[{extra}]' "
                f"(in a checkout: pip install -e '.[{extra}]')")
    elif (found := first_of(exc, OSError)) is not None:
        line = str(found)
    else:
        return None
    return f"{line} ({notes})" if notes else line
