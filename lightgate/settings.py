"""The settings of the server commands: (flag, type, default, help) tables, one per
group, and which command reads which. `cli.py` turns them into flags and values;
`config_example.py` into the example file. Their own module, so that neither of those
imports the other."""

from __future__ import annotations

from typing import Any

# (flag, type, default, help) for the settings of `serve`/`store`.
STORE_SETTINGS: list[tuple[str, Any, Any, str]] = [
    ("data-dir", str, "data", "directory for the CommitLog, index and metadata"),
    ("flush", str, "async", "sync: ack after fsync (group commit); async: fsync periodically"),
    ("flush-interval-ms", int, 500, "async mode: fsync at least this often"),
    ("segment-size", int, 1 << 30, "CommitLog segment size in bytes"),
    ("retention-hours", float, 72.0, "delete whole segments older than this"),
    ("retention-bytes", int, None, "delete the oldest segments beyond this total size"),
    ("retention-check-s", float, 60.0, "how often retention looks for segments to delete"),
    ("partitions", int, 4, "default partitions of a first-level topic"),
    ("native-max-partial-bytes", int, 256 * 1024 * 1024, "bytes of partly received native "
     "frames the store holds; past it the connections holding the most wait (0: no budget)"),
    ("full-verify", bool, False, "verify every CommitLog record on start, not just the tail"),
    ("wildcard-idle-s", float, 600.0, "unregister a wildcard queue no session has used for "
     "this long, so messages stop being indexed into it (0: never)"),
    # Memory (README, "Sizing"): a small device may halve them all, a big node raise them.
    ("index-cache-mb", int, 32, "the light-queue index's RocksDB block cache, MiB"),
    ("index-memtable-mb", int, 16, "the index's write buffer (two at most), MiB"),
    ("metadata-cache-mb", int, 16, "the metadata's RocksDB block cache (sessions, offsets, "
     "retained ...), MiB"),
    ("metadata-memtable-mb", int, 4, "the metadata's write buffers over all its column "
     "families, MiB"),
    ("recent-cache-mb", int, 32, "recent messages kept in memory for readers at the head "
     "of their queue, MiB"),
    ("recent-per-queue", int, 65536, "recent messages kept per queue being read"),
]
# A store group (README, "Store groups and high availability"): `lightgate store` only.
REPLICATION_SETTINGS: list[tuple[str, Any, Any, str]] = [
    ("replica-of", str, None, "HOST:PORT: copy this master's CommitLog and metadata (a "
     "fixed replica, no controller; with --group-peers the controller decides)"),
    ("replication", str, "async", "async: ack when the master has the bytes; sync: when "
     "every node of the in-sync set has them"),
    ("min-insync", int, 1, "sync mode: the in-sync set (master included) must have at least "
     "this many nodes; with fewer, writes are refused"),
    ("max-lag-bytes", int, 64 * 1024 * 1024, "a replica further behind leaves the in-sync "
     "set"),
    ("max-lag-s", float, 2.0, "a replica that has not fetched for this long leaves the "
     "in-sync set (sync mode: acks wait for it until then)"),
    ("raft", str, None, "HOST:PORT the embedded controller's Raft port binds (with "
     "--group-peers)"),
    ("raft-advertise", str, None, "HOST:PORT the other nodes reach this node's Raft port at "
     "(default: --raft; set it behind NAT, a proxy or a Kubernetes Service)"),
    ("raft-secret", str, None, "VALUE or @FILE: the group secret every node of the group "
     "shares: Raft messages without it are dropped unread, and a replica proves it to fetch "
     "the master's log. Required with --group-peers"),
    ("group-peers", str, None, "every store node's Raft address (as advertised), comma list; "
     "this node's own may be listed too. Turns on the controller and automatic failover"),
    ("node-id", str, None, "this node's name in the group (default: its Raft address)"),
    ("native-advertise", str, None, "HOST:PORT other nodes and clients reach this node's "
     "native port at (default: --native as bound; set it when binding 0.0.0.0)"),
    ("controller-lease-s", float, 3.0, "a master acknowledges writes only this long after "
     "the controller last heard from it; then it steps down"),
    ("failover-after-s", float, 4.0, "the controller elects a new master once the master "
     "has not reported for this long (at least --controller-lease-s + 0.5)"),
    ("replica-auth", str, None, "NAME:PASSWORD of a Super user a replica without the group "
     "secret (--replica-of, no --raft-secret) fetches from its master with, when it runs "
     "with --auth"),
]
HTTP_SETTING = ("http", str, "127.0.0.1:18083", "HTTP (dashboard, admin API, metrics) HOST:PORT")
HTTP_BODY_SETTING = ("http-max-body", int, 1024 * 1024, "largest HTTP request body (413 past it)")
NATIVE_SETTING = ("native", str, "127.0.0.1:10911", "native protocol HOST:PORT")
NOTIFY_SETTING = ("notify", str, None, "notify between nodes: redis://HOST:PORT")
STORE_ADDR_SETTING = ("store", str, "127.0.0.1:10911", "the store's native HOST:PORT; a "
                      "store group: every node's, comma-separated (the master is followed)")
