"""A client's PUBLISH, as the connection (gateway.connection) decides it: rate limits,
reserved topics, rights, topic and retained limits, a persistent session's resent
QoS 2; then staged for the next append across connections (gateway.inbound), whose
answer (`stored`) the protocol core turns into the ack."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import trio

from gateway.broker import Broker
from gateway.handover import MAX_TOPICS
from gateway.inbound import Inbound
from gateway.limits import PublishLimits
from gateway.mqtt import Publish
from gateway.mqtt import protocol as mp
from gateway.mqtt import reason as rc
from gateway.mqtt.protocol import Closing, MqttProtocol
from gateway.reserved import refusal as reserved_refusal
from gateway.retained import stored_size
from gateway.session import Session, qos2_key
from store.api import Message

log = logging.getLogger("lightgate.gateway.conn")


class PublishRules:
    """The PUBLISH part of gateway.connection.Connection (a mixin: what it uses of the
    connection is declared here)."""

    __slots__ = ()  # the connection's own slots hold the state

    broker: Broker
    core: MqttProtocol
    peer: str
    session: Session | None
    _ask_hook: bool
    _limits: PublishLimits | None
    _closed: bool
    native_topics: set[str] | None  # what it may publish to natively (gateway.handover)

    if TYPE_CHECKING:  # the connection's own, used here
        def may(self, action: str, name: str, is_filter: bool = False) -> bool: ...
        async def may_ask(self, action: str, name: str, is_filter: bool = False) -> bool: ...
        def close(self, closing: Closing, nursery: trio.Nursery | None = None) -> None: ...

    def _on_publish(self, ev: mp.PublishReceived) -> bool:
        """Check and stage a publish for the next append; False if the lane must (an
        HTTP hook's answer, a resent QoS 2 of a persistent session)."""
        p, topic, s = ev.packet, ev.topic, self.session
        assert s is not None
        if self._ask_hook or (p.qos == 2 and p.dup and s.persistent):
            return False
        self._count(p)
        why = self._publish_refusal(p, topic)
        if why is None and not self.may("PUB", topic):
            why = ("not authorized", rc.NOT_AUTHORIZED)
        if why is None:
            why = self._publish_limits(p, topic, s)
        if why is not None:
            self._refuse_publish(ev, topic, *why)
        else:
            self._stage(ev, topic, s)
        return True

    async def _on_publish_slow(self, ev: mp.PublishReceived) -> None:
        p, topic, s = ev.packet, ev.topic, self.session
        assert s is not None
        self._count(p)
        why = self._publish_refusal(p, topic)
        if why is None and not await self.may_ask("PUB", topic):
            why = ("not authorized", rc.NOT_AUTHORIZED)
        if why is None:
            why = self._publish_limits(p, topic, s)
        if why is not None:
            self._refuse_publish(ev, topic, *why)
            return
        if p.qos == 2 and p.dup and s.persistent:
            # A resend the session has no exchange for: stored already if a crash fell
            # between the append and the packet id's marker (the record carries the id).
            await self.broker.inbound.drained(self)
            phys = await self.broker.stored_qos2(s, p.packet_id)
            if phys is not None:
                log.info("client %r resent QoS 2 packet id %d stored before a restart: "
                         "not stored again", s.client_id, p.packet_id)
                await self.broker.remember_incoming_qos2(s, p.packet_id, False, phys)
                self.core.held_qos2(p, ev.ticket)
                return
        self._stage(ev, topic, s)

    def _count(self, p: Publish) -> None:
        stats = self.broker.stats
        stats.messages_in += 1
        stats.messages_in_qos[p.qos] += 1

    def _publish_refusal(self, p: Publish, topic: str) -> tuple[str, int] | None:
        """Rate limits (past them the connection ends) and reserved topics."""
        if self._limits is not None:
            over = self._limits.exceeded(len(p.payload))
            if over is not None:
                self.broker.stats.limit_refusals += 1
                log.warning("client %r at %s disconnected: %s", self.core.client_id,
                            self.peer, over)
                raise Closing(f"publish rate limit: {over}", True, rc.MESSAGE_RATE_TOO_HIGH)
        if topic.startswith("$"):
            # MQTT §4.7.2: the server's ($SYS statistics), but for bridges' state topics
            # and what the policies grant (gateway/reserved.py).
            why = reserved_refusal(topic, self.broker.auth.enabled)
            if why is not None:
                return why, rc.NOT_AUTHORIZED
        return None

    def _publish_limits(self, p: Publish, topic: str, s: Session) -> tuple[str, int] | None:
        b = self.broker
        if b.topic_past_limits(topic):
            b.stats.topic_refusals += 1
            return "past --max-topic-levels or --max-topic-length", rc.TOPIC_NAME_INVALID
        if p.retain and p.payload:
            why = b.retained.budget.admit(topic, s.client_id,
                                          stored_size(topic, p.payload, _props(p)))
            if why is not None:
                b.stats.limit_refusals += 1
                return why, rc.QUOTA_EXCEEDED
        return None

    def _refuse_publish(self, ev: mp.PublishReceived, topic: str, why: str, code: int
                        ) -> None:
        """Not stored: v5 PUBACK/PUBREC with `code`; 3.1.1 a plain ack (core)."""
        log.info("publish of %r on %r by %s %s: dropped", self.core.client_id, topic[:100],
                 self.peer, why)
        self.core.publish_done(ev.packet, ev.ticket, code)

    def _stage(self, ev: mp.PublishReceived, topic: str, s: Session) -> None:
        p = ev.packet
        if self.broker.handover is not None:
            # Allowed and within the limits: the native side's ACL cache (made on the
            # first publish: an idle connection holds none).
            topics = self.native_topics
            if topics is None:
                topics = self.native_topics = set()
            if len(topics) < MAX_TOPICS:
                topics.add(topic)
        msg = Message(topic, p.payload, p.qos, p.retain, s.client_id, _props(p),
                      born_ts=time.time_ns() // 1_000_000,
                      key=qos2_key(s.client_id, p.packet_id) if p.qos == 2 and s.persistent
                      else "")
        self.broker.inbound.stage(self, msg, p, ev.ticket)

    def stored(self, p: Publish, ticket: int, code: int, text: str = "") -> None:
        """The inbound pipeline's answer for a staged publish (gateway.inbound). It is
        answered even when the connection is ending (a malformed packet came after it,
        say): the close waits for the store's answers, and its ack goes out before the
        last words, so that the client does not send again what is stored."""
        if code and self.core.version < 5 and p.qos:
            # 3.1.1 has no negative ack: close so the client resends
            self.close(Closing(f"store error: {text}", will=True))
            return
        self.core.publish_done(p, ticket, code, text)



def _props(p: Publish) -> dict[str, Any]:
    """A publish's properties as stored: a topic alias belongs to the connection."""
    if not p.properties:
        return {}
    if "topic_alias" not in p.properties:
        return p.properties
    return {k: v for k, v in p.properties.items() if k != "topic_alias"}


__all__ = ["Inbound", "PublishRules"]
