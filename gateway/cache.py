"""Per-gateway message cache: N subscribers of one queue cost one store read, and one
encoding of a message serves them all (`Templates`).

Each queue keeps a window of its most recent messages by offset. Sessions pulling the
same queue at nearby offsets (the normal case right after a notify event) are served
from the window; only one of them at a time fetches from the store, the others wait
for that fetch and then read the window.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import trio

from gateway.mqtt import PublishTemplate
from gateway.mqtt.properties import publish_properties
from store.api import LocalStore, Message, Store


@dataclass
class _Window:
    base: int = 0  # offset of messages[0]
    messages: list[Message] = field(default_factory=list)
    # Empty, its base is where the store said the queue ends: what this gateway appends
    # there starts it (`offer`).
    anchored: bool = False
    lock: trio.Lock = field(default_factory=trio.Lock)

    @property
    def end(self) -> int:
        return self.base + len(self.messages)

    def slice(self, offset: int, max_count: int) -> list[Message]:
        i = offset - self.base
        return self.messages[i : i + max_count]


class QueueCache:
    def __init__(self, store: Store, *, window: int = 512, max_queues: int = 10_000) -> None:
        self.store = store
        local = isinstance(store, LocalStore)  # the embedded store: no waiting
        self._peek = store.pull_now if local else None
        # After the peek said no, the embedded store's ring need not be asked again.
        self._fetch = store.pull_stored if local else store.pull
        self.window = window
        self.max_queues = max_queues
        self._queues: OrderedDict[str, _Window] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def _get(self, queue: str) -> _Window:
        w = self._queues.get(queue)
        if w is None:
            w = self._queues[queue] = _Window()
            while len(self._queues) > self.max_queues:
                self._queues.popitem(last=False)
        else:
            self._queues.move_to_end(queue)
        return w

    def offer(self, stored: list[Message]) -> None:
        """Messages this gateway just stored: append them to the windows of queues being
        read, where they continue the window, so that caught-up subscribers are served
        from memory instead of reading back what was just written. Anything out of order
        (another gateway or publisher got in between) is left to `pull`."""
        queues = self._queues
        for msg in stored:
            for queue, offset in msg.queues:
                w = queues.get(queue)
                if w is not None and (w.messages or w.anchored) and offset == w.end:
                    w.messages.append(msg)
                    if len(w.messages) > self.window * 2:  # trim in steps, not per message
                        drop = len(w.messages) - self.window
                        del w.messages[:drop]
                        w.base += drop

    async def pull(self, queue: str, offset: int, max_count: int = 64) -> tuple[list[Message], int]:
        """Messages from `offset` on and the offset to continue from (which may jump
        forward when retention removed the messages at `offset`)."""
        now = self.pull_now(queue, offset, max_count)
        if now is not None:
            return now
        w = self._get(queue)
        async with w.lock:
            if w.base <= offset < w.end:  # someone else fetched it while we waited
                self.hits += 1
                return w.slice(offset, max_count), offset
            self.misses += 1
            res = await self._fetch(queue, offset, max(max_count, 64))
            return self._fill(w, queue, res.messages, res.next_offset, max_count)

    def pull_now(self, queue: str, offset: int, max_count: int = 64
                 ) -> tuple[list[Message], int] | None:
        """`pull` when it needs no waiting: from the window, or from the embedded store
        in this thread (its ring of recent messages or, with inline appends, the index),
        without the lock, which costs a scheduler pass. This is every subscriber's
        "anything more?" after it caught up, once per message at low rates; and a reader
        far behind catches up in its own step instead of one pull per pass of the loop.
        None: only `pull` can answer."""
        w = self._get(queue)
        if w.base <= offset < w.end:
            self.hits += 1
            return w.slice(offset, max_count), offset
        recent = self._peek(queue, offset, max(max_count, 64)) if self._peek else None
        if recent is None:
            return None
        self.hits += 1
        return self._fill(w, queue, recent.messages, recent.next_offset, max_count)

    def _fill(self, w: _Window, queue: str, msgs: list[Message], next_offset: int,
              max_count: int) -> tuple[list[Message], int]:
        """Put what the store returned in the window; the caller's share of it."""
        if not msgs:  # next_offset: past what retention removed, or back to a cut end
            if not w.messages:
                w.base, w.anchored = next_offset, True
            return [], next_offset
        start = msgs[0].offset_in(queue)
        dense = msgs[-1].offset_in(queue) == start + len(msgs) - 1
        if w.messages and dense and w.base <= start <= w.end:
            # Continues the window, or overlaps it: an answer that this gateway's own
            # appends (`offer`) overtook while it was on its way. Only what is past the
            # window's end is new; moving the window back to `start` would drop those
            # appends, and every later one would miss it.
            w.messages.extend(msgs[w.end - start:])
        else:
            w.base, w.messages = start, list(msgs)
        if len(w.messages) > self.window:
            drop = len(w.messages) - self.window
            w.messages = w.messages[drop:]
            w.base += drop
        return w.slice(start, max_count), start

    @property
    def hit_ratio(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class Templates:
    """Encode once per message, stamp per subscriber: the encodings of the most recent
    messages, by their place in the log."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._by_phys: OrderedDict[int, PublishTemplate] = OrderedDict()

    def __call__(self, msg: Message) -> PublishTemplate:
        if msg.phys_offset < 0:  # not from the log (no identity to cache it by)
            return _template(msg)
        t = self._by_phys.get(msg.phys_offset)
        if t is None:
            t = self._by_phys[msg.phys_offset] = _template(msg)
            if len(self._by_phys) > self.size:
                self._by_phys.popitem(last=False)
        return t


def _template(msg: Message) -> PublishTemplate:
    # App properties become user properties: worked out once per message.
    return PublishTemplate(msg.topic, msg.body, msg.qos, msg.retain,
                           publish_properties(msg.properties))
