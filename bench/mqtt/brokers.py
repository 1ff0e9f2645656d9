"""The brokers under test, each started on a free 127.0.0.1 port with equivalent settings
for one scenario and stopped after it (SIGTERM), so that no scenario inherits another's
state; on its TLS listener instead, with the run's certificates, when the row asks for it
(Options). A broker that fails to start raises with its log's tail."""

from __future__ import annotations

import base64
import collections
import contextlib
import hashlib
import json
import os
import resource
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import ROOT
from .installs import (
    EPMD,
    MOSQUITTO,
    RABBITMQ_SERVER,
    RUMQTTD,
    RUMQTTD_MTLS,
    ensure_mosquitto,
    ensure_rabbitmq,
    ensure_rumqttd,
)
from .tls import Certs

BROKERS = ["mosquitto", "lightgate-async", "lightgate-sync", "lightgate-native",
           "lightgate-separated", "amqtt", "rabbitmq", "rumqttd"]
# Not in every run: the native plane's scaling row (the same scenario with 1 and 2 I/O
# threads), asked for by name (`make bench` runs it on the fan-out scenario).
SCALING = ["lightgate-native-io1", "lightgate-native-io2"]
# Asked for by name too: a 3-node store group with a gateway over it, and with two (the
# devices of device_fanin and device_fleet spread over both; every other row's clients,
# and the subscribers, on the first).
OPT_IN = [*SCALING, "lightgate-group", "lightgate-group-2gw"]
# The bounds every broker gets, as far as its settings allow: the Mosquitto config's.
MAX_INFLIGHT = 32
MAX_QUEUED = 100_000
MAX_PACKET = 1 << 20  # Lightgate's default --max-packet-size


@dataclass(frozen=True)
class Options:
    """What a row needs of its broker beyond the shared bounds: its TLS listener with the
    run's certificates (`certs`), asking every client for a certificate when `mutual`;
    room for `max_queued` messages per offline session (catchup_persistent)."""

    certs: Certs | None = None
    mutual: bool = False
    max_queued: int = MAX_QUEUED


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Window:
    """What the runner measures of a broker (CPU, py-spy): the whole scenario, unless the
    scenario narrows it to its timed window, calling begin() when the window opens and
    end() when it closes (so that e.g. thousands of CONNECTs before it do not count)."""

    def begin(self) -> None:
        pass

    def end(self) -> None:
        pass


@dataclass
class Broker:
    name: str
    port: int = 0
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)
    tmp: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="bench-")))
    groups: list[int] = field(default_factory=list)  # procs that lead a process group
    notes: str = ""  # what every row of this broker should say about how it ran
    keepalive: int = 0  # what its clients ask for in CONNECT (0: none)
    window: Window = field(default_factory=Window)  # the runner's, while a row runs
    opts: Options = field(default_factory=Options)
    python: list[int] = field(default_factory=list)  # pids of Lightgate processes
    # The MQTT ports of more gateways over the same store, beside `port`'s.
    more_ports: list[int] = field(default_factory=list)

    @property
    def ports(self) -> list[int]:
        """Every MQTT port: devices spread over them."""
        return [self.port, *self.more_ports]

    @property
    def pid(self) -> int:
        return self.procs[-1].pid  # the process that holds the MQTT connections

    def died(self) -> str | None:
        for p in self.procs:
            if p.poll() is not None:
                return f"broker process exited with {p.returncode}: {self.log_tail()}"
        return None

    def log_tail(self, n: int = 600) -> str:
        tails = [f.read_text(errors="replace")[-n:] for f in sorted(self.tmp.glob("*.log"))]
        return " | ".join(t.strip() for t in tails if t.strip())

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
        for pgid in self.groups:
            # Whatever outlived its group's leader (beam.smp if RabbitMQ's script was
            # killed) goes too, so that no scenario inherits a running VM.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        shutil.rmtree(self.tmp, ignore_errors=True)


def _spawn(b: Broker, cmd: list[str], tag: str, ready_line: bool,
           env: dict[str, str] | None = None, own_group: bool = False
           ) -> subprocess.Popen[Any]:
    log = open(b.tmp / f"{tag}.log", "w")  # noqa: SIM115 - the child owns it
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE if ready_line else log,
                         stderr=log, text=True, env=env, start_new_session=own_group)
    log.close()
    b.procs.append(p)
    if cmd[:3] == [sys.executable, "-m", "lightgate"]:
        b.python.append(p.pid)
    if own_group:
        b.groups.append(p.pid)
    return p


