"""The gateway's settings, with their defaults."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GatewayConfig:
    max_inflight: int = 32  # QoS 1/2 messages unacknowledged per client (server side)
    max_packet_size: int = 1024 * 1024  # as EMQX; a larger payload belongs in object storage
    # Before CONNECT nobody is authenticated: the first packet may not be larger.
    max_connect_packet: int = 64 * 1024
    # Bytes of partially received packets the whole node holds before the connections
    # holding the most stop reading; closed if still over after partial_timeout.
    max_partial_bytes: int = 64 * 1024 * 1024
    partial_timeout_s: float = 10.0
    max_pending_publishes: int = 64  # inbound publishes in the store pipeline per client
    max_offline_messages: int = 10_000  # per queue of a persistent session; older dropped
    connect_timeout: float = 10.0
    pull_batch: int = 256
    offsets_flush_interval: float = 0.5
    sys_interval: float = 10.0
    expiry_check_interval: float = 30.0
    max_qos: int = 2
    max_keepalive: int = 0  # 0: accept any; else clients get Server Keep Alive (v5)
    write_timeout: float = 60.0  # a client that reads nothing this long is disconnected
    topic_alias_maximum: int = 64  # per connection, client to server (v5)
    # Limits; 0 means unlimited.
    max_connections: int = 0
    max_connect_rate: float = 0.0  # connects per second per source IP
    max_publish_rate: float = 0.0  # publishes per second per client
    max_publish_bytes_rate: float = 0.0  # publish payload bytes per second per client
    max_subscriptions: int = 1000  # per client (0: no limit)
    max_topic_levels: int = 128  # of a topic name or filter
    max_topic_length: int = 4096  # characters of a topic name or filter
    # Retained messages, in total and per publishing client (0: no limit).
    max_retained: int = 100_000
    max_retained_bytes: int = 256 * 1024 * 1024
    max_retained_per_client: int = 1000
    max_retained_bytes_per_client: int = 16 * 1024 * 1024
    # Persistent sessions: 3.1.1 has no session expiry, so without one an abandoned
    # client id is kept forever. New persistent sessions past max_sessions are refused.
    v3_session_expiry_s: float = 7200.0  # as EMQX; 0: never (3.1.1's own rule)
    max_sessions: int = 100_000
    max_offline_bytes: int = 64 * 1024 * 1024  # per queue of an offline session
    http_max_body: int = 1024 * 1024  # admin API and dashboard (413 past it)
    # How often the wildcard filters this gateway's sessions read are touched in the
    # store, which unregisters those nobody touched for its --wildcard-idle-s.
    wildcard_touch_s: float = 60.0
