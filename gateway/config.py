"""The gateway's settings, with their defaults: each one made with `setting` is also a
flag of `lightgate serve` and `lightgate gateway`, read from here (lightgate.settings).
Light on imports: the command line reads it for every command."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.auth.chain import BackendConfig
from serving.settings import setting
from serving.values import HTTP_ADDR, HTTP_MAX_BODY, NATIVE_ADDR

MiB = 1024 * 1024
MAX_PACKET = 268_435_455  # the largest MQTT packet's remaining length (gateway.mqtt.codec)


@dataclass
class GatewayConfig:
    max_inflight: int = setting(32, "unacknowledged QoS 1/2 messages per client",
        least=1, most=65535)
    # As EMQX: a larger payload belongs in object storage.
    max_packet_size: int = setting(MiB, "largest MQTT packet accepted, in bytes",
        least=64, most=MAX_PACKET)
    # Before CONNECT nobody is authenticated: the first packet may not be larger.
    max_connect_packet: int = setting(
        64 * 1024, "largest packet (the CONNECT with its will, a SCRAM AUTH) before the "
        "client is authenticated, and largest WebSocket message begun before it",
        least=64, most=MAX_PACKET)
    # Bytes of partially received packets the whole node holds before the connections
    # holding the most stop reading; closed if still over after partial_timeout_s.
    max_partial_bytes: int = setting(
        64 * MiB, "bytes of partly received packets the node holds, over TCP, TLS and "
        "WebSocket; past it the clients holding the most stop being read (0: no budget)", least=0)
    partial_timeout_s: float = setting(
        10.0, "close a client held back by --max-partial-bytes for this long", above=0)
    max_pending_publishes: int = setting(
        64, "publishes per client in the store pipeline at once", least=1, most=65535)
    max_offline_messages: int = setting(
        10_000, "per queue of an offline persistent session; older ones are dropped on "
        "reconnect", least=0, live=True)
    connect_timeout: float = 10.0
    pull_batch: int = 256
    offsets_flush_interval: float = 0.5
    sys_interval: float = setting(10.0, "seconds between $SYS/broker/... updates", above=0,
                                 group="observability")
    # The native data plane's reactors (LIGHTGATE_NATIVE=1); None: one per core.
    io_threads: int | None = setting(
        None, "I/O threads of the native data plane (none given: one per core); taken "
        "where the native plane runs", least=1)
    expiry_check_interval: float = 30.0
    max_qos: int = 2
    max_keepalive: int = setting(
        0, "longest keepalive allowed; v5 clients get Server Keep Alive",
        least=0, most=65535)  # 0: any
    # What waits for a client's socket (gateway.backpressure): past the mark the client
    # is not read and nothing is delivered to it until a quarter of it is left.
    max_unsent_bytes: int = setting(
        2 * MiB, "bytes waiting for a client's socket (each packet counting 64 more) past "
        "which it is not read and gets no deliveries, until a quarter is left", least=1)
    write_timeout: float = setting(
        60.0, "disconnect a client that takes less than --min-drain-bytes of what waits "
        "for it (all of it, if less waits) within this long", above=0)
    min_drain_bytes: int = setting(
        64 * 1024, "bytes a client with answers waiting must take per --write-timeout", least=1)
    topic_alias_maximum: int = 64  # per connection, client to server (v5)
    # Limits; 0 means unlimited.
    max_connections: int = setting(
        0, "refuse connects beyond this many clients (0: no limit)", least=0, live=True)
    max_connect_rate: float = setting(
        0.0, "connects per second per source IP (0: no limit)", least=0)
    max_publish_rate: float = setting(
        0.0, "publishes per second per client, from its next connection (0: no limit)",
        least=0, live=True)
    max_publish_bytes_rate: float = setting(
        0.0, "publish bytes per second per client, from its next connection (0: no limit)",
        least=0, live=True)
    max_subscriptions: int = setting(1000, "subscriptions per client (0: no limit)", least=0,
                                    live=True)
    max_topic_levels: int = setting(128, "levels of a topic name or filter (0: no limit)", least=0)
    max_topic_length: int = setting(
        4096, "characters of a topic name or filter (0: no limit)", least=0, most=65535)
    # Retained messages, in total and per publishing client (0: no limit).
    max_retained: int = setting(100_000, "retained messages held (0: no limit)", least=0)
    max_retained_bytes: int = setting(
        256 * MiB, "bytes of retained messages held, as stored: topic, properties and "
        "payload", least=0)
    max_retained_per_client: int = setting(
        1000, "retained messages one client id may set", least=0)
    max_retained_bytes_per_client: int = setting(
        16 * MiB, "bytes of retained messages one client id may set (counted as for "
        "--max-retained-bytes)", least=0)
    # Persistent sessions: 3.1.1 has no session expiry, so without one an abandoned
    # client id is kept forever (as EMQX: two hours). New persistent sessions past
    # max_sessions are refused.
    v3_session_expiry_s: float = setting(
        7200.0, "MQTT 3.1.1 persistent sessions end this long after the client left "
        "(0: never)", least=0)
    max_sessions: int = setting(
        100_000, "persistent sessions held; new ones past it are refused (0: no limit)", least=0)
    max_offline_bytes: int = setting(
        64 * MiB, "per queue of an offline persistent session, in message bytes; older "
        "ones are dropped on reconnect (0: no limit)", least=0, live=True)
    # History read for replay subscriptions and not handed out yet (gateway.replay_budget).
    max_replay_bytes: int = setting(
        256 * MiB, "bytes of replay history the gateway holds for all clients (0: no "
        "limit)", least=0)
    max_replay_bytes_per_client: int = setting(
        8 * MiB, "bytes of replay history the gateway holds for one client: read ahead "
        "no further than this (0: no limit)", least=0)
    http_max_body: int = HTTP_MAX_BODY  # admin API and dashboard (413 past it)
    http_allowed_hosts: tuple[str, ...] = ()  # Host names beside loopback and IPs
    # How often the wildcard filters this gateway's sessions read are touched in the
    # store, which unregisters those nobody touched for its --wildcard-idle-s.
    wildcard_touch_s: float = setting(
        60.0, "how often the wildcard filters in use here are reported to the store (keep "
        "it well under the store's --wildcard-idle-s)", above=0, group="store")


TLS_LISTENERS = ("mqtt_tls", "wss")  # on only with a certificate


@dataclass
class ListenerConfig:
    """Where MQTT clients connect: an address each listener binds ('off' turns it off;
    the TLS ones are on only with --tls-cert), and TLS's files and rules."""

    mqtt: str | None = setting("0.0.0.0:1883", "MQTT over TCP HOST:PORT ('off' to disable)")
    mqtt_tls: str | None = setting(
        "0.0.0.0:8883", "MQTT over TLS HOST:PORT (on when --tls-cert is given)")
    ws: str | None = setting(
        "0.0.0.0:8083", "MQTT over WebSocket HOST:PORT ('off' to disable)")
    wss: str | None = setting(
        "0.0.0.0:8084", "MQTT over secure WebSocket HOST:PORT (on with --tls-cert)")
    tls_cert: str | None = setting(
        None, "PEM certificate chain for TLS and WSS (re-read when it changes, and on "
        "SIGHUP)", group="security")
    tls_key: str | None = setting(None, "PEM private key for --tls-cert", group="security")
    tls_ca: str | None = setting(
        None, "CA bundle that signs client certificates (mutual TLS)", group="security")
    tls_client_auth: str = setting(
        "none", "client certificates: none, optional or required",
        choices=("none", "optional", "required"), group="security")
    tls_username_from: str = setting(
        "none", "use the client certificate's cn or san as username",
        choices=("none", "cn", "san"), group="security")
    tls_handshake_timeout: float = setting(
        10.0, "seconds a TLS client has for its handshake (then closed)", above=0,
        group="security")
    tls_max_handshakes: int = setting(
        1024, "TLS handshakes under way at once, at most; the next clients wait their "
        "turn", least=1, group="limits")

    def address(self, name: str) -> str | None:
        """Where listener `name` (mqtt, mqtt_tls, ws, wss) binds; None when it is off."""
        addr: str | None = getattr(self, name)
        if not addr or addr == "off" or (name in TLS_LISTENERS and not self.tls_cert):
            return None
        return addr

    def check(self) -> None:
        """ValueError with the flag to fix, for settings that cannot work together."""
        if self.tls_cert and not self.tls_key:
            raise ValueError("--tls-cert needs --tls-key")
        if self.tls_client_auth != "none" and not self.tls_ca:
            raise ValueError("--tls-client-auth optional|required needs --tls-ca (the CA "
                             "that signs client certificates)")


