"""A session as a member of its shared groups (gateway.shared): a group's message
delivered to it through the connection's delivery (gateway.delivery), and what it
hands back when its connection ends."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from gateway.mqtt import protocol as mp
from gateway.output import Output
from gateway.session import Session
from gateway.shared import SharedGroup
from store.api import Message


class Client(Protocol):
    """The connection, as a member's deliveries see it (gateway.connection.Connection)."""

    alive: bool
    checks_delivery: bool
    asks_hook: bool
    out: Output

    def may(self, action: str, name: str, is_filter: bool = False) -> bool: ...


class SharedMember:
    """The shared-subscription part of gateway.delivery.Delivery (a mixin: what it uses
    of the delivery is declared here)."""

    __slots__ = ()  # the delivery's own slots hold the state

    conn: Client
    core: mp.MqttProtocol
    session: Session

    if TYPE_CHECKING:
        async def _hook_refuses(self, topic: str) -> bool: ...
        async def _push(self, msg: Message, qos: int, retain: bool, sids: list[int] | None,
                        queue: str | None, offset: int, group: SharedGroup | None = None
                        ) -> bool: ...

    def has_window(self) -> bool:
        return self.conn.alive and self.core.window > 0 and not self.conn.out.over

    async def push_shared(self, group: SharedGroup, msg: Message) -> bool:
        """Deliver a message of a shared subscription this client is a member of."""
        s, conn = self.session, self.conn
        sub = s.subscriptions.get(group.name)
        if sub is None or not conn.alive:
            return False
        qos = min(msg.qos, sub.options.qos)
        sids = [sub.subscription_id] if sub.subscription_id and self.core.version == 5 \
            else None
        offset = msg.offset_in(group.queue)
        if conn.checks_delivery and not conn.may("SUB", msg.topic) \
                or conn.asks_hook and await self._hook_refuses(msg.topic):
            group.acked(offset)  # not for this member's user: dropped, logged in audit
            return True
        if qos and self.core.window <= 0:
            return False
        sent = await self._push(msg, qos, False, sids, None, offset, group)
        if qos == 0 or not sent:
            group.acked(offset)  # at most once: done when written (or dropped)
        return True

    def give_back_shared(self) -> None:
        """Shared-subscription messages this client did not acknowledge: a QoS 1 one goes
        to another member. A QoS 2 one stays with this session, to be completed when it
        reconnects [MQTT-4.8.2-4], and if the session ends here, no other member gets it
        [MQTT-4.8.2-5] (it may have been delivered already: exactly once comes first)."""
        s = self.session
        for pid, o in list(s.outgoing.items()):
            if o.group is None:
                continue
            if o.qos == 2:
                if not s.persistent:
                    del s.outgoing[pid]
                    o.group.acked(o.offset)
                continue
            del s.outgoing[pid]
            o.group.take_back(o.message)
