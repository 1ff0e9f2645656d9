"""What a connection sends of its own accord, as part of the MQTT rules
(gateway.mqtt.protocol): deliveries encoded for this client (Message Expiry, topic
aliases, subscription identifiers, its Maximum Packet Size), packet ids, the client's
Receive Maximum, the acks of our QoS 1/2 sends (PUBACK, PUBREC/PUBREL/PUBCOMP) and
resends with DUP when a session resumes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import reason as rc
from .codec import Decoder, PublishTemplate, encode, encode_publish
from .events import ALIAS, Flows, Handout, Limits, Outgoing, OutgoingDone, OutgoingReleased, Stored
from .packets import Publish, Pubrec, Pubrel
from .properties import publish_properties


class Outbound:
    """The sending part of MqttProtocol (a mixin: the state it uses is the protocol's,
    declared here)."""

    __slots__ = ()

    limits: Limits
    version: int
    flows: Flows | None
    receive_maximum: int
    client_max_packet: int
    alias_out_max: int
    _aliases_out: dict[str, int] | None
    _out: list[bytes]
    _out_bytes: int

    if TYPE_CHECKING:
        def _send(self, data: bytes) -> None: ...  # the protocol's

    @property
    def window(self) -> int:
        """How many more QoS 1/2 sends the client takes now."""
        return min(self.receive_maximum, self.limits.max_inflight) - self.flows.in_flight()

    def _on_ack(self, pid: int, qos: int) -> OutgoingDone | None:
        o = self.flows.outgoing.get(pid)
        if o is None or o.qos != qos or (qos == 2 and o.state != "pubrel"):
            return None  # unknown: late, or a duplicate; nothing to do
        del self.flows.outgoing[pid]
        return OutgoingDone(o)

    def _on_pubrec(self, p: Pubrec) -> OutgoingDone | OutgoingReleased | None:
        o = self.flows.outgoing.get(p.packet_id)
        if o is None or o.qos != 2:
            code = rc.PACKET_IDENTIFIER_NOT_FOUND if self.version == 5 else 0
            self._send(encode(Pubrel(p.packet_id, code), self.version))
            return None
        if p.reason_code >= 0x80:  # v5: the receiver refused it; the exchange ends here
            del self.flows.outgoing[p.packet_id]
            return OutgoingDone(o)
        o.state = "pubrel"
        if self.flows.persistent and o.queue is not None:
            # A client that got PUBREL may complete the exchange and forget the packet
            # id: were the state still "publish" in the store, a restart would resend
            # the PUBLISH, a new message to it. The owner keeps the state, then releases.
            return OutgoingReleased(o, held=True)
        self._send(encode(Pubrel(p.packet_id), self.version))
        return OutgoingReleased(o)

    def release(self, o: Outgoing) -> None:
        """PUBREL for a held OutgoingReleased, once its state is kept (unless the
        exchange ended meanwhile)."""
        if self.flows.outgoing.get(o.packet_id) is o:
            self._send(encode(Pubrel(o.packet_id), self.version))

    def deliver(self, msg: Stored, qos: int, retain: bool, sids: list[int] | None,
                queue: str | None, offset: int, group: Handout | None = None,
                template: PublishTemplate | None = None, now_s: float = 0.0,
                buffer: list[bytes] | None = None) -> Outgoing | bool:
        """Send a stored message at `qos` (the caller checked `window` for QoS 1/2).
        Returns the Outgoing taken for it (QoS 1/2), True (QoS 0 sent), or False when
        it must be dropped (expired, or larger than the client takes). `template`: the
        message encoded once for many subscribers; `now_s`: wall-clock seconds, for
        Message Expiry; `buffer`: where the bytes go (default: the outbox)."""
        pid = None
        if qos:
            pid = self._packet_id()
        data = self._encode(msg, pid, qos, retain, sids, template, now_s)
        if data is None:
            return False
        (self._out if buffer is None else buffer).append(data)
        if buffer is None:
            self._out_bytes += len(data)
        if pid is None:
            return True
        o = Outgoing(pid, queue, offset, data, qos, group=group, message=msg,
                     version=self.version)
        self.flows.outgoing[pid] = o
        return o

    def send_encoded(self, data: bytes) -> None:
        """A delivery encoded into a `buffer` of `deliver` goes out now."""
        self._send(data)

    def _packet_id(self) -> int:
        s = self.flows
        outgoing = s.outgoing
        for _ in range(65535):
            pid = s.next_packet_id
            s.next_packet_id = pid % 65535 + 1
            if pid not in outgoing:
                return pid
        raise RuntimeError("no free packet id")  # the window prevents this

    def _encode(self, msg: Stored, pid: int | None, qos: int, retain: bool,
                sids: list[int] | None, template: PublishTemplate | None,
                now_s: float) -> bytes | None:
        v = self.version
        props = None
        if v == 5:
            expiry = msg.properties.get("message_expiry_interval")
            if expiry is not None:
                left = expiry - int(now_s - msg.store_ts / 1000)
                if left <= 0:
                    return None  # expired messages are not delivered
                props = dict(publish_properties(msg.properties), message_expiry_interval=left)
            elif self.alias_out_max:
                props = dict(publish_properties(msg.properties))
        if props is None:
            if template is not None:
                data = template.for_subscriber(pid, False, version=v, qos=qos, retain=retain,
                                               subscription_ids=sids)
            else:
                if msg.qos not in (0, 1, 2):  # as the template checks: a bad record
                    raise ValueError(f"stored message has QoS {msg.qos}")
                p5 = None
                if v == 5:
                    p5 = publish_properties(msg.properties)
                    if sids:
                        p5 = dict(p5, subscription_identifier=sids)
                data = encode_publish(msg.topic, msg.body, qos, retain, False, pid, v,
                                      p5 or None)
            return data if len(data) <= self.client_max_packet else None
        return self._encode_aliased(msg, pid, qos, retain, sids, props)

    def _encode_aliased(self, msg: Stored, pid: int | None, qos: int, retain: bool,
                        sids: list[int] | None, props: dict[str, Any]) -> bytes | None:
        topic, new_alias = msg.topic, False
        if self.alias_out_max:
            # On QoS 1/2 too: what is in flight when this connection ends loses its alias
            # (`unalias_outgoing`), as a resend on another connection must carry the topic.
            if self._aliases_out is None:
                self._aliases_out = {}
            alias = self._aliases_out.get(topic)
            if alias is None and len(self._aliases_out) < self.alias_out_max:
                alias = self._aliases_out[topic] = len(self._aliases_out) + 1
                props[ALIAS] = alias  # first use: topic and alias together
                new_alias = True
            elif alias is not None:
                props[ALIAS] = alias
                topic = ""  # later uses: the alias alone
        if sids:
            props["subscription_identifier"] = sids
        data = encode_publish(topic, msg.body, qos, retain, False, pid, 5, props)
        if len(data) > self.client_max_packet:
            if new_alias:  # the client never sees the packet that would have told it
                assert self._aliases_out is not None
                del self._aliases_out[msg.topic]
            return None
        return data

    def resend(self, o: Outgoing, template: PublishTemplate | None = None) -> None:
        """Send again what the session had in flight (a resumed session): PUBREL for one
        awaiting PUBCOMP, else the PUBLISH with DUP, re-encoded for this connection's
        protocol version if the session came back on another."""
        if o.state == "pubrel":
            self._send(encode(Pubrel(o.packet_id), self.version))
            return
        if o.version != self.version and o.message is not None:
            tpl = template or PublishTemplate(o.message.topic, o.message.body, o.message.qos,
                                              False, publish_properties(o.message.properties))
            o.data = tpl.for_subscriber(o.packet_id, False, version=self.version, qos=o.qos,
                                        retain=False)
            o.version = self.version
        self._send(bytes([o.data[0] | 0x08]) + o.data[1:])

    def unalias_outgoing(self) -> None:
        """The Topic Alias mapping belongs to one network connection (MQTT 5 §3.3.2.3.4):
        what this one sent and may be resent on the next carries its topic name."""
        if not self._aliases_out or self.flows is None:
            return
        for o in self.flows.outgoing.values():
            if o.version == 5 and o.message is not None and o.state == "publish":
                [p] = Decoder(server=False, version=5).feed(o.data)
                if ALIAS in p.properties:
                    props = {k: val for k, val in p.properties.items() if k != ALIAS}
                    o.data = encode(Publish(o.message.topic, p.payload, p.qos, p.retain,
                                            False, p.packet_id, props), 5)
