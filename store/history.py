"""The history of a topic filter: every stored message of every topic it matches, from a
start (the oldest kept, the newest of each topic, a time) to an end, in batches with a
cursor. Every MQTT message is stored once and indexed into its exact-topic queue, so
any filter's past can be read back, registered or not.

What a client can rely on:
- **Which messages**: those stored in the exact-topic queue of a topic the filter
  matches (MQTT matching: `#` and `+` never match a `$` topic at the first level). That
  is every MQTT publish and every native SEND/PUBLISH to an MQTT topic; a server app's
  message to a first-level topic alone, and retry or dead-letter copies, are not.
- **Order**: CommitLog order (store order) over all topics. Within a topic that is its
  queue order, offsets rising; across topics, the order the store appended them.
- **Where it ends**: the first batch fixes an end position in the log after every append
  submitted before it is written; `until` (a store time) ends it earlier. Later batches
  never go past that end, so the history is finite even while messages keep coming.
- **ends**: for each topic with a message in a batch, the offset in its exact-topic
  queue after the last one returned. A live reader that takes over continues each topic
  there (or, reading a wildcard queue, drops what is below it): no gap, no duplicate.
  A message's `queues` holds that one queue and its offset (decoding the others,
  partitions and wildcards, cost a quarter of the time).
- **cut**: the store no longer holds everything from the start asked for (retention
  removed older segments and the start lies before the oldest record kept).
- **Seek by time** assumes store times rise along the log (each append stamps its batch
  with the clock); after a clock step back a start lands between the two readings.

How it reads (the answer is the same whichever way is taken; only the cost differs):
- **topics**: a topic, or a filter over at most MERGE_MAX_QUEUES topics: their
  exact-topic queues, each from its own start, merged by log position;
- **partitions**: a wider filter under a named first level (`fleet/+/temp`): the
  partition queues of that first level, which hold every message under it, merged by
  log position, keeping the topics the filter matches;
- **log**: a wide filter whose first level is a wildcard (`#`, `+/alarm`): the CommitLog
  itself, from the first record at the start, keeping what matches.
Records are read in whole runs (one pread for records that lie back to back) and a
record's topic is looked at before the record is decoded.

A cursor is the end, `until`, the cut flag and a log position (the end of the last
record looked at): opaque to clients, no topic names in it, signed with the store's
key (store.cursor_key) and checked when it comes back: one the store did not give out
is refused before anything in it is read.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import hashlib
import hmac
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import orjson

from lightqueue.index import Entry
from lightqueue.routing import split_partition_queue
from lightqueue.since import EARLIEST, LAST, Since
from lightqueue.topic import first_level, is_wildcard, matches, validate_topic_filter
from store import record
from store.common import HistoryBatch, QueueSeek
from store.record import CorruptRecord, Message

if TYPE_CHECKING:
    from lightqueue.index import ConsumeQueueIndex
    from store.commitlog import CommitLog

MERGE_MAX_QUEUES = 64  # a filter over at most this many topics reads their queues
LIST_WALK_MAX = 4096  # queue names looked at to find them (~1 us each)
LAST_MAX_TOPICS = 100_000  # `last` reads each topic's newest entry: bounded
SCAN_BUDGET = 1 << 18  # records looked at in one call: a batch may come back short
MAX_COUNT = 4096
MAX_BYTES = 16 << 20
CHUNK = 1 << 20  # bytes of the log read at a time
PROBE = 64 << 10  # bytes read per probe of the seek by time over the log
WINDOW = 256 << 10  # below this the seek by time walks record headers
TOPIC_CACHE = 100_000
_HEAD = struct.Struct(">IIIQQBBHH")  # magic, length, crc, store_ts, born_ts, qos, flags,
#                                     client_len, topic_len: a record's leading fields
_PEEK = struct.Struct(">I26xHH")  # magic, client_len, topic_len: where the topic is
_SCAN = struct.Struct(">IIIQ10xHH")  # magic, length, crc, store_ts, client_len, topic_len
_TOPIC_AT = record.FRAME.size + record.FIXED.size  # + client_len: a record's topic
_TOPIC_AT_WIDE = record.FRAME.size + record.FIXED_WIDE.size
_MAGICS = (record.MAGIC.to_bytes(4, "big"), record.MAGIC_WIDE.to_bytes(4, "big"))
_MAGIC_INTS = (record.MAGIC, record.MAGIC_WIDE)
_NEVER = 1 << 63

TOPICS, PARTITIONS, LOG = "topics", "partitions", "log"


class CursorError(ValueError):
    """A cursor this store did not give out, or one for another filter."""


@dataclass
class _Read:
    """Where a history stands: what the cursor carries, and the first batch's start."""

    filter: str
    end: int
    until: int | None
    cut: bool
    pos: int = 0  # the end of the last record looked at (a record boundary)
    last: bool = False  # `last`: the newest message of each topic before the end
    mode: str = ""  # how the previous batch read (a hint; see the module's docstring)
    since: Since | None = None  # the first batch only: where each topic starts

    def token(self, key: bytes) -> str:
        """The cursor: the state, then its MAC under `key` (`STATE.MAC`, base64url)."""
        raw = orjson.dumps({"v": 1, "f": self.filter, "e": self.end, "u": self.until,
                            "c": self.cut, "p": self.pos, "l": self.last, "m": self.mode})
        state = _b64(raw)
        return f"{state}.{_b64(_mac(key, state))}"


