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

A replay reads history in batches of thousands of messages that live for the batch: with
2,000 net allocations between young collections it paid for a young collection every
~500 messages, and for middle ones walking what the batch held. Measured with
`bench/replay_bench.py --mqtt` (1M messages, 10,000 topics), replay / live fan-in:
- (2,000, 10, 50): 192-198k / 75-77k msg/s (four runs)
- (50,000, 10, 50): 209-213k / 82-83k msg/s (two runs)
and p99 at 20,000 msg/s unchanged (0.52-0.64 ms against 0.55-0.57 ms, two runs each):
in steady traffic messages come and go, so young collections stay rare either way.

So, once the server is up:
- freeze what start-up made (modules, functions, types, the config: about 60k objects
  that live as long as the process), so that no collection walks it again;
- 50,000 net allocations between young collections and 50 middle collections between
  full ones. The thresholds count allocations less deallocations, so messages that come
  and go do not advance them, while garbage in cycles does, and is mostly collected
  young (a young collection per 50,000, a middle one per 500,000); a full one comes
  when CPython's own rule allows (a quarter of the old generation new) after 50 middle
  ones.
"""

from __future__ import annotations

import gc

THRESHOLDS = (50000, 10, 50)


def tune_for_serving() -> None:
    """Call once the server is ready (listeners bound, store open)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
