"""A client's SUBSCRIBE and UNSUBSCRIBE, as the connection (gateway.connection)
carries them out: shared subscriptions, rights and limits per filter, a bridge's
options, the subscriptions in the store, and the retained messages after the SUBACK."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from gateway import mqtt, replay
from gateway.broker import Broker
from gateway.delivery import Delivery
from gateway.mqtt import protocol as mp
from gateway.mqtt import reason as rc
from gateway.mqtt.protocol import MqttProtocol
from gateway.session import Session, Subscription, parse_shared, subscription_key
from store.api import StoreError

log = logging.getLogger("lightgate.gateway.conn")


class SubscribeRules:
    """The SUBSCRIBE part of gateway.connection.Connection (a mixin: what it uses of the
    connection is declared here)."""

    __slots__ = ()  # the connection's own slots hold the state

    broker: Broker
    core: MqttProtocol
    config: object
    session: Session | None
    delivery: Delivery | None

    if TYPE_CHECKING:  # the connection's own, used here
        async def may_ask(self, action: str, name: str, is_filter: bool = False) -> bool: ...


    async def _on_subscribe(self, ev: mp.SubscribeReceived) -> None:
        s, core = self.session, self.core
        assert s is not None and self.delivery is not None
        codes: list[int] = []
        retained: list[Subscription] = []
        why: list[str] = []  # v5: the SUBACK's reason string
        cut: list[tuple[str, str]] = []  # v5: replays cut by retention (user properties)
        for topic_filter, opts in ev.packet.subscriptions:
            try:
                shared = parse_shared(topic_filter)
                replayed = replay.parse(topic_filter, shared)
            except ValueError as exc:
                codes.append(rc.TOPIC_FILTER_INVALID)
                why.append(f"{topic_filter}: {exc}")
                continue
            real = replayed[1] if replayed else shared[1] if shared else topic_filter
            refusal = await self._subscribe_refusal(s, topic_filter, real)
            if refusal is not None:
                codes.append(refusal)
                continue
            granted = min(opts.qos, self.config.max_qos)
            # A bridge's subscriptions, as Mosquitto and EMQX make them: what it sent is
            # not sent back (it would go round), retained messages stay retained.
            bridged = core.bridge and not shared
            opts = mqtt.SubscriptionOptions(granted, opts.no_local or bridged,
                                            opts.retain_as_published or bridged,
                                            opts.retain_handling)
            sub = Subscription(topic_filter, opts, ev.subscription_id, shared, replayed)
            try:
                if replayed:  # its history instead of retained messages
                    code, text, was_cut = await replay.subscribe(self.broker, s, sub)
                    if code:
                        codes.append(code)
                        why.append(f"{topic_filter}: {text}")
                        continue
                    if was_cut:
                        cut.append((replay.CUT, topic_filter))
                    codes.append(granted)
                    continue
                if not shared:
                    await replay.take_place(self.broker, s, sub)
                new = await self.broker.subscribe(s, sub)
            except StoreError as exc:
                log.warning("subscribe of %r to %r failed: %s", s.client_id, topic_filter, exc)
                codes.append(rc.UNSPECIFIED_ERROR)
                continue
            codes.append(granted)
            # Retained messages are not sent for shared subscriptions (MQTT 5 §4.8.2).
            if not shared and (opts.retain_handling == 0
                               or (opts.retain_handling == 1 and new)):
                retained.append(sub)
        then = await self.delivery.retained(retained) if retained else None
        core.subscribed(ev.packet.packet_id, ev.ticket, codes, then, "; ".join(why), cut)
        self.delivery.start()

    async def _subscribe_refusal(self, s: Session, topic_filter: str, real: str
                                 ) -> int | None:
        """A SUBACK failure code if this filter is not allowed (ACL or limit), else None.
        `real`: the filter it reads (a shared or replay subscription's own)."""
        if not await self.may_ask("SUB", real, is_filter=True):
            log.info("subscribe of %r to %r not authorized", s.client_id, topic_filter)
            return rc.NOT_AUTHORIZED
        b = self.broker
        if b.topic_past_limits(real):
            b.stats.topic_refusals += 1
            log.info("subscribe of %r to %r refused: past --max-topic-levels or "
                     "--max-topic-length", s.client_id, topic_filter[:100])
            return rc.TOPIC_FILTER_INVALID
        limit = self.config.max_subscriptions
        if limit and subscription_key(topic_filter) not in s.subscriptions \
                and len(s.subscriptions) >= limit:
            b.stats.limit_refusals += 1
            log.warning("subscribe of %r to %r refused: %d subscriptions (limit)",
                        s.client_id, topic_filter, len(s.subscriptions))
            return rc.QUOTA_EXCEEDED
        return None

    async def _on_unsubscribe(self, ev: mp.UnsubscribeReceived) -> None:
        s = self.session
        assert s is not None
        codes = []
        for topic_filter in ev.packet.filters:
            existed = await self.broker.unsubscribe(s, topic_filter)
            codes.append(rc.SUCCESS if existed else rc.NO_SUBSCRIPTION_EXISTED)
        self.core.unsubscribed(ev.packet.packet_id, ev.ticket, codes)
        if self.broker.handover is not None:  # what kept it in Python may have gone
            self.broker.handover.consider(self)  # type: ignore[arg-type]