NOT_OURS = ("not a history cursor this store gave out: pass a batch's cursor (a page's "
            "`next`) back unchanged, with the same filter")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _mac(key: bytes, state: str) -> bytes:
    return hmac.new(key, b"history cursor\0" + state.encode(), hashlib.sha256).digest()[:16]


def decode_cursor(token: str, topic_filter: str, key: bytes) -> _Read:
    """The state a cursor carries; CursorError for anything this store (its `key`) did
    not give out for `topic_filter`. Its log position is checked against the log by the
    reader."""
    if not isinstance(token, str) or len(token) > 4096 or token.count(".") != 1:
        raise CursorError(NOT_OURS)
    state_b64, _, mac_b64 = token.partition(".")
    try:
        mac = _unb64(mac_b64)
    except (ValueError, binascii.Error):
        raise CursorError(NOT_OURS) from None
    if not hmac.compare_digest(mac, _mac(key, state_b64)):
        raise CursorError(NOT_OURS)
    try:  # signed by us: what follows only guards against our own mistakes
        obj = orjson.loads(_unb64(state_b64))
        if not isinstance(obj, dict) or obj.get("v") != 1:
            raise ValueError("unknown version")
        state = _Read(obj["f"], obj["e"], obj["u"], obj["c"], obj["p"], obj["l"], obj["m"])
        ints = (state.end, state.pos) + (() if state.until is None else (state.until,))
        if (not all(type(v) is int and v >= 0 for v in ints) or type(state.cut) is not bool
                or type(state.last) is not bool or state.mode not in ("", TOPICS, PARTITIONS,
                                                                      LOG)):
            raise ValueError("bad fields")
    except (ValueError, TypeError, KeyError, binascii.Error):
        raise CursorError(NOT_OURS) from None
    if state.filter != topic_filter:
        raise CursorError(f"the cursor belongs to the filter {state.filter!r}, not "
                          f"{topic_filter!r}")
    return state


def literal_prefix(topic_filter: str) -> str:
    """Every topic the filter matches starts with this (queue names sort by it)."""
    levels = topic_filter.split("/")
    for i, level in enumerate(levels):
        if level == "#":
            return "/".join(levels[:i])  # 'a/#' matches 'a' itself
        if level == "+":
            return "/".join(levels[:i]) + "/" if i else ""
    return topic_filter


def exact_offset(msg: Message) -> int | None:
    """The message's offset in its exact-topic queue (None: it is in none, e.g. a server
    app's message to a first-level topic, or a retry copy). Routing puts it first."""
    queues = msg.queues
    if queues and queues[0][0] == msg.topic:
        return queues[0][1]
    for name, offset in queues:
        if name == msg.topic:
            return offset
    return None


class _TopicMatch:
    """Whether a record's topic (raw bytes, not decoded) matches the filter, remembered:
    a replay meets the same topics again and again."""

    def __init__(self, topic_filter: str) -> None:
        self.filter = topic_filter
        self.seen: dict[bytes, bool] = {}  # read inline by the hot loops

    def __call__(self, raw: bytes) -> bool:
        hit = self.seen.get(raw)
        return self.learn(raw) if hit is None else hit

    def learn(self, raw: bytes) -> bool:
        try:
            hit = matches(self.filter, raw.decode())
        except UnicodeDecodeError:
            hit = False
        if len(self.seen) >= TOPIC_CACHE:
            self.seen.clear()
        self.seen[raw] = hit
        return hit


