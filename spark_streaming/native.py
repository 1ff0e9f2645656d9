"""A minimal blocking native-protocol client for Spark's Python workers.

Executors run `read()`/`write()` in plain Python worker processes, one partition at a
time: a blocking socket and one request in flight is all they need. It avoids the SDK's
trio loop in a thread per partition, and imports only the sans-IO frame code.
"""

from __future__ import annotations

import itertools
import socket
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

from serving.values import split_hostport
from store import protocol as p
from store.record import Message

DEFAULT_TIMEOUT = 30.0
PULL_BATCH = 1024  # the store's MAX_PULL
SEND_BATCH = 500  # rows per SEND request (one CommitLog write each)
PIPELINE_DEPTH = 2  # PULL requests in flight per connection (pull_ranges)


class StoreClient:
    """`with StoreClient("127.0.0.1:10911") as c: c.describe("devices")`.

    Reconnects (with short backoff, within `timeout`) when a request fails on the
    connection, so a store restart under a long Spark task is survived.
    """

    def __init__(self, addr: str, *, timeout: float = DEFAULT_TIMEOUT,
                 username: str | None = None, password: str | None = None) -> None:
        self.addr = addr
        # A store group: "a:1,b:2,c:3"; the client talks to whichever says it is master.
        self.addrs = [split_hostport(a.strip(), "127.0.0.1") for a in addr.split(",")
                      if a.strip()]
        self.host, self.port = self.addrs[0]
        self._turn = 0
        self.timeout = timeout
        self.credentials = (username, password) if username else None
        self._sock: socket.socket | None = None
        self._decoder = p.FrameDecoder()
        self._ids = itertools.count(1)
        self._frames: list[p.Frame] = []
        self._generation = 0  # connections made so far (pull_ranges checks it)

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _connect(self) -> None:
        self.host, self.port = self.addrs[self._turn % len(self.addrs)]
        sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock, self._decoder, self._frames = sock, p.FrameDecoder(), []
        self._generation += 1
        header: dict[str, Any] = {"sdk": "lightgate-spark"}
        if self.credentials:
            header["username"], header["password"] = self.credentials
        hello = self._roundtrip(p.HELLO, header, b"").header
        if len(self.addrs) > 1 and hello.get("role", "master") != "master":
            raise ConnectionError(f"the store {self.host}:{self.port} is a {hello['role']}, "
                                  "not the master")

    def _roundtrip(self, code: int, header: dict[str, Any], body: bytes) -> p.Frame:
        return self._receive(self._send(code, header, body))

    def _send(self, code: int, header: dict[str, Any], body: bytes = b"") -> int:
        assert self._sock is not None
        rid = next(self._ids)
        self._sock.sendall(p.encode_frame(p.Frame(p.REQUEST, code, rid, header, body)))
        return rid

    def _receive(self, rid: int) -> p.Frame:
        assert self._sock is not None
        while True:
            for i, frame in enumerate(self._frames):
                if frame.request_id == rid:
                    del self._frames[i]
                    return frame
                if frame.kind == p.ERROR and frame.request_id == 0:
                    raise p.ProtocolError(str(frame.header.get("error")))
            data = self._sock.recv(1 << 20)
            if not data:
                raise ConnectionError(f"the store {self.addr} closed the connection")
            self._frames.extend(self._decoder.feed(data))

    def request(self, code: int, header: dict[str, Any], body: bytes = b"", *,
                again_if_unavailable: bool = False) -> tuple[dict[str, Any], bytes]:
        """One request, sent again on a new connection while the store is unreachable
        (within `timeout`); `again_if_unavailable`: also while it answers 503 (a store
        group's replica, a master without its lease): for requests that may be sent
        twice (reads; an idempotent producer's SEND)."""
        deadline = time.monotonic() + self.timeout
        delay = 0.05
        while True:
            try:
                if self._sock is None:
                    self._connect()
                frame = self._roundtrip(code, header, body)
                if not (again_if_unavailable and frame.kind == p.ERROR
                        and frame.header.get("status") == 503):
                    break
                exc: Exception = p.RemoteError(503, str(frame.header.get("error")))
            except (OSError, p.ProtocolError) as err:
                exc = err
            self.close()
            self._turn += 1  # a group: try the next node
            if time.monotonic() + delay > deadline:
                raise ConnectionError(f"store {self.addr} unreachable: {exc}") from exc
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
        if frame.kind == p.ERROR:
            raise p.RemoteError(int(frame.header.get("status", 500)),
                                str(frame.header.get("error", "error")))
        return frame.header, frame.body

    # -- reads ------------------------------------------------------------------------
    def describe(self, topic: str) -> list[dict[str, Any]]:
        """The topic's partition queues `topic#i` with min_offset and max_offset (end)."""
        header, _ = self.request(p.TOPIC_DESCRIBE, {"topic": topic})
        return list(header["queues"])

    def queue_range(self, queue: str) -> tuple[int, int]:
        header, _ = self.request(p.QUEUE_RANGE, {"queue": queue})
        return int(header["min_offset"]), int(header["max_offset"])

    def seek_time(self, queue: str, ms: int) -> int:
        """The first offset of `queue` stored at or after `ms` (its end when none was)."""
        header, _ = self.request(p.QUEUE_SEEK, {"queue": queue, "time": ms})
        return int(header["offset"])

    def pull(self, queue: str, offset: int, max_count: int = PULL_BATCH,
             wait_ms: int = 0) -> tuple[list[Message], int]:
        header, body = self.request(
            p.PULL, {"queue": queue, "offset": offset, "max": max_count, "wait_ms": wait_ms})
        return p.unpack_messages(header["messages"], body), int(header["next_offset"])

    def read_range(self, queue: str, start: int, end: int) -> Iterator[tuple[int, Message]]:
        """Every message of `queue` in [start, end), in order. Offsets below the queue's
        minimum are gone (retention) and skipped; the store clamps the pull for us."""
        offset = start
        while offset < end:
            msgs, nxt = self.pull(queue, offset, min(PULL_BATCH, end - offset))
            for m in msgs:
                off = m.offset_in(queue)
                if off >= end:
                    return
                if off >= start:
                    yield off, m
            if nxt <= offset:
                return  # nothing more below `end` (the log was cut by a repair)
            offset = nxt

    def pull_ranges(self, queue: str, start: int, end: int, depth: int = PIPELINE_DEPTH,
                    chunk: int = PULL_BATCH, raw: bool = False
                    ) -> Iterator[tuple[int, int, dict[str, Any], bytes]]:
        """The raw PULL responses covering [start, end) of `queue`, in order, as
        (chunk_start, chunk_end, header, body). The caller keeps the messages whose offset
        lies in [chunk_start, chunk_end): a chunk below the queue's minimum (retention) is
        answered from the minimum.

        `raw`: the store may answer with records as its log holds them (header `raw`,
        `runs`; see store.server's _pull_raw), for the caller to decode.

        Up to `depth` requests are in flight on the connection, so the store reads the next
        chunk while the caller converts this one. A chunk the store answers only in part (a
        smaller MAX_PULL) is completed by follow-up pulls before the next chunk is yielded.
        When the connection fails, the chunks not yet yielded are pulled again one at a
        time, with `request()`'s reconnects."""
        chunks = [(lo, min(lo + chunk, end)) for lo in range(start, end, chunk)]
        # (request id, chunk index, connection) of the requests in flight
        pending: deque[tuple[int, int, int]] = deque()
        sent = 0  # chunks[:sent] were requested
        done = 0  # chunks[:done] were yielded
        pipelined = depth > 1
        while done < len(chunks):
            lo, hi = chunks[done]
            if pipelined:
                try:
                    if self._sock is None:
                        self._connect()
                    while sent < len(chunks) and len(pending) < depth:
                        c_lo, c_hi = chunks[sent]
                        pending.append((self._send(p.PULL, {"queue": queue, "offset": c_lo,
                                                            "max": c_hi - c_lo,
                                                            "wait_ms": 0, "raw": raw}),
                                        sent, self._generation))
                        sent += 1
                    rid, index, generation = pending[0]
                    assert index == done
                    if generation != self._generation:  # a follow-up pull reconnected
                        raise ConnectionError("reconnected while requests were in flight")
                    frame = self._receive(rid)
                    pending.popleft()
                except (OSError, p.ProtocolError):
                    self.close()
                    pipelined = False  # the rest one at a time, with retries
                    pending.clear()
                    sent = done
                    continue
                if frame.kind == p.ERROR:
                    raise p.RemoteError(int(frame.header.get("status", 500)),
                                        str(frame.header.get("error", "error")))
                header, body = frame.header, frame.body
            else:
                header, body = self.request(p.PULL, {"queue": queue, "offset": lo,
                                                     "max": hi - lo, "wait_ms": 0, "raw": raw})
            done += 1
            yield lo, hi, header, body
            nxt = int(header["next_offset"])
            while lo < nxt < hi:
                # Answered in part: the rest of this chunk before the next one (on the
                # same connection, the pipelined answers wait in self._frames). An answer
                # with no record that moved on (past damaged records) is answered in
                # part too.
                header, body = self.request(p.PULL, {"queue": queue, "offset": nxt,
                                                     "max": hi - nxt, "wait_ms": 0,
                                                     "raw": raw})
                lo = nxt
                yield lo, hi, header, body
                nxt = int(header["next_offset"])

    def wait_for_records(self, ends: dict[str, int], wait_ms: int) -> bool:
        """Until a record lands at one of `ends` (queue -> its end offset) or `wait_ms`
        passes: a long-polling PULL of one record per queue, all sent at once (the
        store answers each as soon as its queue grows). The connection is closed after,
        which drops the polls still waiting. True when a record landed; False after
        `wait_ms`, or when the store could not be asked (the caller's next request says
        why)."""
        if not ends or wait_ms <= 0:
            return False
        try:
            if self._sock is None:
                self._connect()
            assert self._sock is not None
            pending = {self._send(p.PULL, {"queue": q, "offset": off, "max": 1,
                                           "wait_ms": wait_ms, "raw": True})
                       for q, off in ends.items()}
            self._sock.settimeout(self.timeout + wait_ms / 1000)
            while pending:
                for frame in self._frames:
                    if frame.request_id not in pending:
                        continue
                    pending.discard(frame.request_id)
                    if frame.kind != p.ERROR and (frame.header.get("runs")
                                                  or frame.header.get("messages")):
                        return True
                self._frames = []
                if not pending:
                    return False
                data = self._sock.recv(1 << 16)
                if not data:
                    return False
                self._frames.extend(self._decoder.feed(data))
            return False
        except (OSError, p.ProtocolError):
            return False
        finally:
            self.close()

    # -- writes -----------------------------------------------------------------------
    def send(self, topic: str, messages: Sequence[Message],
             producer: tuple[str, int, int] | None = None) -> list[dict[str, Any]]:
        """One SEND request (one CommitLog append) to the first-level `topic`.
        `producer`: (id, epoch, sequence of the first message) of an idempotent producer
        (store.producers): then it is sent again until answered, and stored once."""
        metas, body = p.pack_messages(list(messages))
        header: dict[str, Any] = {"topic": topic, "messages": metas}
        if producer is not None:
            header["producer"], header["epoch"], header["seq"] = producer
        reply, _ = self.request(p.SEND, header, body, again_if_unavailable=producer is not None)
        return list(reply["results"])

    def init_producer(self, name: str | None = None) -> str:
        """An idempotent producer's id; a name gives the same id on every call (as long
        as the store remembers it: --producer-idle-s)."""
        header = {} if name is None else {"name": name}
        reply, _ = self.request(p.PRODUCER_INIT, header, again_if_unavailable=True)
        return str(reply["producer"])