@dataclass
class GatewayOptions:
    """`lightgate gateway`: a gateway on a store that runs elsewhere (gateway.app)."""

    store: str = setting(NATIVE_ADDR, "the store's native HOST:PORT; a store group: every "
                         "node's, comma-separated (the master is followed)")
    store_wait_s: float = setting(  # 0: for good
        0.0, "at start, how long to wait for the store (a group: for its master) before "
        "giving up; 0: wait for good", least=0)
    peers: list[str] = setting(  # MQTT 5 Server Reference when clients are sent away
        help="the other gateways' MQTT HOST:PORT, comma list: named to MQTT 5 clients "
        "(Server Reference) when this gateway sends them away", type=str,
        default_factory=list)
    master_unreachable_s: float = setting(
        10.0, "a gateway that cannot reach its store group's master this long while the "
        "other nodes name one answers 503 on /readyz and sends its MQTT clients to "
        "another gateway (--peers)", above=0)
    notify: str | None = None  # redis://...; None: poll the store
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    listeners: ListenerConfig = field(default_factory=ListenerConfig)
    http: str = HTTP_ADDR
    store_auth: str | None = setting(
        None, "NAME:PASSWORD this gateway authenticates to the store with (a node user: "
        "lightgate user add NAME --node)", group="security")
    auth_strategy: str | None = None  # None: the store's default (AuthConfig)
    audit_log: str | None = None
    auth_backends: BackendConfig = field(default_factory=BackendConfig)  # jwt, http hook
