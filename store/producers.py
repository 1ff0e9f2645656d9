"""Idempotent producers' sequences: what the CommitLog checks inside an append, so that
a request sent again (after a lost connection, a failover, a Spark batch replayed) is
stored once.

A producer (an SDK Producer, a task of the Spark sink) holds an id the store issued
(store.producer_ids) and numbers the messages it sends to each first-level topic 0, 1,
2, ... under an epoch that may only grow; a higher epoch starts again at 0 (the Spark
sink's epoch is the micro-batch id). A gateway's MQTT publishes (PUBLISH) are numbered
in one sequence whatever their topics (PUBLISHES). For each (producer, topic) the store keeps its
newest appends, and a request that carries (id, epoch, first sequence) is

- appended when it continues the sequence (first = last + 1, or 0 under a higher epoch);
- a duplicate when every message of it is stored already: not appended, answered with
  the original offsets (those of the last KEEP appends; older ones are acknowledged
  without them);
- appended in part when it overlaps the end of what is stored: the messages after it
  only (an append torn by a crash, then sent again whole);
- refused, nothing appended, when it leaves a gap, comes under a lower epoch than the
  one stored (a writer that was replaced), or would make the store remember more than
  its budget of sequences (--max-producers).

The state is derived from the log, so it survives a restart and travels with
replication: the first record of such an append has MARK_FIRST and `lg_producer: [id,
epoch, first]` among its properties, the others MARK_MORE (store.record), and `observe`
rebuilds the table from records in log order (an append torn by a crash counts as the
records that survived). A snapshot (`dump`/`load`) says what the table was at a log
position: recovery reads it and the records after it. Sans-IO: no file, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import orjson

from store.record import MARK_FIRST, MARK_MORE, Message

KEEP = 5  # appends remembered per (producer, topic): a duplicate of one gets its offsets
# The sequence of a producer's MQTT publishes (PUBLISH: a gateway's, whatever their
# topics): one per producer, not one per first-level topic. No first level is "/" (it
# is what splits them), so it names no SEND's sequence. Its records say it as a fourth
# item of their stamp, `[id, epoch, first, "/"]` (a reader without it forgets them).
PUBLISHES = "/"
SNAPSHOT_VERSION = 1

# (epoch, first sequence, last sequence, log offset of its first record, of its end)
Batch = tuple[int, int, int, int, int]
Key = tuple[str, str]  # (producer id, first-level topic)
Entry = tuple[int, tuple[Batch, ...]]  # (store time of the newest record, ms; batches)


class SequenceError(ValueError):
    """A request the producer's sequence refuses: nothing of it was appended."""

    status = 409


class ProducerBudgetError(SequenceError):
    """The store remembers as many producer sequences as its budget allows."""

    status = 429


@dataclass(frozen=True, slots=True)
class Stamp:
    """What an idempotent request carries: the producer, the first-level topic it sends
    to, its epoch and the sequence of its first message."""

    producer: str
    topic: str
    epoch: int
    seq: int


@dataclass(slots=True)
class Plan:
    """What to do with a request: its first `skip` messages are stored already
    (duplicates; `stored` says where: (start, end, first index, count) runs of records
    to read back, or None when they are older than the appends kept); the rest is
    appended."""

    skip: int
    stored: list[tuple[int, int, int, int]] | None


def first_level(topic: str) -> str:
    return topic.split("/", 1)[0]