STORE_WAIT_SETTING = ("store-wait-s", float, 0.0, "at start, how long to wait for the store "
                      "(a group: for its master) before giving up; 0: wait for good")
LISTENER_SETTINGS: list[tuple[str, Any, Any, str]] = [
    ("mqtt", str, "0.0.0.0:1883", "MQTT over TCP HOST:PORT ('off' to disable)"),
    ("mqtt-tls", str, "0.0.0.0:8883", "MQTT over TLS HOST:PORT (on when --tls-cert is given)"),
    ("ws", str, "0.0.0.0:8083", "MQTT over WebSocket HOST:PORT ('off' to disable)"),
    ("wss", str, "0.0.0.0:8084", "MQTT over secure WebSocket HOST:PORT (on with --tls-cert)"),
    ("tls-cert", str, None, "PEM certificate chain for TLS and WSS (re-read when it changes)"),
    ("tls-key", str, None, "PEM private key for --tls-cert"),
    ("tls-ca", str, None, "CA bundle that signs client certificates (mutual TLS)"),
    ("tls-client-auth", str, "none", "client certificates: none, optional or required"),
    ("tls-username-from", str, "none", "use the client certificate's cn or san as username"),
]
GATEWAY_SETTINGS: list[tuple[str, Any, Any, str]] = [
    *LISTENER_SETTINGS,
    ("max-inflight", int, 32, "unacknowledged QoS 1/2 messages per client"),
    ("max-packet-size", int, 1024 * 1024, "largest MQTT packet accepted, in bytes"),
    ("max-connect-packet", int, 64 * 1024, "largest packet (the CONNECT with its will, a "
     "SCRAM AUTH) before the client is authenticated, and largest WebSocket message begun "
     "before it"),
    ("max-partial-bytes", int, 64 * 1024 * 1024, "bytes of partly received packets the node "
     "holds, over TCP, TLS and WebSocket; past it the clients holding the most stop being "
     "read (0: no budget)"),
    ("partial-timeout-s", float, 10.0, "close a client held back by --max-partial-bytes "
     "for this long"),
    ("max-pending-publishes", int, 64, "publishes per client in the store pipeline at once"),
    ("max-offline-messages", int, 10_000,
     "per queue of an offline persistent session; older ones are dropped on reconnect"),
    ("sys-interval", float, 10.0, "seconds between $SYS/broker/... updates"),
    ("max-keepalive", int, 0, "longest keepalive allowed; v5 clients get Server Keep Alive"),
    ("write-timeout", float, 60.0, "disconnect a client that reads nothing for this long"),
    ("max-connections", int, 0, "refuse connects beyond this many clients (0: no limit)"),
    ("max-connect-rate", float, 0.0, "connects per second per source IP (0: no limit)"),
    ("max-publish-rate", float, 0.0, "publishes per second per client (0: no limit)"),
    ("max-publish-bytes-rate", float, 0.0, "publish bytes per second per client (0: no limit)"),
    ("max-subscriptions", int, 1000, "subscriptions per client (0: no limit)"),
    ("max-topic-levels", int, 128, "levels of a topic name or filter (0: no limit)"),
    ("max-topic-length", int, 4096, "characters of a topic name or filter (0: no limit)"),
    ("max-retained", int, 100_000, "retained messages held (0: no limit)"),
    ("max-retained-bytes", int, 256 * 1024 * 1024,
     "bytes of retained messages held, as stored: topic, properties and payload"),
    ("max-retained-per-client", int, 1000, "retained messages one client id may set"),
    ("max-retained-bytes-per-client", int, 16 * 1024 * 1024,
     "bytes of retained messages one client id may set (counted as for "
     "--max-retained-bytes)"),
    ("v3-session-expiry-s", float, 7200.0, "MQTT 3.1.1 persistent sessions end this long "
     "after the client left (0: never)"),
    ("max-sessions", int, 100_000, "persistent sessions held; new ones past it are refused "
     "(0: no limit)"),
    ("max-offline-bytes", int, 64 * 1024 * 1024, "per queue of an offline persistent "
     "session, in message bytes; older ones are dropped on reconnect (0: no limit)"),
    ("wildcard-touch-s", float, 60.0, "how often the wildcard filters in use here are "
     "reported to the store (keep it well under the store's --wildcard-idle-s)"),
    ("audit-log", str, None, "write the [AUTHENTICATION]/[AUTHORIZATION] audit lines here"),
]
AUTH_SETTINGS: list[tuple[str, Any, Any, str]] = [
    ("auth", bool, False, "authentication and ACL on (users and policies in the store)"),
    ("init-user", str, None, "NAME:PASSWORD: create this Super user on first start"),
    ("allow-anonymous", bool, False, "with --auth, let clients without a username in "
     "(they get the policies of user 'anonymous')"),
    ("auth-strategy", str, "stateful", "stateful: decide once per connection and resource "
     "until policies change; stateless: decide every request"),
]
# Backends MQTT clients may authenticate with beside the built-in users (serve, gateway).
AUTH_BACKEND_SETTINGS: list[tuple[str, Any, Any, str]] = [
    ("auth-order", str, None, "MQTT authentication backends in order, first definite answer "
     "wins: builtin,jwt,http (default: builtin, then each one configured); any but builtin "
     "turns authentication on"),
    ("auth-jwt-secret", str, None, "JWT in the password, HS256 with this secret (VALUE or "
     "@FILE)"),
    ("auth-jwt-jwks", str, None, "JWT in the password, RS256/ES256 with the keys of this "
     "JWKS file or http(s) URL"),
    ("auth-jwt-jwks-refresh-s", float, 300.0, "re-read the JWKS this often"),
    ("auth-jwt-algorithms", str, None, "accepted JWT algorithms, comma list (default: HS256 "
     "with a secret, RS256,ES256 with a JWKS)"),
    ("auth-http-url", str, None, "POST CONNECTs (JSON) to this auth hook URL"),
    ("auth-http-timeout-s", float, 5.0, "how long to wait for the auth hook"),
    ("auth-http-cache-s", float, 30.0, "remember the hook's answers this long (0: never)"),
    ("auth-http-on-error", str, "deny", "when the hook fails or times out: deny, allow or "
     "next (ask the next backend)"),
    ("auth-http-acl", bool, False, "also ask the hook for each PUBLISH/SUBSCRIBE of the "
     "clients it let in"),
]
GATEWAY_AUTH_SETTINGS: list[tuple[str, Any, Any, str]] = [
    ("store-auth", str, None, "NAME:PASSWORD this gateway authenticates to the store with "
     "(a node user: lightgate user add NAME --node)"),
    ("auth-strategy", str, "stateful", "stateful or stateless ACL decisions"),
]

