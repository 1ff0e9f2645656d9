"""The gateway's counters: what $SYS, the metrics endpoint and the dashboard report."""

from __future__ import annotations

import time
from collections.abc import Callable

APPEND_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Stats:
    def __init__(self) -> None:
        self.started = time.time()
        self.messages_in_qos = [0, 0, 0]
        self.messages_out_qos = [0, 0, 0]
        self.notify_events = 0
        # Store append latency as the gateway sees it (submit -> durable ack), cumulative
        # bucket counts for a Prometheus histogram.
        self.append_buckets = [0] * len(APPEND_BUCKETS)
        self.append_count = 0
        self.append_sum = 0.0
        self.connections = 0
        self.connects_total = 0
        self.messages_in = 0
        self.messages_out = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.dropped = 0
        self.expired = 0
        self.publish_errors = 0
        self.wills = 0
        self.stuck_disconnects = 0  # clients that took less than --min-drain-bytes
        self.unsent_bytes = 0  # waiting for clients' sockets, all connections
        self.unsent_held = 0  # times a connection passed --max-unsent-bytes (not read)
        self.limit_refusals = 0  # connects, publishes, subscribes refused by a limit
        self.sessions_refused = 0  # new persistent sessions past --max-sessions
        self.sessions_expired = 0
        self.offline_dropped = 0  # skipped past --max-offline-messages / -bytes
        self.topic_refusals = 0  # topics past --max-topic-levels / --max-topic-length
        self.store_errors = 0  # store calls of background work that failed (retried later)
        # The native plane's own counters (serving.lightgate_native.Engine.counters), once it runs.
        self.native: Callable[[], dict[str, int]] | None = None
        # ... and its appends' latency (Engine.append_latency): bounds, cumulative counts,
        # count, sum.
        self.native_latency: Callable[[], tuple[list[float], list[int], int, float]] \
            | None = None

    def totals(self) -> dict[str, int]:
        """Messages and bytes in and out: this side's and the native plane's."""
        out = {"messages_in": self.messages_in, "messages_out": self.messages_out,
               "bytes_in": self.bytes_in, "bytes_out": self.bytes_out}
        if self.native is not None:
            native = self.native()
            for name in out:
                out[name] += native.get(name, 0)
        return out

    def per_qos(self) -> tuple[list[int], list[int]]:
        """Messages in and out by QoS: this side's and the native plane's (QoS 0 and 1)."""
        ins, outs = list(self.messages_in_qos), list(self.messages_out_qos)
        if self.native is not None:
            native = self.native()
            for counts, name in ((ins, "messages_in"), (outs, "messages_out")):
                qos1 = native.get(f"{name}_qos1", 0)
                counts[0] += native.get(name, 0) - qos1
                counts[1] += qos1
        return ins, outs

    def append_histogram(self) -> tuple[list[int], int, float]:
        """The appends' latency, this side's and the native plane's: cumulative counts
        per bound of APPEND_BUCKETS, the count and the sum (seconds)."""
        buckets, count, total = list(self.append_buckets), self.append_count, self.append_sum
        if self.native_latency is not None:
            bounds, native, n, s = self.native_latency()
            if tuple(bounds) == APPEND_BUCKETS:  # the engine's are ours (test_engine_writer)
                buckets = [a + b for a, b in zip(buckets, native, strict=True)]
                count, total = count + n, total + s
        return buckets, count, total

    def observe_append(self, seconds: float) -> None:
        self.append_count += 1
        self.append_sum += seconds
        for i, bound in enumerate(APPEND_BUCKETS):
            if seconds <= bound:
                self.append_buckets[i] += 1