def _wait_ready(b: Broker, proc: subprocess.Popen[Any], timeout: float = 60) -> dict[str, str]:
    """Read the `ready k=v ...` line, bounded in time (a broker may hang on start-up)."""
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        raise RuntimeError(f"{b.name}: no ready line within {timeout:.0f} s: {b.log_tail()}")
    line = proc.stdout.readline()
    sel.close()
    if not line.startswith("ready"):
        raise RuntimeError(f"{b.name} did not start: {line!r} {b.log_tail()}")
    # Keep reading stdout so a chatty broker never blocks on a full pipe.
    threading.Thread(target=collections.deque, args=(proc.stdout, 0), daemon=True).start()
    return dict(p.split("=", 1) for p in line.split()[1:])


def _wait_port(b: Broker, port: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (err := b.died()) is not None:
            raise RuntimeError(err)
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{b.name}: nothing listens on {port}: {b.log_tail()}")


def _lightgate_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "lightgate", "--log-level", "WARNING", *args]


def start_broker(name: str, opts: Options | None = None) -> Broker:
    b = Broker(name, free_port(), opts=opts or Options())
    try:
        _start(b)
    except BaseException:
        b.stop()
        raise
    return b


# Brokers started with the load generator's clients on TLS: every one but the trio floor.
TLS_BROKERS = [*BROKERS, *OPT_IN]


def _start(b: Broker) -> None:
    name, opts = b.name, b.opts
    if opts.certs and name not in TLS_BROKERS:
        raise RuntimeError(f"{name} has no TLS listener here")
    if name == "mosquitto":
        ensure_mosquitto()
        conf = b.tmp / "mosquitto.conf"
        conf.write_text(mosquitto_config(b.port, opts))
        _spawn(b, [str(MOSQUITTO), "-c", str(conf)], "mosquitto", False)
        _wait_port(b, b.port)
        if opts.max_queued > MAX_QUEUED:
            b.notes = ("offline sessions' messages queued in memory (persistence false: "
                       "Mosquitto's persistence is a periodic snapshot)")
    elif name == "trio-floor":
        # What trio itself costs a message, stored (bench/floors.py: a task per
        # connection, each PUBLISH stored and indexed, then forwarded): QoS 0 only.
        _spawn(b, [sys.executable, str(ROOT / "bench" / "floors.py"), "serve", "taskstore",
                   str(b.port)], "trio-floor", False)
        _wait_port(b, b.port)
    elif name == "amqtt":
        tls = [str(opts.certs.cert), str(opts.certs.key), str(opts.certs.ca)] if \
            opts.certs else []
        p = _spawn(b, [sys.executable, str(ROOT / "bench" / "amqtt_broker.py"), str(b.port),
                       *tls], "amqtt", True)
        _wait_ready(b, p)
        _wait_port(b, b.port)
        if opts.mutual:
            b.notes = "amqtt verifies a client certificate when one comes (CERT_OPTIONAL)"
    elif name in ("lightgate-async", "lightgate-sync"):
        _start_lightgate(b, "--flush", name.split("-")[1], env={**os.environ,
                                                                "LIGHTGATE_NATIVE": "0"})
        b.notes = "the pure-Python data plane (LIGHTGATE_NATIVE=0)"
    elif name.startswith("lightgate-native"):
        threads = name.removeprefix("lightgate-native-io")
        extra = ["--io-threads", threads] if threads.isdigit() else []
        ready = _start_lightgate(b, "--flush", "async", *extra,
                                 env={**os.environ, "LIGHTGATE_NATIVE": "1"})
        if ready.get("plane") != "native":
            raise RuntimeError(f"{name}: the server runs plane={ready.get('plane')}")
        b.notes = "the native data plane (LIGHTGATE_NATIVE=1), --flush async"
        if opts.certs:
            b.notes += "; the engine holds each TLS session (rustls)"
    elif name == "lightgate-separated":
        url = _start_redis(b)
        store = _spawn(b, _lightgate_cmd("store", "--data-dir", str(b.tmp / "d"), "--native",
                                         "127.0.0.1:0", "--http", "127.0.0.1:0", "--notify",
                                         url), "store", True)
        native = _wait_ready(b, store)["native"]
        _start_gateway(b, native, url)
    elif name in ("lightgate-group", "lightgate-group-2gw"):
        _start_group(b, 2 if name.endswith("2gw") else 1)
    elif name == "rabbitmq":
        _start_rabbitmq(b)
    elif name == "rumqttd":
        binary = RUMQTTD_MTLS if opts.mutual else RUMQTTD
        ensure_rumqttd(binary)
        conf = b.tmp / "rumqttd.toml"
        conf.write_text(rumqttd_config(b.port, resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                                       opts))
        _spawn(b, [str(binary), "--quiet", "--config", str(conf)], "rumqttd", False)
        _wait_port(b, b.port)
        # It refuses a CONNECT without keepalive: its clients ask for the longest.
        b.keepalive = 0xFFFF
        b.notes = ("in memory (no persistence); its delivery window is fixed at 100 "
                   "unacked (compiled in), no bound on queued messages but its log's "
                   "segments; clients keepalive 65535 s (it refuses 0)")
        if opts.certs:
            b.notes += ("; rustls, each TLS handshake done in its accept loop, one at a time"
                        + (" (the build with verify-client-cert)" if opts.mutual else ""))
    else:
        raise ValueError(f"unknown broker {name}")


