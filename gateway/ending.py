"""How a connection ends (gateway.connection): once, whatever ends it (a DISCONNECT, a
protocol error, a kick, a takeover, the socket, a shutdown): reading and the tasks
started for it stop at once; then, in a task shielded from a shutdown's cancellation,
the publishes it handed to the store are seen through, the client is told (v5
DISCONNECT with the reason), the will is published or scheduled, and the session is
detached (kept, or dropped with a clean one)."""

from __future__ import annotations

import logging

import trio

from gateway.broker import Broker
from gateway.delivery import Delivery
from gateway.mqtt.protocol import Closing, MqttProtocol, Refused
from gateway.output import Output, Poller
from gateway.session import Session

log = logging.getLogger("lightgate.gateway.conn")

STORE_DRAIN_S = 10.0  # at close, how long publishes already submitted may take to finish


class Ending:
    """The end of gateway.connection.Connection (a mixin: what it uses of the connection
    is declared here)."""

    __slots__ = ()  # the connection's own slots hold the state

    broker: Broker
    core: MqttProtocol
    out: Output
    peer: str
    session: Session | None
    delivery: Delivery | None
    reactor: Poller | None
    alive: bool
    _closed: bool
    _closing: Closing | None
    _scopes: set[trio.CancelScope] | None
    _held: int
    _taken_over: bool
    _detached: trio.Event | None
    native: int | None

    @property
    def deadline(self) -> float:
        return self.core.deadline

    def timeout(self, now: float) -> None:
        """A deadline passed (the reactor or the stream task checks): the keepalive or
        the CONNECT timeout ends the connection."""
        try:
            self.core.timeout(now)
        except Closing as closing:
            self.close(closing)

    def close(self, closing: Closing, nursery: trio.Nursery | None = None) -> None:
        """End the connection (once): stop reading and what runs for it; the rest (the
        DISCONNECT, the will, the session) in a task (in `nursery`: a shutdown's)."""
        if self._closed:
            return
        if self.native is not None and self.broker.handover is not None:
            # The engine has the socket: closed once it is back (gateway.handover).
            self.broker.handover.release(self, closing, nursery)
            return
        self._closed = True
        self.alive = False
        self._closing = closing
        if isinstance(closing, Refused):
            # Every refusal is logged with its reason: an operator cannot tell one from
            # the client's side (a bridge's will refused by a policy looked like a
            # network fault).
            cid = self.core.connect_id
            who = "?" if cid is None else repr(cid)
            log.info("connect of %s from %s refused: %s", who, self.peer, closing)
        if self._scopes:
            for scope in self._scopes:
                scope.cancel()
        if self.reactor is not None:
            self.reactor.forget(self)
        if self.delivery is not None:
            self.delivery.stop()
        try:
            (nursery or self.broker.connection_nursery).start_soon(self._ending)
        except RuntimeError:  # the gateway is gone already
            pass

    async def _finish(self) -> None:
        closing = self._closing
        assert closing is not None
        core, broker = self.core, self.broker
        broker.read_budget.update(self._held, 0)
        self._held = 0
        s = self.session
        if s is not None:
            with trio.move_on_after(STORE_DRAIN_S):
                await broker.inbound.drained(self)
        if s is None and not isinstance(closing, Refused):
            log.info("connection from %s ended before CONNACK: %s", self.peer, closing)
        data = core.close(closing) if not self._taken_over else b""
        self.out.write(core.data_to_send() + data)
        await self.out.last_words()
        if s is not None and self.delivery is not None:
            # Before the output is dropped: what the socket never took is known only now.
            self.delivery.rewind_unsent()
        # Told, the client is let go now, whatever the session's end costs (with the
        # store away, a session's write waits for its timeout): it may connect again,
        # elsewhere. A takeover waits for `detached`, set however that ends.
        await self.out.close()
        try:
            if s is not None:
                log.info("client %r (%s) disconnected: %s", s.client_id, self.peer,
                         closing)
                broker.stats.connections -= 1
                if self.delivery is not None:
                    self.delivery.give_back_shared()
                if s.persistent:
                    core.unalias_outgoing()
                will, s.will = s.will, None
                if will is not None and closing.will:
                    broker.schedule_will(s, will)
                if s.connection is self:
                    await broker.session_detached(s)
        finally:
            if self._detached is None:
                self._detached = trio.Event()
            self._detached.set()



    async def _ending(self) -> None:
        """`_finish`, shielded: a shutdown cancels everything else, not a goodbye."""
        with trio.CancelScope(shield=True):
            try:
                await self._finish()
            except Exception:  # noqa: BLE001 - the connection is gone either way
                log.exception("closing the connection from %s failed", self.peer)
