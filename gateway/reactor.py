"""The reactor: one task reads every plain-TCP MQTT connection of this process.

A task per connection costs a scheduler pass and an epoll re-arm on every wake-up: with
many devices each sending a message now and then, that was most of the broker's CPU.
Here the connections' sockets sit in one epoll set of our own (registered once, level
triggered; a kqueue where there is no epoll: gateway.poller); trio waits on that set's
fd, and each pass reads every socket that has data, hands the bytes to its connection
(gateway.connection), appends what they published in one batch (gateway.inbound), then
writes what waits. Sockets that cannot take what is written are watched for writability
until they do; timers (the CONNECT's, keepalive, credentials) are a heap checked once
per pass."""

from __future__ import annotations

import heapq
import logging
import os
import socket
from typing import TYPE_CHECKING

import trio

from gateway.mqtt import reason as rc
from gateway.mqtt.protocol import Closing
from gateway.poller import ERR, HUP, RDHUP, READ, WRITE, open_poller
from serving.accepting import ACCEPT_BACKOFF_S, must_rest
from serving.fd_budget import over_budget
from serving.read_budget import ReadBudget

if TYPE_CHECKING:
    from gateway.broker import Broker
    from gateway.connection import Connection

log = logging.getLogger("lightgate.gateway.reactor")

READ_SIZE = 65536
MAX_EVENTS = 512  # sockets handled in one pass, at most: other tasks run in between
IN = READ | RDHUP
OUT = WRITE
STALE_TIMERS = 256  # forgotten timers the heap may hold beyond twice the live ones


