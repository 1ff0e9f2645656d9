"""A persistent session's QoS 1/2 deliveries from one queue, kept in the store together.

Such a PUBLISH goes to the client only once its in-flight record is in the store: one
the client saw and a crash forgot would come again, under another packet id, as a new
message. Written one by one, those records cost a metadata write per message, about
half of what a persistent session's catch-up cost the gateway; here a drain's sends
wait (encoded, their window slots taken) until it has a window's worth or must wait
itself, and their records go in one write, then the PUBLISHes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from gateway.mqtt import protocol as mp
from gateway.session import Session


class KeptSends:
    __slots__ = ("_persist", "_resume_at", "_send", "waiting")

    def __init__(self, persist: Callable[[list[mp.Outgoing]], Awaitable[None]],
                 send: Callable[[bytes], None]) -> None:
        """`persist` writes the records of the sends it is given in one write; `send`
        puts an encoded PUBLISH in the outbox."""
        self._persist, self._send = persist, send
        self.waiting: list[tuple[mp.Outgoing, bytes]] = []
        self._resume_at = -1  # the queue offset of the first one waiting

    def add(self, o: mp.Outgoing, data: bytes, offset: int) -> None:
        """A send whose record is to be kept: `data` its encoded PUBLISH, `offset`
        its message's position in the queue being drained."""
        if not self.waiting:
            self._resume_at = offset
        self.waiting.append((o, data))

    async def keep(self) -> None:
        """Their records in one write, then the PUBLISHes to the outbox, in order. If
        the write fails (or is cancelled) they stay waiting for `drop`."""
        if not self.waiting:
            return
        await self._persist([o for o, _ in self.waiting])
        waiting, self.waiting = self.waiting, []
        for _, data in waiting:
            self._send(data)

    def drop(self, s: Session, queue: str) -> None:
        """What was never kept was never sent: its window slots and packet ids are
        free again, and the drain resumes at the first of them (delivered anew)."""
        if not self.waiting:
            return
        for o, _ in self.waiting:
            if s.outgoing.get(o.packet_id) is o:
                del s.outgoing[o.packet_id]
        self.waiting = []
        s.cursors[queue] = self._resume_at
        s.offsets_dirty.add(queue)
