"""The ids the store issues to idempotent producers (PRODUCER_INIT), kept in the
metadata's `producers` column family, so they survive a restart and a store group's
replicas copy them with the rest of the metadata:

    id/{producer id}          -> {"user": owner, "created": ms, "name": name or None}
    name/{user}\\0{name}       -> producer id   (a named producer: the same id again)

An id belongs to the user that asked for it: another user's requests with it are
refused, and so is an id the store never issued (or forgot). A name (the Spark sink
names one per query and partition) gives its user the same id on every start, so that
what a restarted writer sends again is recognised. An id whose producer sent nothing
for the idle time is forgotten with its sequences (store.producers); the number of ids
held has the same budget as the sequences (--max-producers).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from store.metadata import Metadata
from store.producers import ProducerBudgetError

CF = "producers"
MAX_NAME = 1024


class UnknownProducer(ValueError):
    """An id this store did not issue, or has forgotten."""

    status = 410


class NotYourProducer(ValueError):
    """An id issued to another user."""

    status = 403


@dataclass(frozen=True, slots=True)
class ProducerId:
    id: str
    user: str
    created: int  # ms since the epoch
    name: str | None


class ProducerIds:
    """The issued ids, read from the metadata once (`load`) and kept in memory: on a
    store group's master only this class writes them, so memory and metadata agree until
    the node's role changes (then `load` again)."""

    def __init__(self, meta: Metadata, max_ids: int) -> None:
        self.meta = meta
        self.max_ids = max_ids
        self._ids: dict[str, ProducerId] = {}
        self.refused = 0

    def __len__(self) -> int:
        return len(self._ids)

    def load(self) -> None:
        ids = {}
        for key, value in self.meta.items(CF, "id/"):
            pid = key[3:]
            if isinstance(value, dict):
                ids[pid] = ProducerId(pid, str(value.get("user", "")),
                                      int(value.get("created", 0)), value.get("name"))
        self._ids = ids

    def issue(self, user: str, name: str | None, now_ms: int) -> ProducerId:
        """A new id for `user`; with a name, the id that name has already if any."""
        if name is not None:
            if not isinstance(name, str) or not name or len(name) > MAX_NAME:
                raise ValueError(f"a producer name is a string of 1 to {MAX_NAME} characters")
            known = self.meta.get(CF, _name_key(user, name))
            if isinstance(known, str) and known in self._ids:
                return self._ids[known]
        if len(self._ids) >= self.max_ids:
            self.refused += 1
            raise ProducerBudgetError(
                f"the store holds {self.max_ids} producer ids (--max-producers); idle ones "
                "are forgotten after --producer-idle-s")
        pid = os.urandom(8).hex()
        while pid in self._ids:
            pid = os.urandom(8).hex()
        entry = ProducerId(pid, user, now_ms, name)
        ops = [("put", CF, f"id/{pid}", {"user": user, "created": now_ms, "name": name})]
        if name is not None:
            ops.append(("put", CF, _name_key(user, name), pid))
        self.meta.write(ops)
        self._ids[pid] = entry
        return entry

    def check(self, pid: object, user: str) -> str:
        """`pid` if it is an id issued to `user`; UnknownProducer or NotYourProducer."""
        entry = self._ids.get(pid) if isinstance(pid, str) else None
        if entry is None:
            raise UnknownProducer(
                f"unknown producer id {str(pid)[:40]!r}: this store never issued it, or "
                "forgot it after --producer-idle-s without a message from it; ask for a "
                "new one (PRODUCER_INIT)")
        if entry.user != user:
            raise NotYourProducer(f"producer id {pid} belongs to another user")
        return pid

    def expire(self, before_ms: int, last_seen: Callable[[], dict[str, int]]) -> list[str]:
        """Forget the ids created before `before_ms` whose producers sent nothing since
        (`last_seen`: each producer's newest record's time); the ids forgotten."""
        seen = last_seen()
        stale = [e for e in self._ids.values()
                 if e.created < before_ms and seen.get(e.id, -1) < before_ms]
        if not stale:
            return []
        ops = []
        for e in stale:
            ops.append(("delete", CF, f"id/{e.id}", None))
            if e.name is not None:
                ops.append(("delete", CF, _name_key(e.user, e.name), None))
        self.meta.write(ops)
        for e in stale:
            self._ids.pop(e.id, None)
        return [e.id for e in stale]


def _name_key(user: str, name: str) -> str:
    return f"name/{user}\0{name}"
