"""NACK: a consumer group's member gives a message it received another try later, or
dead-letters it (store.groups names the queues). What a NACK may cost the store:

- **Once per delivery.** A delivery is a message at an offset of a queue, handed to a
  group. The store records each one NACKed (in the `groups` metadata); a repeated NACK
  of it answers what the first did and copies nothing. Records go once retention has
  removed their message (`drop_gone`).
- **A dead letter stays dead.** A NACK of a message of a dead-letter queue is refused:
  each would be a new dead letter, and that one NACKed again, without end.
- **Attempts are bounded** by MAX_ATTEMPTS_LIMIT whatever the request says, so a retry
  copy NACKed again and again reaches the dead-letter queue.
- **A budget.** A group's retry and dead-letter queues together hold at most
  `max_messages` (what retention keeps of them); a NACK past it is refused.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from store.common import StoreFullError
from store.groups import MAX_ATTEMPTS, backoff, dlq_queue, retry_queue
from store.record import Message

CF = "groups"
PREFIX = "nack\x00"
MAX_ATTEMPTS_LIMIT = 100


def record_key(group: str, queue: str, offset: int) -> str:
    """The record of one NACKed delivery (the offset fixed-width: keys sort by it)."""
    return f"{PREFIX}{group}\x00{queue}\x00{offset:016x}"


def parse_record_key(key: str) -> tuple[str, str, int]:
    group, queue, offset = key[len(PREFIX):].rsplit("\x00", 2)
    return group, queue, int(offset, 16)


def _is_dead_letter(queue: str) -> bool:
    return queue.endswith("#dlq")


class Redelivery:
    """NACKs of one store (the native server's NACK request)."""

    def __init__(self, store: Any, max_messages: int) -> None:
        self.store = store
        self.max_messages = max_messages  # 0: no budget
        self.refused = 0  # NACKs refused by the budget, over the node's life
        self._locks: dict[str, tuple[trio.Lock, int]] = {}  # group -> (lock, users)

    async def nack(self, group: str, queue: str, offset: int, msg: Message,
                   max_attempts: int = MAX_ATTEMPTS) -> dict[str, Any]:
        """Copy `msg` (the message at `offset` of `queue`, which the caller may read) to
        the group's retry queue, or its dead-letter queue once out of attempts; the
        answer, or the first one's for a delivery NACKed before (`repeated`)."""
        if _is_dead_letter(queue):
            raise ValueError(f"{queue!r} is a dead-letter queue: a dead letter is not "
                             "retried (read it, and send it again if it should be)")
        key = record_key(group, queue, offset)
        async with self._group_lock(group):  # a repeat waits for the first to be recorded
            done = await self.store.meta_get(CF, key)
            if done is not None:
                return {**done, "repeated": True}
            attempt = int(msg.properties.get("lg_attempt", 0)) + 1
            dead = attempt >= max(1, min(max_attempts, MAX_ATTEMPTS_LIMIT))
            self._check_budget(group)
            props = dict(msg.properties, lg_attempt=attempt,
                         lg_origin=msg.properties.get("lg_origin") or msg.msg_id)
            if not dead:
                props["lg_not_before"] = int((time.time() + backoff(attempt)) * 1000)
            target = dlq_queue(group) if dead else retry_queue(group)
            copy = Message(msg.topic, msg.body, msg.qos, False, msg.client_id, props,
                           key=msg.key)
            [stored] = await self.store.append([copy], [[target]])
            answer = {"queue": target, "attempt": attempt, "dead": dead,
                      "msg_id": stored.msg_id}
            await self.store.meta_put(CF, key, answer)
        return {**answer, "repeated": False}

    def _check_budget(self, group: str) -> None:
        if not self.max_messages:
            return
        held = sum(hi - lo for lo, hi in (self.store.queue_range(q) for q in
                                          (retry_queue(group), dlq_queue(group))))
        if held >= self.max_messages:
            self.refused += 1
            raise StoreFullError(
                f"the retry and dead-letter queues of group {group!r} hold {held} messages "
                f"(--max-retry-messages {self.max_messages}): NACK refused until retention "
                "removes some")

    @asynccontextmanager
    async def _group_lock(self, group: str) -> Any:
        lock, users = self._locks.get(group, (None, 0))
        if lock is None:
            lock = trio.Lock()
        self._locks[group] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[group]
            if users <= 1:
                del self._locks[group]  # group names come from clients: keep none idle
            else:
                self._locks[group] = (lock, users - 1)


def gone_records(meta: Any, min_offset: Any) -> Iterator[str]:
    """Keys of NACK records whose message retention removed (`min_offset(queue)`: the
    queue's lowest offset still kept)."""
    for key, _ in meta.items(CF, PREFIX):
        _, queue, offset = parse_record_key(key)
        if offset < min_offset(queue):
            yield key
