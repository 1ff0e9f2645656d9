"""The newest messages of the queues being read, kept as the writer dispatches them.

A reader that keeps up (an MQTT subscriber, a consumer at the head of its queue) asks
for what was stored a moment ago. Serving that from here costs no index lookup, no
pread, no decode and no hop to a worker thread.

Correctness rests on one rule: a queue's ring is started by the writer thread at a
message it dispatches, and every later message of that queue is appended in offset
order under the same lock. So a ring always ends at the queue's true end, and a reader
at that end gets "nothing new" without looking further. A reader below the ring's start
gets None and reads the store.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
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
# A ring not read for this long is not worth a read-back of a message that comes without
# its body (`wants`): its reader went (to the native plane, say) or reads rarely.
WANTED_S = 1.0


@dataclass
class _Ring:
    base: int
    messages: list[Message] = field(default_factory=list)
    bytes: int = 0
    read_at: float = field(default_factory=time.monotonic)

    @property
    def end(self) -> int:
        return self.base + len(self.messages)


def _cost(msg: Message) -> int:
    """What a kept message holds: its body, its strings and the objects around them."""
    queues = msg.queues
    return (len(msg.body) + len(msg.topic) + len(msg.client_id) + OVERHEAD
            + QUEUE_OVERHEAD * len(queues) + sum([len(name) for name, _ in queues]))


def _read_lately(ring: _Ring) -> bool:
    """Read within WANTED_S: its reader wants the next message's body."""
    return time.monotonic() - ring.read_at < WANTED_S


class RecentMessages:
    def __init__(self, per_queue: int = PER_QUEUE, max_bytes: int = MAX_BYTES) -> None:
        self.per_queue = per_queue
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._rings: OrderedDict[str, _Ring] = OrderedDict()  # least recently read first
        self._wanted: set[str] = set()  # read lately; a ring starts at their next message
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    def add(self, messages: list[Message]) -> bool:
        """The writer thread, after dispatch: append to the rings of queues being read.
        Whether it kept any."""
        kept = False
        with self._lock:
            if not self._rings and not self._wanted:
                return False
            for msg in messages:
                body = getattr(msg, "body", None)
                if body is None:  # a native publish nobody read when it was dispatched
                    self._skip(msg.queues)
                    continue
                size = _cost(msg)
                for queue, offset in msg.queues:
                    ring = self._rings.get(queue)
                    if ring is None or ring.end != offset:
                        if ring is None and queue not in self._wanted:
                            continue
                        self._drop(queue)
                        self._wanted.discard(queue)
                        ring = self._rings[queue] = _Ring(offset)
                        self._rings.move_to_end(queue, last=False)
                    ring.messages.append(msg)
                    kept = True
                    ring.bytes += size
                    self._bytes += size
                    if len(ring.messages) >= self.per_queue + TRIM_STEP:
                        self._trim(ring, len(ring.messages) - self.per_queue)
            while self._bytes > self.max_bytes and self._rings:
                self._shrink_coldest()
        return kept

    def reading(self) -> bool:
        """Whether any queue is read from here lately (within WANTED_S), or wanted (any
        thread). If not, new messages need not come with their bodies, and the rings of
        the queues they grow go (`grew`)."""
        if self._wanted:
            return True
        try:  # the most recently read is last
            return bool(self._rings) and _read_lately(next(reversed(self._rings.values())))
        except (StopIteration, RuntimeError):  # emptied or changed meanwhile
            return True

    def grew(self, queues: set[str]) -> None:
        """The writer thread: these queues grew by messages that came without their bodies
        (nobody was `reading`): their rings no longer end at their queues' ends, so they go
        (a reader's next miss starts another)."""
        with self._lock:
            for queue in queues:
                self._drop(queue)

    def unwant(self, queues: list[str]) -> None:
        """Their reader went (to the native plane, which delivers on its own): their
        messages are no longer read back for the rings, until someone reads them again."""
        with self._lock:
            for queue in queues:
                self._wanted.discard(queue)
                ring = self._rings.get(queue)
                if ring is not None:
                    ring.read_at = 0.0
                    self._rings.move_to_end(queue, last=False)

    def wants(self, queue: str) -> bool:
        """Whether a reader waits for this queue's next message: it missed the ring, or
        read it within WANTED_S (any thread). A message nobody wants may come to `add`
        without its body (a native publish is not read back for it); a reader that
        starts wanting it meanwhile is served from the store until the next one."""
        ring = self._rings.get(queue)
        if ring is None:
            return queue in self._wanted
        return _read_lately(ring)

    def _skip(self, queues: list[tuple[str, int]]) -> None:
        """A message of these queues comes without its body: a ring of one of them would
        no longer end at its queue's end, so it goes (its reader's next miss, if it has
        one, starts another)."""
        for queue, _ in queues:
            self._drop(queue)

    def get(self, queue: str, offset: int, max_count: int) -> tuple[list[Message], int] | None:
        """Messages from `offset` (possibly none: the reader is at the end) and the
        queue's end, or None when this queue's ring cannot answer (read the store)."""
        with self._lock:
            ring = self._rings.get(queue)
            if ring is None or not ring.base <= offset <= ring.end:
                self.misses += 1
                if ring is None:
                    self._wanted.add(queue)
                    if len(self._wanted) > 100_000:  # never read again, most of them
                        self._wanted.clear()
                return None
            self.hits += 1
            ring.read_at = now = time.monotonic()
            self._rings.move_to_end(queue)
            first = next(iter(self._rings.values()))
            if now - first.read_at > IDLE_S:  # a step per read, as in add
                self._shrink_coldest()
            i = offset - ring.base
            return ring.messages[i : i + max_count], ring.end

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