@dataclass
class _Out:
    """One batch being filled."""

    max_count: int
    max_bytes: int
    messages: list[Message] = field(default_factory=list)
    ends: dict[str, int] = field(default_factory=dict)
    nbytes: int = 0
    looked: int = 0  # records looked at (the scan budget)
    lost: bool = False  # a record was gone by the time it was read (retention)
    complete: bool = False  # `until` was reached: nothing after it, whatever the limit

    @property
    def full(self) -> bool:
        return (len(self.messages) >= self.max_count or self.nbytes >= self.max_bytes
                or self.looked >= SCAN_BUDGET)


class HistoryReader:
    """Reads histories from one store's CommitLog and index (any thread; no state but
    caches)."""

    def __init__(self, commitlog: CommitLog, index: ConsumeQueueIndex, key: bytes) -> None:
        self.log = commitlog
        self.index = index
        self.key = key  # cursors are signed with it (store.cursor_key)
        self._lock = threading.Lock()
        self._matchers: OrderedDict[str, _TopicMatch] = OrderedDict()
        # `last` lists every topic's newest entry; the batches after the first reuse it.
        self._last: OrderedDict[tuple[str, int, int | None], list[tuple[Entry, str]]] = (
            OrderedDict())

    # -- the two entry points (worker threads) -------------------------------------------
    def first(self, topic_filter: str, since: Since, until: int | None, end: int,
              max_count: int, max_bytes: int, limit: int | None) -> HistoryBatch:
        """The first batch of a history from `since` up to log position `end`."""
        validate_topic_filter(topic_filter)
        state = _Read(topic_filter, end, until, False, last=since.kind == LAST,
                      since=since)
        return self._read(state, max_count, max_bytes, limit)

    def next(self, token: str, topic_filter: str, max_count: int, max_bytes: int,
             limit: int | None) -> HistoryBatch:
        """The batch after the one that gave `token`."""
        validate_topic_filter(topic_filter)
        state = decode_cursor(token, topic_filter, self.key)
        state.end = min(state.end, self.index.checkpoint())  # never past the indexed log
        self._check_position(state)
        return self._read(state, max_count, max_bytes, limit)

    def seek(self, queue: str, ms: int) -> QueueSeek:
        """Where `queue`'s messages stored at or after `ms` begin, and whether retention
        removed some of them (see `_cut`)."""
        self.log.catch_up()
        offset = self.index.offset_at_time(queue, ms)
        lo, hi = self.index.min_offset(queue), self.index.max_offset(queue)
        return QueueSeek(offset, lo, hi, lo > 0 and self._trimmed_after(ms))

    # -- reading -----------------------------------------------------------------------
    def _read(self, state: _Read, max_count: int, max_bytes: int,
              limit: int | None) -> HistoryBatch:
        stop = state.end if limit is None else min(state.end, limit)
        out = _Out(max(1, min(max_count, MAX_COUNT)), max(1, min(max_bytes, MAX_BYTES)))
        if state.last:
            finished = self._read_last(state, out, stop)
        else:
            queues = None if state.mode in (PARTITIONS, LOG) else self._topics(state.filter)
            if queues is not None:
                state.mode = TOPICS
            elif is_wildcard(first_level(state.filter)):
                state.mode = LOG
            else:
                state.mode = PARTITIONS
                queues = self._partitions(first_level(state.filter))
            if state.since is not None:
                state.cut = self._cut(state, queues)
            if state.mode == LOG:
                finished = self._read_log(state, out, stop)
            else:
                assert queues is not None
                finished = self._read_queues(state, queues, out, stop)
        state.cut = state.cut or out.lost
        done = finished and (stop >= state.end or out.complete)
        if not done and state.pos < stop:  # a cursor never points at a damaged record
            state.pos = self.log.past_damage(state.pos)
        return HistoryBatch(out.messages, out.ends, None if done else state.token(self.key),
                            state.cut, state.end)

    def _starts(self, state: _Read, queues: Iterable[str]) -> dict[str, int]:
        """Each queue's first offset: from the start asked for, or past the position."""
        index, since = self.index, state.since
        if since is None:
            return {q: index.offset_at_position(q, state.pos) for q in queues}
        if since.kind == EARLIEST:
            return {q: index.min_offset(q) for q in queues}
        assert since.ms is not None
        return {q: index.offset_at_time(q, since.ms) for q in queues}

    def _read_queues(self, state: _Read, queues: list[str], out: _Out, stop: int) -> bool:
        """Merge the queues' entries by log position; True when nothing is left before
        `stop`. Each round reads up to `width` entries of every queue still going, and
        hands out those no unread entry can come before."""
        offsets = self._starts(state, queues)
        first_round = state.since is not None
        keep = None if state.mode == TOPICS else self._matcher(state.filter)
        until = _NEVER if state.until is None else state.until
        width = max(64, min(4096, out.max_count // max(1, len(offsets)) + 64))
        read = self.index.read_tuples
        while offsets and not out.full:
            got: dict[str, list[Entry]] = {}
            horizon = _NEVER
            for q in list(offsets):
                entries = _before(read(q, offsets[q], width), stop, until)
                if len(entries) == width:
                    horizon = min(horizon, entries[-1][0])  # more may follow: wait for them
                if entries:
                    got[q] = entries
                else:
                    del offsets[q]  # done before `stop` (or held back by the read limit)
            merged = sorted(e for entries in got.values() for e in entries)
            if first_round:  # a batch that looks at nothing still knows where it began
                state.pos = merged[0][0] if merged else state.end
                first_round = False
            if not merged:
                break
            self._emit(merged[:bisect.bisect_right(merged, (horizon, _NEVER))], state, out,
                       keep)
            for q, entries in got.items():  # each queue goes on after what was looked at
                k = bisect.bisect_left(entries, (state.pos,))
                offsets[q] = entries[k][3] if k < len(entries) else entries[-1][3] + 1
        return not offsets

    def _emit(self, entries: list[Entry], state: _Read, out: _Out,
              keep: _TopicMatch | None) -> None:
        """Read these entries' records (in log order) into `out` until it is full; the
        position moves past what was looked at. Records that lie back to back are read
        with one pread; a record whose topic is not wanted is not decoded."""
        decode, peek, read = _decode_exact, _PEEK.unpack_from, self.log.read_bytes
        seen, learn = (keep.seen, keep.learn) if keep is not None else ({}, None)
        messages, ends = out.messages, out.ends
        room, nbytes = out.max_count - len(messages), out.nbytes
        i, n, pos = 0, len(entries), state.pos
        while i < n and room > 0 and nbytes < out.max_bytes and out.looked < SCAN_BUDGET:
            j, start = i + 1, entries[i][0]
            end = start + entries[i][1]
            while j < n and entries[j][0] == end and end - start < CHUNK:
                end += entries[j][1]
                j += 1
            data, _ = read(start, end - start)
            have, before = len(data), i
            for phys, size, _ts, _offset in entries[i:j]:
                rel = phys - start
                if rel + size > have:
                    break  # a segment ends here: read on from this record's own start
                i += 1
                pos = phys + size
                if keep is not None:
                    magic, lc, lt = peek(data, rel)
                    at = rel + (_TOPIC_AT if magic == record.MAGIC else _TOPIC_AT_WIDE) + lc
                    raw = data[at:at + lt]
                    hit = seen.get(raw)
                    if not (learn(raw) if hit is None else hit):
                        continue
                try:
                    found = decode(data, rel, phys)
                except CorruptRecord as exc:  # damaged: read around, never served
                    self.log.note_damaged(phys, size, exc, data, rel)
                    continue
                if found is None:
                    continue
                msg, exact = found
                messages.append(msg)
                ends[msg.topic] = exact + 1
                nbytes += len(msg.body)
                room -= 1
                if room <= 0 or nbytes >= out.max_bytes:
                    break
            out.looked += i - before
            if i == before:  # not there any more: retention removed its segment
                pos = entries[i][0] + entries[i][1]
                out.lost = True
                i += 1
        state.pos, out.nbytes = pos, nbytes

    def _matcher(self, topic_filter: str) -> _TopicMatch:
        """The filter's topic matcher, kept across batches (its cache is the point)."""
        with self._lock:
            match = self._matchers.pop(topic_filter, None) or _TopicMatch(topic_filter)
            self._matchers[topic_filter] = match
            while len(self._matchers) > 64:
                self._matchers.popitem(last=False)
        return match

    def _read_log(self, state: _Read, out: _Out, stop: int) -> bool:
        """Records of the log from the start position, keeping what the filter matches
        and what sits in its exact-topic queue; True when nothing is left before `stop`."""
        keep = self._matcher(state.filter)
        seen, learn = keep.seen, keep.learn
        until = _NEVER if state.until is None else state.until
        decode, scan, head = _decode_exact, _SCAN.unpack_from, _HEAD.unpack_from
        crc32 = zlib.crc32
        messages, ends = out.messages, out.ends
        room, nbytes = out.max_count - len(messages), out.nbytes
        pos = self._log_start(state)
        while pos < stop and room > 0 and nbytes < out.max_bytes and out.looked < SCAN_BUDGET:
            if pos < self.log.min_offset:  # retention went past us
                pos, out.lost = self.log.min_offset, True
                continue
            data, seg_end = self.log.read_bytes(pos, min(CHUNK, stop - pos))
            if len(data) < record.HEADER_SIZE:
                if data and pos + len(data) == seg_end:  # no record fits: damaged bytes
                    pos = max(pos + 1, self.log.skip_damaged(pos))
                    continue
                break
            magic, size = head(data, 0)[:2]
            if magic in _MAGIC_INTS and len(data) < size <= min(stop, seg_end) - pos:
                data, _ = self.log.read_bytes(pos, size)  # one record larger than a chunk
            rel, have, looked, damaged = 0, len(data), 0, False
            view = memoryview(data)
            while rel + record.HEADER_SIZE <= have:
                magic, size, crc, ts, lc, lt = scan(data, rel)
                # Every record's frame and CRC are checked before its length or its time
                # is believed: a damaged one is stepped over (CommitLog.skip_damaged).
                if magic not in _MAGIC_INTS or size < record.HEADER_SIZE \
                        or pos + rel + size > seg_end:
                    damaged = True
                    break
                if rel + size > have:
                    damaged = rel == 0  # the read above would have taken it whole
                    break
                if crc32(view[rel + 12:rel + size]) != crc:
                    damaged = True
                    break
                if ts >= until:  # (store times rise along the log): nothing more to come
                    state.pos, out.complete, out.nbytes = state.end, True, nbytes
                    out.looked += looked
                    view.release()
                    return True
                looked += 1
                at = rel
                rel += size
                topic_at = at + (_TOPIC_AT if magic == record.MAGIC else _TOPIC_AT_WIDE) + lc
                raw = data[topic_at:topic_at + lt]
                hit = seen.get(raw)
                if not (learn(raw) if hit is None else hit):
                    continue
                try:
                    found = decode(data, at, pos + at)
                except CorruptRecord as exc:  # its fields disagree: never served
                    self.log.note_damaged(pos + at, size, exc, data, at)
                    continue
                if found is None:
                    continue
                msg, exact = found
                messages.append(msg)
                ends[msg.topic] = exact + 1
                nbytes += len(msg.body)
                room -= 1
                if room <= 0 or nbytes >= out.max_bytes:
                    break
            view.release()
            out.looked += looked
            if damaged:
                nxt = self.log.skip_damaged(pos + rel)
                if nxt > pos + rel:
                    pos = nxt
                    continue
                pos += rel  # it checks when read again: a torn read, the next call goes on
                rel = 0
            if rel == 0:
                break  # a torn read (the log changed under us): the next call goes on
            pos += rel
        state.pos, out.nbytes = pos, nbytes
        return pos >= stop

    def _log_start(self, state: _Read) -> int:
        since = state.since
        if since is None:
            return state.pos
        if since.kind == EARLIEST or since.ms is None:
            return self.log.min_offset
        return self.position_at_time(since.ms, state.end)

    def _read_last(self, state: _Read, out: _Out, stop: int) -> bool:
        """The newest message of each topic before the end (and `until`), in log order,
        from the position on."""
        newest = self._newest(state)
        i = bisect.bisect_left(newest, ((state.pos, 0, 0, 0), ""))
        todo = [e for e, _ in newest[i:] if e[0] + e[1] <= stop]
        held = len(todo) < len(newest) - i  # past a read limit: not finished
        self._emit(todo, state, out, None)
        return not held and (not todo or state.pos >= todo[-1][0] + todo[-1][1])

    def _newest(self, state: _Read) -> list[tuple[Entry, str]]:
        key = (state.filter, state.end, state.until)
        with self._lock:
            hit = self._last.get(key)
        if hit is not None:
            return hit
        topics = self._topics(state.filter, LAST_MAX_TOPICS, LAST_MAX_TOPICS * 4)
        if topics is None:
            raise ValueError(f"{state.filter!r} spans more than {LAST_MAX_TOPICS} topics: "
                             "'last' reads each one's newest message; narrow the filter")
        newest = sorted((e, q) for q in topics if (e := self._newest_of(q, state))
                        is not None)
        with self._lock:
            self._last[key] = newest
            while len(self._last) > 8:
                self._last.popitem(last=False)
        return newest

    def _newest_of(self, queue: str, state: _Read) -> Entry | None:
        index = self.index
        e = index.entry_before(queue, index.max_offset(queue))
        if e is not None and (e[0] + e[1] > state.end or (
                state.until is not None and e[2] >= state.until)):
            end = index.offset_at_position(queue, state.end)
            if state.until is not None:
                end = min(end, index.offset_at_time(queue, state.until))
            e = index.entry_before(queue, end)
        return e

    # -- which queues --------------------------------------------------------------------
    def _topics(self, topic_filter: str, limit: int | None = None,
                walk: int | None = None) -> list[str] | None:
        """The topics the filter matches that have entries (their exact-topic queues), or
        None when there are more than `limit` (MERGE_MAX_QUEUES) or finding them takes
        more than `walk` (LIST_WALK_MAX) queue names."""
        if not is_wildcard(topic_filter):
            return [topic_filter]
        limit = MERGE_MAX_QUEUES if limit is None else limit
        walk = LIST_WALK_MAX if walk is None else walk
        out: list[str] = []
        for n, name in enumerate(self.index.queues(literal_prefix(topic_filter), walk + 1)):
            if n >= walk:
                return None
            if not is_wildcard(name) and matches(topic_filter, name):  # (partitions: '#')
                out.append(name)
                if len(out) > limit:
                    return None
        return out

    def _partitions(self, topic: str) -> list[str]:
        """The partition queues of a first-level topic that have entries (a change of
        the partition count leaves the old ones until retention)."""
        return [q for q in self.index.queues(topic + "#", 1 << 16)
                if (part := split_partition_queue(q)) is not None and part[0] == topic]

    # -- retention ---------------------------------------------------------------------
    def _cut(self, state: _Read, queues: list[str] | None) -> bool:
        """Whether retention removed messages at or after the start: the log was trimmed,
        the start is before its oldest record, and (reading queues) one of them had
        entries below the first it keeps."""
        since = state.since
        assert since is not None
        if not self._trimmed_after(-1 if since.ms is None else since.ms):
            return False
        return queues is None or any(self.index.min_offset(q) > 0 for q in queues)

    def _trimmed_after(self, ms: int) -> bool:
        """Whether retention removed records of the log, some perhaps stored at or after
        `ms`: every removed record is older than the oldest kept."""
        if self.log.min_offset == 0:
            return False
        oldest = self.record_time(self.log.min_offset)
        return oldest is not None and ms < oldest

    def record_time(self, pos: int) -> int | None:
        """The store time of the record at `pos` (a record start), read from its header."""
        data, _ = self.log.read_bytes(pos, _HEAD.size)
        return _HEAD.unpack_from(data, 0)[3] if len(data) == _HEAD.size else None

    # -- positions in the log --------------------------------------------------------------
    def _check_position(self, state: _Read) -> None:
        """A cursor's position must be a record start (or the end): the log is read from
        there, and a forged position inside a message body could show a record hidden
        in it."""
        pos = state.pos
        if pos <= self.log.min_offset or pos >= state.end:
            return
        try:
            self.log.read(pos)  # checks with the index that a record starts there
        except (KeyError, CorruptRecord):
            # (retention may have just moved the start; a damaged record there is read
            # around: the batch before stopped at it)
            if pos >= self.log.min_offset and self.log.damage.containing(pos) is None:
                raise CursorError(f"{NOT_OURS} (no record starts at its position)"
                                  ) from None

    def position_at_time(self, ms: int, end: int) -> int:
        """The log position of the first record stored at or after `ms`, or `end`: a
        binary search over byte positions (each probe finds the next record start from
        there), then a walk over record headers. Nothing but the log is needed, so it
        serves filters that span every first-level topic."""
        lo = self.log.min_offset
        first = self.record_time(lo) if lo < end else None
        if first is None or first >= ms:
            return lo if first is not None else end
        hi = end  # invariant: records before lo are older than ms; the answer <= next(hi)
        while hi - lo > WINDOW:
            mid = (lo + hi) // 2
            pos, size, ts = self._next_record(mid, end)
            if ts >= ms:
                hi = mid
            else:
                lo = pos + size
        return self._walk_to_time(lo, ms, end)

    def _walk_to_time(self, pos: int, ms: int, end: int) -> int:
        while pos < end:
            data, seg_end = self.log.read_bytes(pos, min(CHUNK, end - pos))
            rel, damaged = 0, False
            while rel + _HEAD.size <= len(data):
                magic, size, crc, ts, *_ = _HEAD.unpack_from(data, rel)
                if magic not in _MAGIC_INTS or size < record.HEADER_SIZE \
                        or pos + rel + size > seg_end:
                    damaged = True
                    break
                if rel + size > len(data):
                    if rel == 0:  # one record larger than a chunk
                        data, _ = self.log.read_bytes(pos, size)
                        if len(data) < size:
                            break
                    else:
                        break
                if zlib.crc32(memoryview(data)[rel + 12:rel + size]) != crc:
                    damaged = True
                    break
                if ts >= ms:  # (its time believed once its CRC checked)
                    return pos + rel
                rel += size
            if damaged:
                nxt = self.log.skip_damaged(pos + rel)
                if nxt > pos + rel:
                    pos = nxt
                    continue
            if rel == 0:
                break
            pos += rel
        return min(pos, end)

    def _next_record(self, pos: int, end: int) -> tuple[int, int, int]:
        """(start, size, store time) of the first record starting at or after `pos`
        (before `end`); (end, 0, never) when none does. A candidate is a magic that
        decodes and that the index knows: only the index knows where records start."""
        while pos < end:
            data, seg_end = self.log.read_bytes(pos, min(PROBE, end - pos))
            if not data:
                break
            for at in _candidates(data):
                start = pos + at
                found = self._record_at(start, end)
                if found is not None:
                    return found
            # Nothing here: on from the next chunk, keeping 3 bytes for a split magic.
            pos = seg_end if pos + len(data) >= seg_end else pos + max(1, len(data) - 3)
        return end, 0, _NEVER

    def _record_at(self, start: int, end: int) -> tuple[int, int, int] | None:
        head, _ = self.log.read_bytes(start, record.HEADER_SIZE)
        if len(head) < record.HEADER_SIZE:
            return None
        _, size, _, ts, *_ = _HEAD.unpack_from(head, 0)
        if not record.HEADER_SIZE <= size <= min(record.MAX_RECORD, end - start):
            return None
        data, _ = self.log.read_bytes(start, size)
        try:
            msg = record.decode(data, 0, start)
        except CorruptRecord:
            return None
        if not self.index.holds(start, msg.queues, msg.key):
            return None
        return start, size, ts


def _decode_exact(data: bytes, rel: int, phys: int) -> tuple[Message, int] | None:
    """The record at data[rel:] and its exact-topic offset, its queues cut to that one as
    every history message's are; None if it is in no exact-topic queue. Routing puts the
    exact queue first, so the common record decodes that queue alone; a record written
    otherwise is decoded whole and still found."""
    msg = record.decode_first(data, rel, phys)
    queues = msg.queues
    if queues and queues[0][0] == msg.topic:
        return msg, queues[0][1]
    msg = record.decode(data, rel, phys)
    exact = exact_offset(msg)
    if exact is None:
        return None
    msg.queues = [(msg.topic, exact)]
    return msg, exact


def _before(entries: list[Entry], stop: int, until: int) -> list[Entry]:
    """The entries whose records end by `stop` and were stored before `until` (both rise
    along a queue, so only the last is looked at unless some must go)."""
    if not entries or (entries[-1][0] + entries[-1][1] <= stop and entries[-1][2] < until):
        return entries
    n = bisect.bisect_right(entries, 0, key=lambda e: e[0] + e[1] > stop or e[2] >= until)
    return entries[:n]


def _candidates(data: bytes) -> list[int]:
    """Positions of a record magic in `data`, in order."""
    out: list[int] = []
    for magic in _MAGICS:
        at = data.find(magic)
        while at >= 0:
            out.append(at)
            at = data.find(magic, at + 1)
    return sorted(out)