def mosquitto_config(port: int, opts: Options) -> str:
    """The same bounds as every broker: 32 in flight, `max_queued` queued per session."""
    conf = f"listener {port} 127.0.0.1\n"
    if opts.certs:
        conf += (f"certfile {opts.certs.cert}\nkeyfile {opts.certs.key}\n"
                 f"cafile {opts.certs.ca}\n")
        if opts.mutual:
            conf += "require_certificate true\n"
    return conf + ("allow_anonymous true\npersistence false\n"
                   f"max_inflight_messages {MAX_INFLIGHT}\n"
                   f"max_queued_messages {opts.max_queued}\n"
                   "log_dest stderr\nlog_type error\n")


def _lightgate_listeners(b: Broker, port: int | None = None) -> list[str]:
    """The MQTT listener on `port` (b.port): plain TCP, or TLS with the run's certificates
    (then the plain one is off, and WebSocket over TLS too)."""
    opts = b.opts
    port = b.port if port is None else port
    if not opts.certs:
        return ["--mqtt", f"127.0.0.1:{port}"]
    args = ["--mqtt", "off", "--wss", "off", "--mqtt-tls", f"127.0.0.1:{port}",
            "--tls-cert", str(opts.certs.cert), "--tls-key", str(opts.certs.key)]
    if opts.mutual:
        args += ["--tls-ca", str(opts.certs.ca), "--tls-client-auth", "required"]
    return args


def _lightgate_bounds(b: Broker) -> list[str]:
    # Same bounds as the Mosquitto config: 32 in flight, as many queued per offline
    # session, and no bound in bytes (Mosquitto's max_queued_bytes is 0, none).
    return ["--max-inflight", str(MAX_INFLIGHT), "--max-offline-messages",
            str(b.opts.max_queued), "--max-offline-bytes", "0"]


def _start_lightgate(b: Broker, *args: str, env: dict[str, str]) -> dict[str, str]:
    p = _spawn(b, _lightgate_cmd(
        "serve", "--data-dir", str(b.tmp / "d"), "--ws", "off", *_lightgate_listeners(b),
        "--native", "127.0.0.1:0", "--http", "127.0.0.1:0", *_lightgate_bounds(b), *args),
        "lightgate", True, env=env)
    return _wait_ready(b, p)


def _start_redis(b: Broker) -> str:
    """A redis-server of the broker's own for notify, on a free port: its URL."""
    if not shutil.which("redis-server"):
        raise RuntimeError("redis-server missing (apt-get install redis-server)")
    redis_port = free_port()
    _spawn(b, ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1",
               "--save", "", "--appendonly", "no"], "redis", False)
    _wait_port(b, redis_port)
    return f"redis://127.0.0.1:{redis_port}"


def _start_gateway(b: Broker, stores: str, url: str, port: int | None = None,
                   label: str = "gateway") -> None:
    """`lightgate gateway` over the store (a group: every node's address) on `port`
    (b.port), last in b.procs: the last holds b.port's MQTT connections."""
    gw = _spawn(b, _lightgate_cmd("gateway", "--store", stores, "--notify", url,
                                  *_lightgate_listeners(b, port), "--ws", "off", "--http",
                                  "127.0.0.1:0", *_lightgate_bounds(b)), label, True)
    _wait_ready(b, gw)


