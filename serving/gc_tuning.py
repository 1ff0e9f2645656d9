"""Python's cyclic garbage collector, set for a server that holds recent messages.

The store keeps the newest messages of the queues being read in memory (store/recent.py:
up to 65,536 per queue), each a Message and its list of queues: objects the collector
tracks, that live a few seconds and are then freed by reference counting, not by the
collector. With CPython's defaults (700, 10, 10) they are promoted to the old generation
in bursts, and a full collection, which walks every tracked object (130-160k here), ran
about once a second at 20,000 msg/s: 35-85 ms each, every connection stalled. That was
all of the p99 at that rate (55-63 ms).

Measured at 20,000 msg/s QoS 0 for 40 s (`bench/mqtt_bench.py --scenarios
latency_fixed_rate`, full size), p50 / p99 / max:
- defaults, start-up frozen: 0.20 / 46 / 83 ms (16 full collections in 20 s)
- (2,000, 10, 50), start-up frozen: 0.18 / 0.64 / 5.3 ms (none in 40 s)

So, once the server is up:
- freeze what start-up made (modules, functions, types, the config: about 60k objects
  that live as long as the process), so that no collection walks it again;
- 2,000 net allocations between young collections and 50 middle collections between
  full ones. The thresholds count allocations less deallocations, so messages that come
  and go do not advance them, while garbage in cycles does: a full collection still
  comes after about a million objects have piled up, and CPython's own rule (a quarter
  of the old generation new) still holds on top.
"""

from __future__ import annotations

import gc

THRESHOLDS = (2000, 10, 50)


def tune_for_serving() -> None:
    """Call once the server is ready (listeners bound, store open)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
