"""The store's settings, with their defaults: the storage node's, a store group's and
authentication's. Each one made with `setting` is also a flag of `lightgate serve` or
`lightgate store`, read from here (lightgate.settings). Light on imports: the command
line reads it for every command, a gateway's too."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lightqueue import sizes as index_sizes
from serving.settings import setting
from serving.values import HTTP_MAX_BODY
from store import recent as recent_sizes

MiB = 1024 * 1024
# The metadata's memory bounds by default (store.metadata): one block cache and the
# memtables of every column family together.
METADATA_CACHE_MB = 16
METADATA_MEMTABLE_MB = 4


@dataclass
class StoreConfig:
    data_dir: Path = setting(Path("data"), "directory for the CommitLog, index and metadata",
                             type=str)
    flush: str = setting(
        "async", "sync: ack after fsync (group commit); async: fsync periodically",
        choices=("sync", "async"))
    flush_interval_ms: int = setting(500, "async mode: fsync at least this often", least=1)
    segment_size: int = setting(1 << 30, "CommitLog segment size in bytes", least=4096)
    retention_hours: float | None = setting(72.0, "delete whole segments older than this", above=0,
                                           live=True)
    retention_bytes: int | None = setting(
        None, "delete the oldest segments beyond this total size", least=1, live=True)
    retention_check_s: float = setting(
        60.0, "how often retention looks for segments to delete", above=0, live=True)
    default_partitions: int = setting(
        4, "default partitions of a first-level topic", flag="partitions", least=1)
    # Bytes of partly received native frames the store holds over all its connections
    # (see serving/read_budget.py). 0: no budget.
    native_max_partial_bytes: int = setting(
        256 * MiB, "bytes of partly received native frames the store holds; past it the "
        "connections holding the most wait (0: no budget)", least=0, group="limits")
    # NACK copies a message into its group's retry (or dead-letter) queue: a reader with
    # no right to publish could fill the disk (store.redelivery).
    max_retry_messages: int = setting(
        100_000, "messages a consumer group's retry and dead-letter queues may hold (what "
        "retention keeps of them); a NACK past it is refused (0: no limit)", least=0,
        group="limits")
    # Bytes of a native connection's answers not yet written to it (store.outbox): past
    # it the connection's next requests wait. 0: no budget.
    native_max_unsent_bytes: int = setting(
        32 * MiB, "bytes of answers a native connection may have unsent (being read, "
        "queued, being written); past it its requests wait until it reads (0: no budget)", least=0,
        group="limits")
    full_verify: bool = setting(
        False, "verify every CommitLog record on start, not just the tail")
    # Start-up verifies the log from the checkpoint's segment on; the older segments are
    # verified after it, in the background, at most this fast (0: not).
    verify_mb_per_s: float = setting(
        32.0, "verify the CommitLog segments start-up did not, in the background, at most "
        "this many MiB/s (0: not)", least=0)
    # A registered wildcard queue that no gateway has touched for this long and that no
    # stored reader position names (persistent sessions, shared groups) is unregistered:
    # every message was indexed into every wildcard filter ever used. 0: never.
    wildcard_idle_s: float = setting(
        600.0, "unregister a wildcard queue no session has used for this long, so "
        "messages stop being indexed into it (0: never)", least=0, live=True)
    # Memory (docs/configuration.md, "Sizing"): RocksDB block caches and memtables, and the ring of
    # recent messages that readers at the head of a queue are served from (store.recent).
    # A small device may halve them all, a big node raise them.
    index_cache_mb: int = setting(
        index_sizes.CACHE_MB, "the light-queue index's RocksDB block cache, MiB", least=1)
    index_memtable_mb: int = setting(
        index_sizes.MEMTABLE_MB, "the index's write buffer (two at most), MiB", least=1)
    metadata_cache_mb: int = setting(
        METADATA_CACHE_MB, "the metadata's RocksDB block cache (sessions, offsets, "
        "retained ...), MiB", least=1)
    metadata_memtable_mb: int = setting(
        METADATA_MEMTABLE_MB, "the metadata's write buffers over all its column "
        "families, MiB", least=1)
    recent_cache_mb: int = setting(
        recent_sizes.MAX_BYTES // MiB, "recent messages kept in memory for readers at "
        "the head of their queue, MiB", least=1)
    recent_per_queue: int = setting(
        recent_sizes.PER_QUEUE, "recent messages kept per queue being read", least=1)
    # Idempotent producers (store.producers): each producer id, and each first-level
    # topic one writes to, is remembered until it has sent nothing for the idle time.
    max_producers: int = setting(
        10_000, "idempotent producers the store remembers: producer ids, and the sequence "
        "of each first-level topic one writes to; past it new ones are refused", least=1,
        group="limits")
    producer_idle_s: float = setting(
        7 * 24 * 3600.0, "forget an idempotent producer (its id and sequences) that sent "
        "nothing for this long; a retry after it may be stored twice", above=0,
        group="limits", live=True)
    flush_bytes: int = 16 << 20
    max_pending_appends: int = 10_000
    http_max_body: int = HTTP_MAX_BODY  # the store's HTTP API (413 past it)
    http_allowed_hosts: tuple[str, ...] = ()  # Host names beside loopback and IPs
    # The native engine as the CommitLog's one writer, with this many I/O threads (0:
    # none, the Python writer): `lightgate serve` on the native plane sets it, and so
    # does `lightgate store` in no group (store.app.native_carries).
    engine_threads: int = 0


@dataclass
class ReplicationConfig:
    """A store group (`lightgate store` only): replication, the controller, failover."""

    replica_of: str | None = setting(  # a fixed master (no controller)
        None, "HOST:PORT: copy this master's CommitLog and metadata (a fixed replica, no "
        "controller; with --group-peers the controller decides)")
    mode: str = setting(  # sync: acks wait for every node of the in-sync set
        "async", "async: ack when the master has the bytes; sync: when every node of the "
        "in-sync set has them", flag="replication", choices=("sync", "async"))
    min_insync: int = setting(  # sync: writes are refused while the in-sync set is smaller
        1, "sync mode: the in-sync set (master included) must have at least this many "
        "nodes; with fewer, writes are refused", least=1)
    max_lag_bytes: int = setting(
        64 * MiB, "a replica further behind leaves the in-sync set", least=1)
    max_lag_s: float = setting(
        2.0, "a replica that has not fetched for this long leaves the in-sync set (sync "
        "mode: acks wait for it until then)", above=0)
    raft: str | None = setting(  # this node's Raft bind HOST:PORT (with group_peers)
        None, "HOST:PORT the embedded controller's Raft port binds (with --group-peers)")
    raft_advertise: str | None = setting(  # the Raft HOST:PORT peers dial
        None, "HOST:PORT the other nodes reach this node's Raft port at (default: --raft; "
        "set it behind NAT, a proxy or a Kubernetes Service)")
    raft_secret: str | None = setting(  # the group secret Raft messages are checked with
        None, "VALUE or @FILE: the group secret every node of the group shares: Raft "
        "messages without it are dropped unread, and a replica proves it to fetch the "
        "master's log. Required with --group-peers")
    group_peers: list[str] = setting(  # the other nodes' Raft addresses
        help="every store node's Raft address (as advertised), comma list; this node's "
        "own may be listed too. Turns on the controller and automatic failover",
        type=str, default_factory=list)
    node_id: str | None = setting(  # None: the Raft address, else the native one
        None, "this node's name in the group (default: its Raft address)")
    advertise: str | None = setting(  # None: the native address as bound
        None, "HOST:PORT other nodes and clients reach this node's native port at "
        "(default: --native as bound; set it when binding 0.0.0.0)", flag="native-advertise")
    lease_s: float = setting(  # a master acknowledges only this long after a report
        3.0, "a master acknowledges writes only this long after the controller last heard "
        "from it; then it steps down", flag="controller-lease-s", above=0)
    dead_s: float = setting(  # the controller elects a new master after this long
        4.0, "the controller elects a new master once the master has not reported for "
        "this long (at least --controller-lease-s + 0.5)", flag="failover-after-s", above=0)
    credentials: tuple[str, str] | None = setting(  # to fetch from a master with --auth
        None, "NAME:PASSWORD of a Super user a replica without the group secret "
        "(--replica-of, no --raft-secret) fetches from its master with, when it runs with "
        "--auth", flag="replica-auth", type=str)
    ack_timeout_s: float = 5.0  # a sync append not replicated by then fails


@dataclass
class AuthConfig:
    """Authentication and authorisation of a storage node (and of `lightgate serve`)."""

    enabled: bool = setting(
        False, "authentication and ACL on (users and policies in the store)", flag="auth")
    init_user: str | None = setting(  # a Super user created on first start
        None, "NAME:PASSWORD: create this Super user on first start")
    allow_anonymous: bool = setting(  # clients without a username get ANONYMOUS's policies
        False, "with --auth, let clients without a username in (they get the policies of "
        "user 'anonymous')")
    strategy: str = setting(  # stateless: decide every request afresh
        "stateful", "stateful: decide once per connection and resource until policies "
        "change; stateless: decide every request", flag="auth-strategy",
        choices=("stateful", "stateless"))
    audit_log: str | None = setting(  # a file for the audit lines alone
        None, "write the [AUTHENTICATION]/[AUTHORIZATION] audit lines to this file")
    # The backends MQTT clients meet, in order (--auth-order): any but the built-in users
    # turns authentication on, and then the store's own clients need a Super user too.
    mqtt_chain: tuple[str, ...] = ("builtin",)

    @property
    def on(self) -> bool:
        return self.enabled or any(name != "builtin" for name in self.mqtt_chain)
