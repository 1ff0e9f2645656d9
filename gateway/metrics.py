"""`GET /metrics`: Prometheus text, names prefixed `lightgate_`, read from the broker's
and the store's own counters at scrape time (no second bookkeeping), and the process's
own `process_*` figures (CPU seconds, resident memory, open descriptors: prometheus_client
reads them from /proc)."""

from __future__ import annotations

import time
from typing import Any

import trio
from prometheus_client import CONTENT_TYPE_LATEST, ProcessCollector, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import CollectorRegistry
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.broker import Broker
from gateway.stats import APPEND_BUCKETS
from serving.fd_budget import client_fd_ceiling, open_fds, refused_connections

# A scraper waits no longer than this for the store's figures (Prometheus' own timeout
# is 10 s by default): without them it still gets the gateway's.
STORE_STATS_TIMEOUT_S = 2.0


class BrokerCollector:
    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.store_stats: dict[str, Any] = {}

    def collect(self) -> Any:
        b = self.broker
        st = b.stats
        sessions = list(b.sessions.values())
        yield GaugeMetricFamily("lightgate_connections", "Open MQTT connections",
                                value=st.connections)
        yield CounterMetricFamily("lightgate_connects", "MQTT connections accepted",
                                  value=st.connects_total)
        yield GaugeMetricFamily("lightgate_sessions", "Sessions held by this gateway",
                                value=len(sessions))
        yield GaugeMetricFamily("lightgate_subscriptions", "Subscriptions of those sessions",
                                value=sum(len(s.subscriptions) for s in sessions))
        yield GaugeMetricFamily("lightgate_inflight", "QoS 1/2 messages sent, not yet acked",
                                value=sum(s.in_flight() for s in sessions))
        ins, outs = st.per_qos()
        for name, doc, per_qos in (
            ("lightgate_messages_received", "PUBLISH packets received", ins),
            ("lightgate_messages_sent", "PUBLISH packets delivered", outs),
        ):
            fam = CounterMetricFamily(name, doc, labels=["qos"])
            for qos, n in enumerate(per_qos):
                fam.add_metric([str(qos)], n)
            yield fam
        for name, doc, value in (
            ("lightgate_bytes_received", "Bytes read from MQTT clients", st.bytes_in),
            ("lightgate_bytes_sent", "Bytes written to MQTT clients", st.bytes_out),
            ("lightgate_messages_dropped", "Messages dropped (offline bound, packet size)",
             st.dropped),
            ("lightgate_messages_expired", "Messages not delivered: expired", st.expired),
            ("lightgate_publish_errors", "Publishes the store refused", st.publish_errors),
            ("lightgate_wills", "Will messages published", st.wills),
            ("lightgate_notify_events", "Queue names received from notify", st.notify_events),
            ("lightgate_stuck_disconnects", "Clients disconnected for not reading",
             st.stuck_disconnects),
            ("lightgate_auth_failures", "Failed authentications (MQTT, native, HTTP)",
             b.auth.auth_failures),
            ("lightgate_authorization_denials", "Requests an ACL policy denied",
             b.auth.denials),
            ("lightgate_limit_refusals", "Connects, publishes or subscribes over a limit",
             st.limit_refusals),
            ("lightgate_store_errors", "Store calls of background work (offsets, expiry, "
             "$SYS, wills) that failed, to be tried again", st.store_errors),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        yield from _budget_metrics(b, self.store_stats)
        counts, count, total = st.append_histogram()
        buckets = [(str(bound), n) for bound, n in zip(APPEND_BUCKETS, counts, strict=True)]
        buckets.append(("+Inf", count))
        yield HistogramMetricFamily(
            "lightgate_store_append_latency_seconds",
            "Publish submitted to the store until durably acknowledged",
            buckets=buckets, sum_value=total)
        yield GaugeMetricFamily("lightgate_cache_hit_ratio",
                                "Share of pulls served from the gateway message cache",
                                value=b.cache.hit_ratio)
        yield CounterMetricFamily("lightgate_cache_hits", "Pulls served from the cache",
                                  value=b.cache.hits)
        yield CounterMetricFamily("lightgate_cache_misses", "Pulls that read the store",
                                  value=b.cache.misses)
        yield GaugeMetricFamily("lightgate_uptime_seconds", "Seconds since the gateway started",
                                value=time.time() - st.started)
        yield GaugeMetricFamily("lightgate_shared_groups", "Shared subscription groups",
                                value=len(b.groups))
        yield from _native_metrics(b)
        yield from self._store_metrics()

    def _store_metrics(self) -> Any:
        s = self.store_stats
        log = s.get("commitlog")
        yield GaugeMetricFamily("lightgate_store_up", "1 if the store answered this scrape",
                                value=1 if log else 0)
        if not log:
            return
        yield GaugeMetricFamily("lightgate_commitlog_bytes", "CommitLog size on disk",
                                value=log["bytes"])
        yield GaugeMetricFamily("lightgate_commitlog_segments", "CommitLog segment files",
                                value=log["segments"])
        yield CounterMetricFamily("lightgate_commitlog_messages", "Messages appended",
                                  value=log["messages"])
        yield CounterMetricFamily("lightgate_commitlog_fsyncs", "fsync calls",
                                  value=log["fsyncs"])
        yield from _damage_metrics(log)
        yield GaugeMetricFamily("lightgate_dispatch_lag_bytes",
                                "CommitLog bytes not yet in the light-queue index",
                                value=max(0, log["max_offset"] - s["index_checkpoint"]))
        # Cheap approximation of live light queues: queues written since the store
        # started (the index's allocation table) plus registered wildcard queues.
        yield GaugeMetricFamily("lightgate_light_queues_active",
                                "Light queues written since the store started",
                                value=s.get("queues_active", 0))
        yield GaugeMetricFamily("lightgate_wildcard_queues", "Registered wildcard queues",
                                value=s.get("wildcards", 0))
        yield from _memory_metrics(s)


def _budget_metrics(b: Broker, store_stats: dict[str, Any]) -> Any:
    """Each budget: what it holds now, its limit (0: none) and how often it said no."""
    st, rb, ret, cfg = b.stats, b.read_budget, b.retained.budget, b.config
    rb.refresh()  # with what the native plane's connections hold now
    used = GaugeMetricFamily("lightgate_budget_used", "What a budget holds now",
                             labels=["budget"])
    limit = GaugeMetricFamily("lightgate_budget_limit", "A budget's limit (0: no limit)",
                              labels=["budget"])
    for name, now, cap in (
        ("partial_packet_bytes", rb.held, rb.limit),
        ("retained_messages", ret.count, cfg.max_retained),
        ("retained_bytes", ret.bytes, cfg.max_retained_bytes),
        ("persistent_sessions", b.persistent_sessions, cfg.max_sessions),
        ("unsent_bytes", st.unsent_bytes, cfg.max_unsent_bytes),  # the limit: per client
        ("replay_bytes", b.replay_budget.used, cfg.max_replay_bytes),
    ):
        used.add_metric([name], now)
        limit.add_metric([name], cap)
    native = store_stats.get("native_read_budget")
    if native:  # the store's, for its native connections
        used.add_metric(["native_partial_frame_bytes"], native["held"])
        limit.add_metric(["native_partial_frame_bytes"], native["limit"])
    answers = store_stats.get("native_answer_budget")
    if answers:  # held over every connection; the limit is each connection's
        used.add_metric(["native_unsent_answer_bytes"], answers["held"])
        limit.add_metric(["native_unsent_answer_bytes"], answers["limit"])
    fds = open_fds()  # this process's, all of them (None: the platform does not list them)
    if fds is not None:
        used.add_metric(["client_fds"], fds)
        limit.add_metric(["client_fds"], client_fd_ceiling())
    producers = store_stats.get("producers")
    if producers:  # the store's idempotent producers: ids, and sequences (each capped)
        for kind in ("ids", "sequences"):
            used.add_metric([f"idempotent_producer_{kind}"], producers[kind])
            limit.add_metric([f"idempotent_producer_{kind}"], producers["limit"])
    yield used
    yield limit
    peak = GaugeMetricFamily("lightgate_budget_peak", "The most a budget has held at once",
                             labels=["budget"])
    peak.add_metric(["partial_packet_bytes"], rb.peak)
    peak.add_metric(["replay_bytes"], b.replay_budget.peak)
    if native:
        peak.add_metric(["native_partial_frame_bytes"], native["peak"])
    if answers:  # the most one connection held
        peak.add_metric(["native_unsent_answer_bytes"], answers["peak"])
    yield peak
    hits = CounterMetricFamily("lightgate_budget_refusals",
                               "Requests refused or connections closed by a budget",
                               labels=["budget"])
    for name, n in (
        ("partial_packet_paused", rb.paused),
        ("partial_packet_closed", rb.closed),
        ("retained", ret.refused),
        ("persistent_sessions", st.sessions_refused),
        ("topic_levels_or_length", st.topic_refusals),
        ("offline_messages_dropped", st.offline_dropped),
        ("unsent_bytes_held", st.unsent_held),
        ("slow_drain_closed", st.stuck_disconnects),
        ("replay_reads_cut", b.replay_budget.cut),
        ("native_partial_frame_paused", (native or {}).get("paused", 0)),
        ("native_partial_frame_closed", (native or {}).get("closed", 0)),
        ("native_unsent_answers_paused", (answers or {}).get("paused", 0)),
        ("idempotent_producers", (producers or {}).get("refused", 0)),
    ):
        hits.add_metric([name], n)
    hits.add_metric(["client_fds"], refused_connections())
    yield hits
    yield CounterMetricFamily("lightgate_sessions_expired", "Persistent sessions expired",
                              value=st.sessions_expired)


def _native_metrics(b: Broker) -> Any:
    """The native plane's own counters (gateway.handover): what its connections sent and
    were sent, which the broker's counters above do not see."""
    if b.handover is None:
        return
    counters = b.handover.engine.counters()
    yield GaugeMetricFamily("lightgate_native_connections",
                            "Connections the native plane carries now",
                            value=counters.pop("connections"))
    for name, value in counters.items():
        yield CounterMetricFamily(f"lightgate_native_{name}",
                                  f"Native plane: {name.replace('_', ' ')}", value=value)


def _damage_metrics(log: dict[str, Any]) -> Any:
    """Damaged records read around, the background verification, the queues' offset
    marks (a store of an older version says nothing of them)."""
    if "corrupt_reads" not in log:
        return
    yield CounterMetricFamily(
        "lightgate_commitlog_corrupt_reads",
        "Records a read found damaged (CRC or frame) and skipped", value=log["corrupt_reads"])
    yield GaugeMetricFamily(
        "lightgate_commitlog_damaged_records",
        "Damaged ranges of the CommitLog known (read around, kept in quarantine/)",
        value=log["damaged_records"])
    yield GaugeMetricFamily("lightgate_commitlog_damaged_bytes",
                            "Bytes of the CommitLog's damaged ranges", value=log["damaged_bytes"])
    yield CounterMetricFamily(
        "lightgate_commitlog_verified_bytes",
        "Bytes of older segments verified in the background since start",
        value=log["verified_bytes"])
    yield GaugeMetricFamily(
        "lightgate_commitlog_verify_pending_bytes",
        "Bytes of older segments the background verification has still to read",
        value=log["verify_pending_bytes"])
    yield CounterMetricFamily(
        "lightgate_commitlog_offset_mark_writes",
        "Writes (each fdatasync'd) of light queues' high-water marks",
        value=log["offset_mark_writes"])


def _memory_metrics(s: dict[str, Any]) -> Any:
    """Where the store's memory goes, by the parts that are bounded by configuration: a
    rise of RSS these account for is a cache filling up to its capacity, not a leak."""
    memory = s.get("memory")
    if not memory:
        return  # a store older than these figures
    used = GaugeMetricFamily("lightgate_store_memory_bytes",
                             "Memory held by the store's RocksDB databases and its ring of "
                             "recent messages", labels=["part"])
    limit = GaugeMetricFamily("lightgate_store_memory_limit_bytes",
                              "Capacity of the store's caches: each RocksDB database's block "
                              "cache and the ring of recent messages", labels=["part"])
    for db, m in memory.items():
        for part in ("block_cache", "memtables", "table_readers"):
            used.add_metric([f"{db}_{part}"], m[part])
        limit.add_metric([f"{db}_block_cache"], m["block_cache_capacity"])
    recent = s.get("recent", {})
    used.add_metric(["recent_messages"], recent.get("bytes", 0))
    limit.add_metric(["recent_messages"], recent.get("max_bytes", 0))
    yield used
    yield limit


def metrics_route(broker: Broker) -> Route:
    registry = CollectorRegistry(auto_describe=False)
    collector = BrokerCollector(broker)
    registry.register(collector)
    ProcessCollector(registry=registry)  # our own registry: the default one's is not here

    async def metrics(_: Request) -> Response:
        collector.store_stats = {}
        try:  # a store away or hung: the gateway's own metrics still answer, in time
            with trio.move_on_after(STORE_STATS_TIMEOUT_S):
                collector.store_stats = await broker.store.get_stats()
        except Exception:  # noqa: BLE001 - counted as lightgate_store_up 0
            pass
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return Route("/metrics", metrics)
