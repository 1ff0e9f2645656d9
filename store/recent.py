"""The newest messages of the queues being read, kept as the writer dispatches them.

A reader that keeps up (an MQTT subscriber, a consumer at the head of its queue) asks
for what was stored a moment ago. Serving that from here costs no index lookup, no
pread, no decode and no hop to a worker thread.

Correctness rests on one rule: a queue's ring is started by the writer thread at a
message it dispatches, and every later message of that queue is appended in offset
order under the same lock. So a ring always ends at the queue's true end, and a reader
at that end gets "nothing new" without looking further. A reader below the ring's start
gets None and reads the store.

Under the native engine, a ring is fed only with what its readers tell the engine they
read (`want`): the engine keeps those records for the dispatch, which hands them over
with the names and ends of every queue that grew; a ring whose queue grew by messages
that came without their bodies goes (`grew`).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from store.record import Message

# Messages kept per queue: a reader that lags by less is served from here. A publisher
# that pipelines (QoS 0 at full speed) gets tens of thousands ahead of its subscriber in
# one burst; at 8,192 the subscriber fell out of the ring and read every message back
# through the index, a pread and a worker thread (measured at 65,536: 34k -> 54k msgs/s,
# QoS 0, one publisher to one subscriber).
# MAX_BYTES bounds it all the same (it holds ~43,000 messages of 64 B, ~19,000 of 1 KiB).
PER_QUEUE = 65536
MAX_BYTES = 32 * 1024 * 1024  # what the kept messages hold, over all queues (`_cost`)
# Bytes of a kept Message beyond its body and its strings' characters, and of each of its
# queues beyond the name's: a message read back from the log holds a string per name, a
# tuple and an int per queue (tracemalloc: 690 with one queue, 140 more per queue, at any
# body size). Counted as 400 in all, the ring held 39 MiB at its 32 MiB mark (1 KiB
# bodies), and 49 MiB at 65,536 messages of 64 B that it counted as 29.
OVERHEAD = 550
QUEUE_OVERHEAD = 140
IDLE_S = 60.0  # a ring nobody read for this long is dropped
# Messages freed at a time when a ring is over its bounds. Freeing is the cost that
# matters: the writer frees them holding the GIL, so a ring trimmed by half at once (32k
# messages) stalled every connection for 30 ms (the p99 at 20,000 msg/s). A small
# step keeps each pause well under a millisecond; the list's memmove per step is cheap.
TRIM_STEP = 512
# A ring not read for this long is not worth the engine keeping its next records for the
# dispatch (`want`): its reader went (to the native plane, say) or reads rarely. Told at
# most every WANTED_S / 2 per queue.
WANTED_S = 1.0
# A ring fed this many messages with nobody reading it in between is not worth its cost
# (each message made into a Message and kept: ~1 us in the dispatch, two thirds of it
# at 300,000 msg/s of QoS 0): it goes, the engine stops keeping its queue's records, and
# misses start no ring for COLD_S. A reader that reads at least once a dispatch (5 ms:
# 1,500 messages at that rate) never meets it; a store whose gateway delivers its own
# publishes and pulled a queue once (at a subscription) stops feeding it soon after.
UNREAD_MAX = 16384
COLD_S = 2.0


@dataclass
class _Ring:
    base: int
    messages: list[Message] = field(default_factory=list)
    bytes: int = 0
    read_at: float = field(default_factory=time.monotonic)
    told_at: float = 0.0  # when the engine was last told its reader reads it (`want`)
    unread: int = 0  # messages added since the last read (UNREAD_MAX)

    @property
    def end(self) -> int:
        return self.base + len(self.messages)


def _cost(msg: Message) -> int:
    """What a kept message holds: its body, its strings and the objects around them."""
    queues = msg.queues
    return (len(msg.body) + len(msg.topic) + len(msg.client_id) + OVERHEAD
            + QUEUE_OVERHEAD * len(queues) + sum([len(name) for name, _ in queues]))


class RecentMessages:
    def __init__(self, per_queue: int = PER_QUEUE, max_bytes: int = MAX_BYTES) -> None:
        self.per_queue = per_queue
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._rings: OrderedDict[str, _Ring] = OrderedDict()  # least recently read first
        # Missed lately (when the engine was told): a ring starts at their next message.
        self._wanted: dict[str, float] = {}
        # Rings that went unread (UNREAD_MAX), when: no ring starts for COLD_S.
        self._cold: dict[str, float] = {}
        self._bytes = 0
        self.hits = 0
        self.misses = 0
        # The native engine's `want_queues(names, seconds)`: the records of these queues
        # come with the next dispatches for that long (None: every message comes whole).
        self.want: Callable[[list[str], float], None] | None = None

    def add(self, messages: list[Message]) -> bool:
        """The writer thread, after dispatch: append to the rings of queues being read.
        Whether it kept any."""
        kept = False
        started: list[str] = []  # rings begun: wanted for WANTED_S unless read
        cooled: list[str] = []  # rings gone unread: not wanted
        with self._lock:
            if not self._rings and not self._wanted:
                return False
            for msg in messages:
                size = _cost(msg)
                for queue, offset in msg.queues:
                    ring = self._rings.get(queue)
                    if ring is None or ring.end != offset:
                        if ring is None and queue not in self._wanted:
                            continue
                        self._drop(queue)
                        self._wanted.pop(queue, None)
                        ring = self._rings[queue] = _Ring(offset)
                        ring.told_at = ring.read_at
                        started.append(queue)
                        self._rings.move_to_end(queue, last=False)
                    ring.messages.append(msg)
                    kept = True
                    ring.bytes += size
                    self._bytes += size
                    ring.unread += 1
                    if ring.unread >= UNREAD_MAX:
                        self._cool(queue)
                        cooled.append(queue)
                    elif len(ring.messages) >= self.per_queue + TRIM_STEP:
                        self._trim(ring, len(ring.messages) - self.per_queue)
            while self._bytes > self.max_bytes and self._rings:
                self._shrink_coldest()
        if self.want is not None:
            if started := [q for q in started if q not in cooled]:
                # A miss wanted the next message for however long it took (IDLE_S); the
                # ring's own reads want the ones after it. A reader that reads below the
                # ring (far behind) does not keep the engine handing it every record.
                self.want(started, WANTED_S * 1.5)
            if cooled:
                self.want(cooled, 0.0)
        return kept

    def _cool(self, queue: str) -> None:
        """(Under the lock.) `queue`'s ring went unread: it goes, and for COLD_S its
        misses start none (its reader reads the store, rarely)."""
        self._drop(queue)
        if len(self._cold) >= 100_000:  # (bounded, as `_wanted`)
            self._cold.clear()
        self._cold[queue] = time.monotonic()

    def grew(self, ends: Mapping[str, int]) -> None:
        """The writer thread, after `add`: these queues grew to these ends. A ring that
        does not end there grew by messages that came without their bodies (its reader
        told the engine nothing lately): it goes, and its reader's next miss starts
        another. Looks at the fewer of the rings and the queues."""
        with self._lock:
            rings = self._rings
            if not rings:
                return
            if len(rings) <= len(ends):
                stale = [q for q, ring in rings.items()
                         if q in ends and ring.end != ends[q]]
            else:
                stale = [q for q, end in ends.items()
                         if (ring := rings.get(q)) is not None and ring.end != end]
            for queue in stale:
                self._drop(queue)

    def unwant(self, queues: list[str]) -> None:
        """Their reader went (to the native plane, which delivers on its own): their
        messages are no longer kept for the rings, until someone reads them again."""
        with self._lock:
            for queue in queues:
                self._wanted.pop(queue, None)
                ring = self._rings.get(queue)
                if ring is not None:
                    ring.read_at = ring.told_at = 0.0
                    self._rings.move_to_end(queue, last=False)
        if self.want is not None:
            self.want(queues, 0.0)

    def get(self, queue: str, offset: int, max_count: int) -> tuple[list[Message], int] | None:
        """Messages from `offset` (possibly none: the reader is at the end) and the
        queue's end, or None when this queue's ring cannot answer (read the store)."""
        tell = 0.0  # for how long the engine is told this queue is read (0: not now)
        with self._lock:
            ring = self._rings.get(queue)
            if ring is None or not ring.base <= offset <= ring.end:
                self.misses += 1
                if ring is None:
                    now = time.monotonic()
                    cold = now - self._cold.get(queue, -COLD_S) < COLD_S
                    if not cold and now - self._wanted.get(queue, -IDLE_S) >= IDLE_S / 2:
                        tell = IDLE_S  # however long the next message takes
                        if len(self._wanted) >= 100_000:  # never read again, most of them
                            self._wanted.clear()
                        self._wanted[queue] = now  # a ring starts at its next message
                found = None
            else:
                self.hits += 1
                ring.unread = 0
                ring.read_at = now = time.monotonic()
                if now - ring.told_at >= WANTED_S / 2:  # wanted >= WANTED_S past this read
                    ring.told_at, tell = now, WANTED_S * 1.5
                self._rings.move_to_end(queue)
                first = next(iter(self._rings.values()))
                if now - first.read_at > IDLE_S:  # a step per read, as in add
                    self._shrink_coldest()
                i = offset - ring.base
                found = ring.messages[i : i + max_count], ring.end
        if tell and self.want is not None:  # (outside the lock: the engine's may wait)
            self.want([queue], tell)
        return found

    def _trim(self, ring: _Ring, n: int) -> None:
        gone = sum([_cost(m) for m in ring.messages[:n]])
        del ring.messages[:n]
        ring.base += n
        ring.bytes -= gone
        self._bytes -= gone

    def _shrink_coldest(self) -> None:
        """Over the byte budget, or idle past IDLE_S: the least recently read ring gives
        back a step of its oldest messages (the whole ring once it is that small)."""
        queue, ring = next(iter(self._rings.items()))
        if len(ring.messages) > TRIM_STEP:
            self._trim(ring, TRIM_STEP)
        else:
            self._drop(queue)

    def _drop(self, queue: str) -> None:
        ring = self._rings.pop(queue, None)
        if ring is not None:
            self._bytes -= ring.bytes

    def clear(self) -> None:
        """Forget every ring (a master stepping down: it may hold a tail that is cut)."""
        with self._lock:
            self._rings.clear()
            self._bytes = 0

    def stats(self) -> dict[str, int]:
        return {"queues": len(self._rings), "bytes": self._bytes, "max_bytes": self.max_bytes,
                "per_queue": self.per_queue, "hits": self.hits, "misses": self.misses}