def _start_group(b: Broker, gateways: int = 1) -> None:
    """Three `lightgate store` nodes with their Raft controller (`--raft`, the shared
    `--raft-secret`), synchronous replication with at least 2 in sync, Redis notify, and
    `gateways` gateways over them once the group has its master and every node is in
    sync (b.port's last, so that b.pid is its)."""
    url = _start_redis(b)
    raft = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    secret = b.tmp / "group.secret"
    secret.write_text(f"{os.urandom(16).hex()}\n")
    natives, https = [], []
    for i in range(3):
        node = _spawn(b, _lightgate_cmd(
            "store", "--data-dir", str(b.tmp / f"s{i}"), "--native", "127.0.0.1:0",
            "--http", "127.0.0.1:0", "--raft", raft[i], "--group-peers", ",".join(raft),
            "--raft-secret", f"@{secret}", "--replication", "sync", "--min-insync", "2",
            "--notify", url), f"store{i}", True)
        ready = _wait_ready(b, node)
        natives.append(ready["native"])
        https.append(ready["http"])
    _wait_group(b, https)
    b.more_ports = [free_port() for _ in range(gateways - 1)]
    for i, port in enumerate(b.more_ports, 2):
        _start_gateway(b, ",".join(natives), url, port, f"gateway{i}")
    _start_gateway(b, ",".join(natives), url)
    b.notes = ("3 store nodes (Raft controller, --replication sync --min-insync 2), "
               + ("one gateway" if gateways == 1 else
                  f"{gateways} gateways (the devices spread over them)")
               + ", Redis notify; CPU of every process")


def _wait_group(b: Broker, https: list[str], timeout: float = 60) -> None:
    """Until one node is master and its in-sync set holds every node."""
    deadline = time.monotonic() + timeout
    roles: list[str | None] = []
    while time.monotonic() < deadline:
        if (err := b.died()) is not None:
            raise RuntimeError(err)
        roles, insync = [], 0
        for http in https:
            try:
                with urllib.request.urlopen(f"http://{http}/api/v1/cluster", timeout=2) as r:
                    state = json.loads(r.read())
                roles.append(state["role"])
                insync = max(insync, len(state.get("insync", [])))
            except (OSError, ValueError, KeyError):
                roles.append(None)
        if roles.count("master") == 1 and insync == len(https):
            return
        time.sleep(0.2)
    raise RuntimeError(f"{b.name}: no master with every node in sync within {timeout:.0f} s "
                       f"(roles {roles}): {b.log_tail()}")


def _start_rabbitmq(b: Broker) -> None:
    """A node of our own (RabbitMQ 3.10, Debian's): its own epmd, node name, cookie,
    config and directories under b.tmp, every port a free loopback one, the MQTT plugin
    alone; its script, beam.smp and beam's helpers in a process group of their own."""
    ensure_rabbitmq()
    epmd_port, amqp_port, dist_port = free_port(), free_port(), free_port()
    _spawn(b, [str(EPMD), "-port", str(epmd_port), "-address", "127.0.0.1"], "epmd", False)
    _wait_port(b, epmd_port)
    (b.tmp / "rabbitmq.conf").write_text(rabbitmq_config(b.port, amqp_port, b.tmp, b.opts))
    (b.tmp / "definitions.json").write_text(json.dumps(rabbitmq_definitions(
        b.opts.max_queued)))
    (b.tmp / "enabled_plugins").write_text("[rabbitmq_mqtt].\n")
    (b.tmp / "rabbitmq-env.conf").write_text("")  # not /etc/rabbitmq's
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    env = {**os.environ, "HOME": str(b.tmp),  # the Erlang cookie goes there
           "RABBITMQ_NODENAME": f"bench{os.getpid()}p{b.port}@localhost",
           "RABBITMQ_CONF_ENV_FILE": str(b.tmp / "rabbitmq-env.conf"),
           "RABBITMQ_CONFIG_FILE": str(b.tmp / "rabbitmq.conf"),
           "RABBITMQ_ADVANCED_CONFIG_FILE": str(b.tmp / "advanced.config"),
           "RABBITMQ_ENABLED_PLUGINS_FILE": str(b.tmp / "enabled_plugins"),
           "RABBITMQ_MNESIA_BASE": str(b.tmp / "mnesia"),
           "RABBITMQ_LOG_BASE": str(b.tmp / "log"),
           "RABBITMQ_LOGS": str(b.tmp / "rabbit.log"),
           "RABBITMQ_PID_FILE": str(b.tmp / "rabbit.pid"),
           "RABBITMQ_DIST_PORT": str(dist_port),
           "ERL_EPMD_PORT": str(epmd_port), "ERL_EPMD_ADDRESS": "127.0.0.1",
           # Distribution on loopback only; as many Erlang ports (sockets) as we have fds.
           "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS":
               f"-kernel inet_dist_use_interface {{127,0,0,1}} +Q {max(nofile, 1024)}"}
    _spawn(b, [str(RABBITMQ_SERVER)], "rabbitmq", False, env=env, own_group=True)
    # Its listeners open before the boot is over (a failed import still fails it later):
    # ready is the script's "completed" line, then the port.
    _wait_log(b, b.tmp / "rabbitmq.log", "Starting broker... completed", timeout=120)
    _wait_port(b, b.port)
    # Checked on 3.10: even a clean session's subscription queue is durable, so each
    # QoS 1 message (published persistent) is written to disk before its confirm.
    b.notes = ("RabbitMQ stores QoS 1 messages durably, as Lightgate does (persistent "
               "messages in durable queues, PUBACK on the publisher confirm); QoS 0 ones "
               "in memory")