class ProducerTable:
    """(producer, topic) -> its newest appends. Callers serialise access (the CommitLog's
    write lock); entries are replaced, never changed in place, so `copy` is a snapshot."""

    def __init__(self, max_sequences: int = 10_000) -> None:
        self.max_sequences = max_sequences
        self._entries: dict[Key, Entry] = {}
        self._open: Key | None = None  # observe: the append whose records come next
        self.dirty = False  # changed since the last snapshot
        self.refused = 0  # requests refused by the budget

    def __len__(self) -> int:
        return len(self._entries)

    def producers(self) -> set[str]:
        return {pid for pid, _ in self._entries}

    def get(self, key: Key) -> Entry | None:
        """A sequence's newest appends, as kept."""
        return self._entries.get(key)

    def put(self, key: Key, entry: Entry) -> None:
        """Take a sequence back as another checker kept it (the native server's, which
        checks a producer's publishes while a connection it carries holds them)."""
        self._entries[key] = entry
        self.dirty = True

    def last_seen(self) -> dict[str, int]:
        """Each producer's newest record's store time (ms)."""
        out: dict[str, int] = {}
        for (pid, _), (seen, _) in self._entries.items():
            if seen > out.get(pid, -1):
                out[pid] = seen
        return out

    # -- the master: checking requests -------------------------------------------------
    def plan(self, st: Stamp, count: int) -> Plan:
        """How a request of `count` messages fits the sequence; SequenceError if not."""
        entry = self._entries.get((st.producer, st.topic))
        if entry is None:
            if st.seq != 0:
                raise SequenceError(
                    f"sequence gap: producer {st.producer} has sent nothing to {st.topic!r} "
                    f"that the store remembers, so its first sequence is 0, not {st.seq}")
            if len(self._entries) >= self.max_sequences:
                self.refused += 1
                raise ProducerBudgetError(
                    f"the store remembers {self.max_sequences} producer sequences (a "
                    "producer id and a topic it writes to: --max-producers); idle ones are "
                    "forgotten after --producer-idle-s")
            return Plan(0, [])
        epoch, _, last = entry[1][-1][:3]
        if st.epoch < epoch:
            raise SequenceError(
                f"producer {st.producer} sends to {st.topic!r} under epoch {st.epoch}, "
                f"older than its epoch {epoch} there: a replaced writer is refused")
        if st.epoch > epoch or st.seq == last + 1:
            if st.epoch > epoch and st.seq != 0:
                raise SequenceError(
                    f"sequence gap: a new epoch {st.epoch} of producer {st.producer} on "
                    f"{st.topic!r} starts at sequence 0, not {st.seq}")
            return Plan(0, [])
        if st.seq > last + 1:
            raise SequenceError(
                f"sequence gap: producer {st.producer} on {st.topic!r} (epoch {epoch}) "
                f"stored up to sequence {last}; {st.seq} would skip {st.seq - last - 1}")
        skip = min(count, last - st.seq + 1)
        return Plan(skip, _runs(entry[1], st.epoch, st.seq, st.seq + skip - 1))

    def appended(self, st: Stamp, first: int, count: int, start: int, end: int,
                 store_ts: int) -> tuple[Key, Entry | None]:
        """Record an append of `count` messages from sequence `first`, written at log
        offsets [start, end); returns what `undo` needs if the write then fails."""
        key = (st.producer, st.topic)
        old = self._entries.get(key)
        self._put(key, (st.epoch, first, first + count - 1, start, end), store_ts, old)
        self._open = None
        return key, old

    def undo(self, changes: Iterable[tuple[Key, Entry | None]]) -> None:
        """Take back `appended` records, newest first (their write failed)."""
        for key, old in changes:
            if old is None:
                self._entries.pop(key, None)
            else:
                self._entries[key] = old

    # -- every node: records as the log holds them ---------------------------------------
    def observe(self, msgs: Iterable[Message]) -> None:
        """Follow records in log order (a replica's copy, recovery's scan): appends are
        rebuilt from their marks. An append's records may come in several calls."""
        for m in msgs:
            if m.mark & MARK_FIRST:
                stamp = _stamp_of(m)
                if stamp is None:
                    self._open = None
                    continue
                key = (stamp.producer, stamp.topic)
                batch = (stamp.epoch, stamp.seq, stamp.seq, m.phys_offset,
                         m.phys_offset + m.size)
                self._put(key, batch, m.store_ts, self._entries.get(key))
                self._open = key
            elif m.mark & MARK_MORE and self._open is not None:
                entry = self._entries.get(self._open)
                if entry is None:
                    self._open = None
                    continue
                epoch, first, last, start, _ = entry[1][-1]
                self._entries[self._open] = (
                    max(entry[0], m.store_ts),
                    (*entry[1][:-1], (epoch, first, last + 1, start, m.phys_offset + m.size)))
                self.dirty = True
            else:
                self._open = None

    def _put(self, key: Key, batch: Batch, store_ts: int, old: Entry | None) -> None:
        batches = (*old[1], batch)[-KEEP:] if old is not None else (batch,)
        self._entries[key] = (max(store_ts, old[0]) if old is not None else store_ts,
                              batches)
        self.dirty = True

    # -- bounds --------------------------------------------------------------------------
    def expire(self, before_ms: int) -> set[str]:
        """Forget sequences whose newest record is older than `before_ms`; the producers
        left with none."""
        stale = [k for k, (seen, _) in self._entries.items() if seen < before_ms]
        for key in stale:
            del self._entries[key]
        if stale:
            self.dirty = True
            if self._open in stale:
                self._open = None
        live = self.producers()
        return {pid for pid, _ in stale if pid not in live}

    def forget(self, producers: set[str]) -> None:
        """Drop every sequence of these producers (their ids were forgotten)."""
        gone = [k for k in self._entries if k[0] in producers]
        for key in gone:
            del self._entries[key]
        if gone:
            self.dirty = True

    # -- snapshots -----------------------------------------------------------------------
    def snapshot(self) -> tuple[dict[Key, Entry], Key | None]:
        """The table now and the append whose records may still follow (entries are
        immutable: a shallow copy is a snapshot)."""
        self.dirty = False
        return dict(self._entries), self._open

    def clear(self) -> None:
        self._entries.clear()
        self._open = None
        self.dirty = True


