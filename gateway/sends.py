"""Our QoS 1/2 sends, as the connection (gateway.connection) sees them through: a
PUBREL once its state is kept (a persistent session's), and a send the client completed
(PUBACK, PUBCOMP): its in-flight record goes, its window slot is free again."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio

from gateway.broker import Broker
from gateway.delivery import PAUSE_S, Delivery
from gateway.mqtt import protocol as mp
from gateway.mqtt.protocol import MqttProtocol
from gateway.session import Session
from store.api import StoreError


class SendRules:
    """The part of gateway.connection.Connection that sees our sends through (a mixin:
    what it uses of the connection is declared here)."""

    __slots__ = ()  # the connection's own slots hold the state

    broker: Broker
    core: MqttProtocol
    session: Session | None
    delivery: Delivery | None

    if TYPE_CHECKING:  # the connection's own, used here
        def flush(self) -> None: ...
        def spawn(self, fn: Any, *args: Any) -> None: ...

    async def release_when_kept(self, o: mp.Outgoing, later: bool = False) -> None:
        """PUBREL once the released state is in the store. While the store refuses it
        (a full disk), a task of its own tries again, and the client is read meanwhile."""
        s = self.session
        assert s is not None
        while s.outgoing.get(o.packet_id) is o:
            try:
                await self.broker.persist_outgoing(s, o)
            except StoreError as exc:
                if self.delivery is not None:
                    self.delivery.paused(exc)
                if not later:
                    self.spawn(self.release_when_kept, o, True)
                    return
                await trio.sleep(PAUSE_S)
                continue
            self.core.release(o)
            if later:
                self.flush()
            return

    def _on_outgoing_done(self, o: mp.Outgoing) -> bool:
        s = self.session
        assert s is not None
        if o.group is None and s.persistent and o.queue is not None:
            return False  # its in-flight record goes: the lane's
        if o.group is not None:
            o.group.acked(o.offset)
        self._freed(s)
        return True

    async def _complete(self, *done: mp.Outgoing) -> None:
        s = self.session
        assert s is not None
        await self.broker.forget_outgoing(s, *done)
        self._freed(s)

    def _freed(self, s: Session) -> None:
        for group in s.groups:
            group.wake()  # this member has room again
        if self.delivery is not None:
            self.delivery.window_freed()