class Reactor:
    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.ep = open_poller()
        self.conns: dict[int, Connection] = {}
        self._listeners: dict[int, tuple[socket.socket, str]] = {}
        self._resting: dict[int, float] = {}  # listener fd -> when it accepts again
        self._timers: list[tuple[float, int, int]] = []  # (deadline, seq, fd)
        self._armed: dict[int, float] = {}  # fd -> the deadline in the heap for it
        self._seq = 0
        self._writing: set[int] = set()
        self._paused: set[int] = set()  # fds not read now (lane busy, budget)
        self._over_budget: dict[int, float] = {}  # fd -> since when the budget holds it
        self._waiting: trio.CancelScope | None = None  # the wait, its deadline the next timer

    # -- sockets ---------------------------------------------------------------------------
    def listen(self, sock: socket.socket, addr: str) -> None:
        sock.setblocking(False)
        self._listeners[sock.fileno()] = (sock, addr)
        self.ep.register(sock.fileno(), READ)

    def _accept(self, sock: socket.socket) -> None:
        from gateway.connection import Connection

        for _ in range(256):
            try:
                s, addr = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if must_rest(exc, "MQTT over TCP"):
                    self._rest(sock.fileno())
                    return
                continue
            if over_budget(s.fileno(), "MQTT over TCP"):
                s.close()
                continue
            s.setblocking(False)
            try:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            fd = s.detach()  # the fd is the connection's: closed with it
            conn = Connection(self.broker, None, f"{addr[0]}:{addr[1]}", fd=fd)
            conn.reactor = self
            self.conns[fd] = conn
            self.ep.register(fd, IN)
            self.rearm(conn)

    def _rest(self, fd: int) -> None:
        """Out of descriptors (or the like): the listening socket stays readable, so it
        leaves the set for a moment instead of waking every pass (see serving.accepting)."""
        until = trio.current_time() + ACCEPT_BACKOFF_S
        self._resting[fd] = until
        try:
            self.ep.modify(fd, 0)
        except OSError:
            pass
        waiting = self._waiting
        if waiting is not None and until < waiting.deadline:
            waiting.deadline = until

    def _wake_listeners(self, now: float) -> None:
        for fd, until in list(self._resting.items()):
            if until <= now:
                del self._resting[fd]
                try:
                    self.ep.modify(fd, READ)
                except OSError:
                    pass

    def forget(self, conn: Connection) -> None:
        """The connection ends: its socket leaves the set (closed by the connection)."""
        fd = conn.fd
        if self.conns.pop(fd, None) is not None:
            try:
                self.ep.unregister(fd)
            except OSError:
                pass
        self._writing.discard(fd)
        self._paused.discard(fd)
        self._over_budget.pop(fd, None)
        if self._armed.pop(fd, None) is not None:
            self._drop_stale_timers()

    def _drop_stale_timers(self) -> None:
        """The heap forgets lazily; once the entries of connections gone (closed, or
        carried by the native plane: each leaves its CONNECT's timer) outnumber the
        live ones, only the live ones are kept: thousands of connections promoted at
        once would otherwise hold theirs for the CONNECT timeout."""
        timers, armed = self._timers, self._armed
        if len(timers) > 2 * len(armed) + STALE_TIMERS:
            timers[:] = [t for t in timers if armed.get(t[2]) == t[0]]
            heapq.heapify(timers)  # in place: `_check_timers` may be popping it

    def take_back(self, conn: Connection) -> None:
        """A connection the native plane hands back (gateway.handover): read again."""
        fd = conn.fd
        self.conns[fd] = conn
        self.ep.register(fd, IN)
        if not conn.reading:
            self._paused.add(fd)
            self._modify(fd)
        self.rearm(conn)

    def pause(self, conn: Connection) -> None:
        fd = conn.fd
        if fd in self.conns and fd not in self._paused:
            self._paused.add(fd)
            self._modify(fd)

    def resume(self, conn: Connection) -> None:
        fd = conn.fd
        if fd in self._paused and fd not in self._over_budget:  # the budget resumes it
            self._paused.discard(fd)
            self._modify(fd)

    def want_write(self, conn: Connection) -> None:
        fd = conn.fd
        if fd in self.conns and fd not in self._writing:
            self._writing.add(fd)
            self._modify(fd)
            waiting = self._waiting
            look = trio.current_time() + 1.0  # watch it for the timeout
            if waiting is not None and look < waiting.deadline:
                # (A timer further off, such as a CONNECT's left in the heap, must not
                # put the first look at a stuck writer off until it is due.)
                waiting.deadline = look

    def _modify(self, fd: int) -> None:
        mask = (0 if fd in self._paused else IN) | (OUT if fd in self._writing else 0)
        try:
            self.ep.modify(fd, mask)
        except OSError:
            pass

    def rearm(self, conn: Connection) -> None:
        """Make sure the heap holds the connection's next deadline (or an earlier one:
        deadlines move later with each read, and the heap is corrected lazily)."""
        deadline = conn.deadline
        fd = conn.fd
        if deadline == float("inf"):
            return
        armed = self._armed.get(fd)
        if armed is not None and armed <= deadline:
            return
        self._armed[fd] = deadline
        self._seq += 1
        heapq.heappush(self._timers, (deadline, self._seq, fd))
        waiting = self._waiting
        if waiting is not None and deadline < waiting.deadline:
            waiting.deadline = deadline  # wake the timer task in time

    # -- the loop --------------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        task_status.started()
        epfd = self.ep.fileno()
        try:
            async with trio.open_nursery() as nursery:
                # Timers in a task of their own: a deadline on every wait of the loop
                # (a cancel scope per pass) cost a tenth of a message's CPU at low rates.
                nursery.start_soon(self._run_timers)
                handover = self.broker.handover
                if handover is not None:
                    handover.start(nursery)  # one for the node's listeners
                while True:
                    await trio.lowlevel.wait_readable(epfd)
                    self._pass()
        finally:
            # Shutting down: every client told (v5 DISCONNECT 0x8B), its will and session
            # seen to, within a few seconds, whatever else is being cancelled.
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                async with trio.open_nursery() as ending:
                    for conn in list(self.conns.values()):
                        conn.close(Closing("server shutting down", True,
                                           rc.SERVER_SHUTTING_DOWN), ending)
                    if self.broker.handover is not None:  # its own are closed once back
                        await self.broker.handover.release_all(
                            self, Closing("server shutting down", True,
                                          rc.SERVER_SHUTTING_DOWN), ending)
            self.ep.close()

    async def _run_timers(self) -> None:
        while True:
            deadline = self._timers[0][0] if self._timers else float("inf")
            if self._writing:  # stuck writers are looked at every second
                deadline = min(deadline, trio.current_time() + 1.0)
            if self._resting:
                deadline = min(deadline, *self._resting.values())
            with trio.move_on_at(deadline) as self._waiting:  # `rearm` may bring it nearer
                await trio.sleep_forever()
            self._waiting = None
            self._check_timers()

    def _pass(self) -> None:
        """One pass: read what is there, append it as one batch, deliver what that
        brought to this gateway's subscribers, time out what is due."""
        try:
            events = self.ep.poll(0, MAX_EVENTS)
        except InterruptedError:
            events = []
        broker = self.broker
        inbound = broker.inbound
        inbound.in_pass = True
        broker.deferred = deferred = set()
        try:
            self._handle(events, self.conns, broker.read_budget)
            inbound.flush()
        finally:
            inbound.in_pass = False
            broker.deferred = None
        for delivery in deferred:
            try:
                delivery.pump()
            except Exception:  # one client's delivery must not stop the reactor
                log.exception("delivery to %s failed", delivery.conn.peer)

    def _handle(self, events: list[tuple[int, int]], conns: dict[int, Connection],
                budget: ReadBudget) -> None:
        for fd, mask in events:
            conn = conns.get(fd)
            if conn is None:
                listener = self._listeners.get(fd)
                if listener is not None:
                    self._accept(listener[0])
                continue
            if mask & OUT and conn.writable():
                self._writing.discard(fd)
                self._modify(fd)
            if mask & (IN | HUP | ERR) and fd not in self._paused:
                self._read(conn, budget)

    def _read(self, conn: Connection, budget: ReadBudget) -> None:
        fd = conn.fd
        held = conn.core.decoder.buffered
        if held and budget.must_wait(held):
            self._hold(conn)
            return
        try:
            data = os.read(fd, budget.read_size(held, READ_SIZE))
        except BlockingIOError:
            return
        except OSError as exc:
            conn.close(Closing(f"connection lost: {exc!r}"))
            return
        if not data:
            conn.eof()
            return
        conn.data_received(data)
        if fd in self.conns:
            self.rearm(conn)

    def _hold(self, conn: Connection) -> None:
        """The node's read budget is spent and this connection holds its share: not
        read until there is room, and closed past --partial-timeout-s."""
        fd = conn.fd
        budget = self.broker.read_budget
        if fd not in self._over_budget:
            budget.paused += 1
            self._over_budget[fd] = trio.current_time()
            self.pause(conn)
            conn.spawn(self._wait_budget, conn)

    async def _wait_budget(self, conn: Connection) -> None:
        budget = self.broker.read_budget
        held = conn.core.decoder.buffered
        ok = await budget.wait(held)
        self._over_budget.pop(conn.fd, None)
        if not ok:
            self.broker.stats.limit_refusals += 1
            log.warning("%s closed: held %d bytes of a partial packet while the node's "
                        "read budget was exhausted (--max-partial-bytes)", conn.peer, held)
            conn.close(Closing("read budget exhausted", True, rc.QUOTA_EXCEEDED))
        elif conn.reading:
            self.resume(conn)

    def _check_timers(self) -> None:
        if self._resting:
            self._wake_listeners(trio.current_time())
        if not self._timers and not self._writing:
            return
        now = trio.current_time()
        timers, conns = self._timers, self.conns
        while timers and timers[0][0] <= now:
            _, _, fd = heapq.heappop(timers)
            conn = conns.get(fd)
            self._armed.pop(fd, None)
            if conn is None:
                continue
            if conn.deadline <= now:
                conn.timeout(now)
            if fd in conns:
                self.rearm(conn)
        for fd in list(self._writing):
            conn = conns.get(fd)
            if conn is not None and conn.stuck_at(now):
                conn.stuck()