def rabbitmq_config(mqtt_port: int, amqp_port: int, tmp: Path,
                    opts: Options | None = None) -> str:
    # prefetch: the unacknowledged QoS 1 deliveries per subscriber (the inflight window);
    # the queue bound is a policy in the definitions, imported at boot. With TLS the MQTT
    # listener is the ssl one alone.
    certs = opts.certs if opts else None
    if certs:
        verify = "verify_peer" if opts and opts.mutual else "verify_none"
        mqtt = ("mqtt.listeners.tcp = none\n"
                f"mqtt.listeners.ssl.default = 127.0.0.1:{mqtt_port}\n"
                f"ssl_options.cacertfile = {certs.ca}\nssl_options.certfile = {certs.cert}\n"
                f"ssl_options.keyfile = {certs.key}\nssl_options.verify = {verify}\n"
                f"ssl_options.fail_if_no_peer_cert = {str(verify == 'verify_peer').lower()}\n")
    else:
        mqtt = f"mqtt.listeners.tcp.default = 127.0.0.1:{mqtt_port}\n"
    return (f"listeners.tcp.default = 127.0.0.1:{amqp_port}\n" + mqtt +
            "mqtt.allow_anonymous = true\nmqtt.default_user = guest\n"
            f"mqtt.default_pass = guest\nmqtt.prefetch = {MAX_INFLIGHT}\n"
            "log.console = false\nlog.file.level = warning\n"
            "definitions.import_backend = local_filesystem\n"
            f"definitions.local.path = {tmp / 'definitions.json'}\n")


def rabbitmq_definitions(max_queued: int = MAX_QUEUED) -> dict[str, Any]:
    """What a fresh node would create (vhost /, user guest, loopback only as ever) plus
    the bound on each MQTT subscription's queue: a node that imports definitions at boot
    creates no defaults of its own."""
    salt = os.urandom(4)  # RabbitMQ's salted SHA-256 password hash, base64
    digest = base64.b64encode(salt + hashlib.sha256(salt + b"guest").digest()).decode()
    return {"vhosts": [{"name": "/"}],
            "users": [{"name": "guest", "password_hash": digest, "tags": ["administrator"],
                       "hashing_algorithm": "rabbit_password_hashing_sha256"}],
            "permissions": [{"user": "guest", "vhost": "/", "configure": ".*",
                             "write": ".*", "read": ".*"}],
            "policies": [{"vhost": "/", "name": "bench-queue-bound",
                          "pattern": "^mqtt-subscription-", "apply-to": "queues",
                          "priority": 0, "definition": {"max-length": max_queued}}]}


def rumqttd_config(port: int, max_connections: int, opts: Options | None = None) -> str:
    """rumqttd's TOML (its lib.rs: Config, RouterConfig, ServerSettings): one MQTT 3.1.1
    listener, no console, no metrics. Accepting without its default 1 ms pause between
    connections (next_connection_delay_ms) lets the idle scenario connect at full speed;
    max_inflight_count is how many packets it reads from a connection at once. TLS: its
    TlsConfig::Rustls (capath only for the build that verifies client certificates)."""
    return (f"id = 0\n\n[router]\nid = 0\nmax_connections = {max(max_connections, 10_010)}\n"
            "max_outgoing_packet_count = 200\nmax_segment_size = 104857600\n"
            "max_segment_count = 10\n\n"
            f'[v4.1]\nname = "v4-1"\nlisten = "127.0.0.1:{port}"\n'
            "next_connection_delay_ms = 0\n"
            "[v4.1.connections]\nconnection_timeout_ms = 60000\n"
            f"max_payload_size = {MAX_PACKET}\nmax_inflight_count = 100\n"
            "dynamic_filters = true\n" + _rumqttd_tls(opts))


def _rumqttd_tls(opts: Options | None) -> str:
    if not opts or not opts.certs:
        return ""
    ca = f'capath = "{opts.certs.ca}"\n' if opts.mutual else ""
    return (f'[v4.1.tls]\n{ca}certpath = "{opts.certs.cert}"\n'
            f'keypath = "{opts.certs.key}"\n')


def _wait_log(b: Broker, path: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (err := b.died()) is not None:
            raise RuntimeError(err)
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.2)
    raise RuntimeError(f"{b.name}: not started within {timeout:.0f} s: {b.log_tail()}")