AUDIT_SETTING = ("audit-log", str, None, "write the audit lines to this file")
SERVE_SETTINGS = [*STORE_SETTINGS, *GATEWAY_SETTINGS, *AUTH_SETTINGS, *AUTH_BACKEND_SETTINGS,
                  NATIVE_SETTING, HTTP_SETTING, HTTP_BODY_SETTING]
STORE_CMD_SETTINGS = [*STORE_SETTINGS, *AUTH_SETTINGS, AUDIT_SETTING, NATIVE_SETTING,
                      NOTIFY_SETTING, HTTP_SETTING, HTTP_BODY_SETTING, *REPLICATION_SETTINGS]
GATEWAY_CMD_SETTINGS = [STORE_ADDR_SETTING, STORE_WAIT_SETTING, NOTIFY_SETTING, *GATEWAY_SETTINGS,
                        *GATEWAY_AUTH_SETTINGS, *AUTH_BACKEND_SETTINGS, HTTP_SETTING,
                        HTTP_BODY_SETTING]


def all_settings() -> dict[str, tuple[str, Any, Any, str]]:
    """Every setting of the server commands by config key (the first definition wins)."""
    out: dict[str, tuple[str, Any, Any, str]] = {}
    for setting in (*SERVE_SETTINGS, *STORE_CMD_SETTINGS, *GATEWAY_CMD_SETTINGS):
        out.setdefault(setting[0].replace("-", "_"), setting)
    return out
