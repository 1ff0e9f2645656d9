"""The MQTT rules of a connection (gateway.mqtt.protocol), bytes in and bytes out: no
socket, no task, no store. Each test plays the client with our codec and the gateway's
part by answering the core's events, and reads what the core has to send."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gateway import mqtt
from gateway.mqtt import protocol as mp
from gateway.mqtt import reason as rc
from tests.gateway.core_state import Flows, Stored

LIMITS = mp.Limits(max_packet_size=4096, max_connect_packet=1024, topic_alias_maximum=2,
                   max_inflight=3, receive_maximum=4, max_keepalive=0, connect_timeout=5.0)


class Client:
    """One connection: the core, and a decoder of what it sends."""

    def __init__(self, version: int = 5, limits: mp.Limits = LIMITS) -> None:
        self.core = mp.MqttProtocol(limits, 0.0)
        self.version = version
        self.dec = mqtt.Decoder(server=False, version=version, max_packet_size=1 << 20)
        self.flows = Flows()
        self.now = 0.0

    def send(self, *packets: Any) -> list[Any]:
        data = b"".join(mqtt.encode(p, self.version) for p in packets)
        return self.core.receive(data, self.now)

    def got(self) -> list[Any]:
        return self.dec.feed(self.core.data_to_send())

    def connect(self, **kw: Any) -> list[Any]:
        kw.setdefault("client_id", "dev")
        [ev] = self.send(mqtt.Connect(protocol_level=self.version, **kw))
        assert isinstance(ev, mp.ConnectReceived)
        self.flows.client_id, self.flows.expiry = ev.client_id, ev.expiry
        self.flows.persistent = ev.expiry > 0
        return self.core.accept(self.flows, ev.client_id, False, self.now)


# -- CONNECT ------------------------------------------------------------------------------
def test_connack_states_the_servers_limits_and_takes_the_clients() -> None:
    c = Client()
    c.connect(properties={"receive_maximum": 2, "maximum_packet_size": 200,
                          "topic_alias_maximum": 3, "session_expiry_interval": 30})
    [ack] = c.got()
    assert isinstance(ack, mqtt.Connack) and ack.reason_code == 0
    assert ack.properties["receive_maximum"] == 4
    assert ack.properties["maximum_packet_size"] == 4096
    assert ack.properties["topic_alias_maximum"] == 2
    assert c.core.receive_maximum == 2 and c.core.client_max_packet == 200
    assert c.core.alias_out_max == 3 and c.flows.expiry == 30


def test_a_server_keepalive_caps_the_clients() -> None:
    c = Client(limits=mp.Limits(max_keepalive=30))
    c.connect(keepalive=0)
    [ack] = c.got()
    assert ack.properties["server_keep_alive"] == 30 and c.core.keepalive == 30


def test_an_assigned_client_id_is_told() -> None:
    c = Client()
    [ev] = c.send(mqtt.Connect(client_id="", protocol_level=5))
    assert ev.client_id == ""
    c.core.accept(c.flows, "lg-given", False, 0.0, assigned=True)
    [ack] = c.got()
    assert ack.properties["assigned_client_identifier"] == "lg-given"


def test_v311_empty_client_id_with_a_persistent_session_is_refused_with_code_2() -> None:
    c = Client(version=4)
    [ev] = c.send(mqtt.Connect(client_id="", protocol_level=4, clean_start=False))
    assert isinstance(ev, mp.Closed) and isinstance(ev.closing, mp.Refused)
    [ack] = c.got()
    assert ack.return_code == 2


def test_the_first_packet_must_be_connect() -> None:
    c = Client()
    with pytest.raises(mp.Refused, match="first packet must be CONNECT"):
        c.send(mqtt.Pingreq())


def test_refusals_are_a_connack_in_the_clients_version() -> None:
    for version, code in ((5, rc.NOT_AUTHORIZED), (4, 5)):
        c = Client(version=version)
        c.send(mqtt.Connect(client_id="x", protocol_level=version))
        refused = c.core.refuse(rc.NOT_AUTHORIZED, 5, "not authorized")
        assert isinstance(refused, mp.Refused)
        [ack] = c.got()
        assert ack.reason_code == code


def test_packets_behind_a_connect_wait_for_its_acceptance() -> None:
    c = Client()
    events = c.send(mqtt.Connect(client_id="x", protocol_level=5),
                    mqtt.Publish("a/b", b"1", qos=1, packet_id=7), mqtt.Pingreq())
    assert [type(e) for e in events] == [mp.ConnectReceived]
    held = c.core.accept(c.flows, "x", False, 0.0)
    assert [type(e) for e in held] == [mp.PublishReceived]
    pub = held[0]
    c.core.publish_done(pub.packet, pub.ticket, 0)
    assert [type(p) for p in c.got()] == [mqtt.Connack, mqtt.Puback, mqtt.Pingresp]


def test_a_malformed_packet_after_a_connect_ends_it_after_the_connack() -> None:
    c = Client()
    data = mqtt.encode(mqtt.Connect(client_id="x", protocol_level=5), 5) + b"\x30\xff\xff"
    events = c.core.receive(data + b"\xff\xff\x01", 0.0)
    assert [type(e) for e in events] == [mp.ConnectReceived, mp.DecodeError]
    c.core.accept(c.flows, "x", False, 0.0)
    closing = c.core.protocol_error(events[1].error)
    assert not isinstance(closing, mp.Refused) and closing.reason_code == rc.MALFORMED_PACKET
    [ack] = c.got()
    assert isinstance(ack, mqtt.Connack) and ack.reason_code == 0
    [bye] = c.dec.feed(c.core.close(closing))
    assert isinstance(bye, mqtt.Disconnect) and bye.reason_code == rc.MALFORMED_PACKET


# -- inbound publishes --------------------------------------------------------------------
def test_acks_go_in_the_order_of_the_publishes() -> None:
    c = Client()
    c.connect()
    c.got()
    a, b = c.send(mqtt.Publish("t", b"a", qos=1, packet_id=1),
                  mqtt.Publish("t", b"b", qos=1, packet_id=2))
    c.send(mqtt.Pingreq())
    c.core.publish_done(b.packet, b.ticket, 0)
    assert c.got() == []  # b's ack waits for a's, the PINGRESP for both
    c.core.publish_done(a.packet, a.ticket, 0)
    got = c.got()
    assert [type(p) for p in got] == [mqtt.Puback, mqtt.Puback, mqtt.Pingresp]
    assert [p.packet_id for p in got[:2]] == [1, 2]


def test_a_refused_publish_is_told_in_v5_and_acked_plainly_in_v311() -> None:
    for version, code in ((5, rc.NOT_AUTHORIZED), (4, 0)):
        c = Client(version=version)
        c.connect()
        c.got()
        [ev] = c.send(mqtt.Publish("t", b"x", qos=1, packet_id=3))
        c.core.publish_done(ev.packet, ev.ticket, rc.NOT_AUTHORIZED)
        [ack] = c.got()
        assert isinstance(ack, mqtt.Puback) and ack.reason_code == code


def test_qos2_exchange_and_its_duplicate() -> None:
    c = Client()
    c.connect()
    c.got()
    [ev] = c.send(mqtt.Publish("t", b"x", qos=2, packet_id=5))
    assert 5 in c.flows.incoming_qos2  # a resend meanwhile is a duplicate
    assert c.send(mqtt.Publish("t", b"x", qos=2, packet_id=5, dup=True)) == []
    c.core.publish_done(ev.packet, ev.ticket, 0)
    assert [type(p) for p in c.got()] == [mqtt.Pubrec, mqtt.Pubrec]
    [rel] = c.send(mqtt.Pubrel(5))
    assert isinstance(rel, mp.PubrelReceived) and 5 not in c.flows.incoming_qos2
    c.core.release_done(5, rel.ticket)
    [comp] = c.got()
    assert isinstance(comp, mqtt.Pubcomp) and comp.reason_code == 0
    assert c.send(mqtt.Pubrel(5)) == []  # unknown now: PUBCOMP 0x92
    [comp] = c.got()
    assert comp.reason_code == rc.PACKET_IDENTIFIER_NOT_FOUND
    assert c.core._inbound_unacked == 0


def test_more_unacknowledged_publishes_than_our_receive_maximum_end_the_connection() -> None:
    c = Client()
    c.connect()
    events = c.send(*(mqtt.Publish("t", b"x", qos=1, packet_id=i) for i in range(1, 7)))
    assert len([e for e in events if isinstance(e, mp.PublishReceived)]) == 4
    assert isinstance(events[-1], mp.Closed)
    assert events[-1].closing.reason_code == rc.RECEIVE_MAXIMUM_EXCEEDED


def test_handed_back_bytes_count_what_the_native_side_had_not_acknowledged() -> None:
    c = Client()
    c.connect()
    c.got()
    with c.core.read_behind(3):  # our Receive Maximum is 4: one more fits, not two
        events = c.send(*(mqtt.Publish("t", b"x", qos=1, packet_id=i) for i in (4, 5)))
    assert [type(e) for e in events] == [mp.PublishReceived, mp.Closed]
    assert events[-1].closing.reason_code == rc.RECEIVE_MAXIMUM_EXCEEDED
    c = Client()
    c.connect()
    with c.core.read_behind(3):
        [ev] = c.send(mqtt.Publish("t", b"x", qos=1, packet_id=4))
    assert c.core._inbound_unacked == 1, "the three were acknowledged elsewhere"
    c.core.publish_done(ev.packet, ev.ticket, 0)
    assert c.core._inbound_unacked == 0


def test_topic_aliases_in() -> None:
    c = Client()
    c.connect()
    [a] = c.send(mqtt.Publish("long/topic", b"1", properties={"topic_alias": 1}))
    [b] = c.send(mqtt.Publish("", b"2", properties={"topic_alias": 1}))
    assert a.topic == b.topic == "long/topic"
    [bad] = c.send(mqtt.Publish("", b"3", properties={"topic_alias": 2}))
    assert isinstance(bad, mp.Closed) and bad.closing.reason_code == rc.PROTOCOL_ERROR
    c2 = Client()
    c2.connect()
    [over] = c2.send(mqtt.Publish("t", b"3", properties={"topic_alias": 3}))
    assert over.closing.reason_code == rc.TOPIC_ALIAS_INVALID


def test_a_payload_not_utf8_as_its_format_says_is_refused() -> None:
    c = Client()
    c.connect()
    c.got()
    assert c.send(mqtt.Publish("t", b"\xff", qos=1, packet_id=1,
                               properties={"payload_format_indicator": 1})) == []
    [ack] = c.got()
    assert ack.reason_code == rc.PAYLOAD_FORMAT_INVALID


# -- outbound -----------------------------------------------------------------------------
def test_deliveries_take_packet_ids_within_the_window_and_acks_free_them() -> None:
    c = Client()
    c.connect(properties={"receive_maximum": 2})
    c.got()
    for i in range(2):
        assert isinstance(c.core.deliver(Stored("t", b"%d" % i), 1, False, None, "t", i),
                          mp.Outgoing)
    assert c.core.window == 0
    sent = c.got()
    assert [p.packet_id for p in sent] == [1, 2]
    [done] = c.send(mqtt.Puback(1))
    assert isinstance(done, mp.OutgoingDone) and done.outgoing.offset == 0
    assert c.core.window == 1
    assert c.send(mqtt.Puback(1)) == []  # unknown: nothing


def test_qos2_out_and_an_unknown_pubrec() -> None:
    c = Client()
    c.connect()
    c.got()
    c.core.deliver(Stored("t", b"x", qos=2), 2, False, None, "t", 0)
    [pub] = c.got()
    [rel] = c.send(mqtt.Pubrec(pub.packet_id))
    assert isinstance(rel, mp.OutgoingReleased)
    [pubrel] = c.got()
    assert isinstance(pubrel, mqtt.Pubrel)
    [done] = c.send(mqtt.Pubcomp(pub.packet_id))
    assert isinstance(done, mp.OutgoingDone)
    c.send(mqtt.Pubrec(99))
    [reply] = c.got()
    assert isinstance(reply, mqtt.Pubrel) and reply.reason_code == rc.PACKET_IDENTIFIER_NOT_FOUND


def test_a_persistent_sessions_pubrel_waits_for_its_state_to_be_kept() -> None:
    """Once a client has PUBREL it may complete and forget the exchange: the owner keeps
    the "pubrel" state first (a restart resends PUBREL, not the PUBLISH), then releases."""
    c = Client()
    c.connect(properties={"session_expiry_interval": 60})
    c.got()
    c.core.deliver(Stored("t", b"x", qos=2), 2, False, None, "t", 0)
    [pub] = c.got()
    [rel] = c.send(mqtt.Pubrec(pub.packet_id))
    assert isinstance(rel, mp.OutgoingReleased) and rel.held
    assert rel.outgoing.state == "pubrel" and c.got() == []
    c.core.release(rel.outgoing)
    [pubrel] = c.got()
    assert isinstance(pubrel, mqtt.Pubrel) and pubrel.packet_id == pub.packet_id


def test_too_large_or_expired_messages_are_dropped() -> None:
    c = Client()
    c.connect(properties={"maximum_packet_size": 64})
    c.got()
    assert c.core.deliver(Stored("t", b"x" * 100), 0, False, None, "t", 0) is False
    old = Stored("t", b"x", properties={"message_expiry_interval": 5}, store_ts=1000)
    assert c.core.deliver(old, 0, False, None, "t", 0, now_s=10.0) is False
    fresh = Stored("t", b"x", properties={"message_expiry_interval": 5}, store_ts=8000)
    assert c.core.deliver(fresh, 0, False, None, "t", 0, now_s=10.0) is True
    [p] = c.got()
    assert p.properties["message_expiry_interval"] == 3


def test_topic_aliases_out() -> None:
    c = Client()
    c.connect(properties={"topic_alias_maximum": 1})
    c.got()
    for topic in ("a/long/topic", "a/long/topic", "other"):
        c.core.deliver(Stored(topic, b"x", qos=0), 0, False, None, topic, 0)
    first, second, other = c.got()
    assert first.topic == "a/long/topic" and first.properties["topic_alias"] == 1
    assert second.topic == "" and second.properties["topic_alias"] == 1
    assert other.topic == "other" and "topic_alias" not in other.properties


def test_a_resend_carries_dup() -> None:
    c = Client()
    c.connect()
    c.got()
    o = c.core.deliver(Stored("t", b"x"), 1, False, None, "t", 0)
    c.got()
    assert isinstance(o, mp.Outgoing)
    c.core.resend(o)
    [again] = c.got()
    assert again.dup and again.packet_id == o.packet_id


# -- timers and the end ---------------------------------------------------------------------
def test_keepalive_connect_and_credential_deadlines() -> None:
    c = Client()
    with pytest.raises(mp.Refused, match="no CONNECT in time"):
        c.core.timeout(5.0)
    c = Client()
    c.connect(keepalive=10)
    assert c.core.deadline == 15.0
    c.core.receive(mqtt.encode(mqtt.Pingreq(), 5), 12.0)
    assert c.core.deadline == 27.0
    c.core.timeout(26.0)
    with pytest.raises(mp.Closing) as late:
        c.core.timeout(27.0)
    assert late.value.reason_code == rc.KEEP_ALIVE_TIMEOUT
    c.core.set_expiry(20.0)
    with pytest.raises(mp.Closing) as expired:
        c.core.timeout(20.0)
    assert expired.value.reason_code == rc.MAXIMUM_CONNECT_TIME


def test_disconnect_rules() -> None:
    c = Client()
    c.connect()
    [ev] = c.send(mqtt.Disconnect(rc.DISCONNECT_WITH_WILL_MESSAGE))
    assert isinstance(ev, mp.Closed) and ev.closing.will
    c = Client()
    c.connect()
    [ev] = c.send(mqtt.Disconnect(properties={"session_expiry_interval": 60}))
    assert ev.closing.reason_code == rc.PROTOCOL_ERROR  # 0 at CONNECT: not on DISCONNECT
    assert c.send(mqtt.Pingreq()) == []  # nothing more is read once it ends


def test_reason_strings_keep_within_the_clients_packet_size_or_go() -> None:
    c = Client()
    c.connect(properties={"maximum_packet_size": 30})
    assert c.core.reason("a reason that would not fit") == {"reason_string": "a reason that "}
    c = Client()
    c.connect(properties={"maximum_packet_size": 20})
    assert c.core.reason("a reason that would not fit") == {}  # 4 bytes: nothing useful
    c = Client()
    c.connect(properties={"request_problem_information": 0})
    assert c.core.reason("no problem information asked") == {}


# -- a state machine against the spec's rules -------------------------------------------------
class InboundFlows(RuleBasedStateMachine):
    """Random QoS 1/2 publishes, PUBRELs and pings from a client, the store answering in
    random order: every answer goes back in the order of the packets it answers, each
    QoS 1 publish gets one PUBACK, each QoS 2 packet id one PUBREC per PUBLISH (a
    duplicate too) and one PUBCOMP per PUBREL; Receive Maximum is never exceeded."""

    def __init__(self) -> None:
        super().__init__()
        self.c = Client()
        self.c.connect()
        self.c.got()
        self.expected: list[tuple[type, int]] = []  # answers, in arrival order
        self.undecided: list[mp.PublishReceived] = []
        self.unreleased: set[int] = set()  # QoS 2 ids PUBREC'd, PUBREL not sent yet
        self.received: list[tuple[type, int]] = []

    def _room(self) -> bool:
        return self.c.core._inbound_unacked < LIMITS.receive_maximum

    @precondition(lambda self: self._room())
    @rule(pid=st.integers(1, 20))
    def publish_qos1(self, pid: int) -> None:
        [ev] = self.c.send(mqtt.Publish("t", b"x", qos=1, packet_id=pid))
        self.undecided.append(ev)
        self.expected.append((mqtt.Puback, pid))

    @precondition(lambda self: self._room())
    @rule(pid=st.integers(21, 30))
    def publish_qos2(self, pid: int) -> None:
        events = self.c.send(mqtt.Publish("t", b"x", qos=2, packet_id=pid))
        self.expected.append((mqtt.Pubrec, pid))
        if events:
            self.undecided.extend(events)
        self.unreleased.add(pid)

    @rule()
    def ping(self) -> None:
        self.c.send(mqtt.Pingreq())
        self.expected.append((mqtt.Pingresp, 0))

    @precondition(lambda self: bool(self.undecided))
    @rule(data=st.data())
    def store_answers(self, data: st.DataObject) -> None:
        ev = self.undecided.pop(data.draw(st.integers(0, len(self.undecided) - 1)))
        self.c.core.publish_done(ev.packet, ev.ticket, 0)

    @precondition(lambda self: bool(self.unreleased) and not self.undecided)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        pid = data.draw(st.sampled_from(sorted(self.unreleased)))
        self.unreleased.discard(pid)
        events = self.c.send(mqtt.Pubrel(pid))
        self.expected.append((mqtt.Pubcomp, pid))
        for ev in events:
            self.c.core.release_done(ev.packet_id, ev.ticket)

    @invariant()
    def answers_in_order(self) -> None:
        self.received += [(type(p), getattr(p, "packet_id", 0) or 0) for p in self.c.got()]
        assert self.received == self.expected[: len(self.received)]
        assert 0 <= self.c.core._inbound_unacked <= LIMITS.receive_maximum


TestInboundFlows = InboundFlows.TestCase
TestInboundFlows.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