def dump(offset: int, snapshot: tuple[dict[Key, Entry], Key | None]) -> bytes:
    """A snapshot of the table (`ProducerTable.snapshot`) as of log offset `offset`."""
    entries, open_key = snapshot
    return orjson.dumps({
        "v": SNAPSHOT_VERSION, "offset": offset,
        "entries": [[pid, topic, seen, [list(b) for b in batches]]
                    for (pid, topic), (seen, batches) in entries.items()],
        "open": list(open_key) if open_key else None})


def load(table: ProducerTable, raw: bytes) -> int:
    """Fill `table` from a snapshot; the log offset it covers. ValueError if `raw` is not
    a snapshot this code wrote."""
    try:
        obj = orjson.loads(raw)
        if not isinstance(obj, dict) or obj.get("v") != SNAPSHOT_VERSION:
            raise ValueError("unknown version")
        offset = obj["offset"]
        entries: dict[Key, Entry] = {}
        for pid, topic, seen, batches in obj["entries"]:
            rows = tuple((int(e), int(f), int(la), int(s), int(en)) for e, f, la, s, en in batches)
            if not (isinstance(pid, str) and isinstance(topic, str) and type(seen) is int
                    and rows):
                raise ValueError("bad entry")
            entries[(pid, topic)] = (seen, rows)
        open_key = obj.get("open")
        if type(offset) is not int or offset < 0:
            raise ValueError("bad offset")
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a producer snapshot: {exc}") from None
    table.clear()
    table._entries.update(entries)
    table._open = (str(open_key[0]), str(open_key[1])) if open_key else None
    table.dirty = False
    return offset


def _stamp_of(m: Message) -> Stamp | None:
    """The stamp a MARK_FIRST record carries; None if it is not well formed (a record
    of a store that wrote something else there is not a producer's)."""
    raw = m.producer
    if (isinstance(raw, list) and len(raw) in (3, 4) and isinstance(raw[0], str)
            and type(raw[1]) is int and type(raw[2]) is int and raw[1] >= 0 and raw[2] >= 0):
        if len(raw) == 4:
            return Stamp(raw[0], PUBLISHES, raw[1], raw[2]) if raw[3] == PUBLISHES else None
        return Stamp(raw[0], first_level(m.topic), raw[1], raw[2])
    return None


def _runs(batches: tuple[Batch, ...], epoch: int, lo: int, hi: int
          ) -> list[tuple[int, int, int, int]] | None:
    """Where sequences [lo, hi] of `epoch` lie: (start, end, first index, count) per
    append kept that holds some of them, oldest first; None if some are older than the
    appends kept."""
    out = []
    nxt = lo
    for b_epoch, first, last, start, end in batches:
        if b_epoch != epoch or last < nxt or first > hi:
            continue
        if first > nxt:
            return None
        take = min(last, hi) - nxt + 1
        out.append((start, end, nxt - first, take))
        nxt += take
        if nxt > hi:
            return out
    return None
