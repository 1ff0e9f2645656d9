"""Coverage-guided fuzzing (atheris/libFuzzer) of the MQTT connection rules, sans-IO.

    python tests/fuzz/fuzz_connection.py -runs=1000000 [-max_len=2048] [corpus_dir]

Each input is what one client sends on one connection: it is fed, in chunks split where
the input says, to `gateway.mqtt.protocol.MqttProtocol`, the rules a connection runs,
with no socket, task or store: a small driver here answers its events the way the
gateway's would (CONNECTs accepted under an assigned id, publishes stored, or refused
when their topic says so, subscriptions granted, and every stored publish delivered to
the client when it subscribed). The end of the input is the client's EOF. Any of these
is a bug:
- an exception other than the connection ending (Closing): it must turn anything a
  client sends into a reason code or a close;
- a byte it sent back that is not a valid server-to-client MQTT packet of its version;
- a refused client told anything but one failing CONNACK;
- its counts going wrong: negative unacknowledged publishes, answers waiting when none
  can be, more messages in flight than the client's window.

tests/fuzz/test_connection_sequences.py drives whole server processes with random
packet sequences; this one reaches the rules' corners at a few thousand inputs a second.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

with atheris.instrument_imports():
    from gateway import mqtt
    from gateway.mqtt import protocol as mp
    from gateway.mqtt.reason import ProtocolError

from tests.gateway.core_state import Flows, Stored  # noqa: E402

LIMITS = mp.Limits(max_packet_size=64 * 1024, max_connect_packet=4096, topic_alias_maximum=4,
                   max_inflight=4, receive_maximum=8, max_keepalive=60)


class Driver:
    """Answers the core's events as the gateway would, at once."""

    def __init__(self) -> None:
        self.core = mp.MqttProtocol(LIMITS, 0.0)
        self.flows = Flows()
        self.subscribed: dict[str, int] = {}
        self.out = bytearray()
        self.refused = False
        self.closed = False
        self.now = 0.0

    def feed(self, data: bytes) -> None:
        if self.closed:
            return
        self.now += 0.01
        try:
            events = self.core.receive(data, self.now)
        except mp.Closing as closing:
            self._end(closing)
            return
        self._answer(events)

    def _answer(self, events: list[Any]) -> None:
        core = self.core
        for ev in events:
            if self.closed:
                return
            t = type(ev)
            if t is mp.ConnectReceived:
                if ev.packet.client_id.startswith("refuse"):
                    self._end(core.refuse(0x87, 5, "refused by the fuzz driver"))
                    return
                self.flows.client_id = ev.client_id or "assigned"
                self.flows.expiry = ev.expiry
                self.flows.persistent = ev.expiry > 0
                held = core.accept(self.flows, self.flows.client_id, False, self.now,
                                   assigned=not ev.client_id)
                self._answer(held)
            elif t is mp.AuthReceived:
                if ev.reauth:
                    core.reauth_done(None)
                else:
                    self._end(core.refuse(0x86, 4, "no enhanced auth here"))
                    return
            elif t is mp.PublishReceived:
                code = 0x87 if ev.topic.startswith("$") else 0
                core.publish_done(ev.packet, ev.ticket, code)
                if not code:
                    self._deliver(ev.topic, ev.packet)
            elif t is mp.PubrelReceived:
                core.release_done(ev.packet_id, ev.ticket)
            elif t is mp.SubscribeReceived:
                codes = []
                for f, opts in ev.packet.subscriptions:
                    self.subscribed[f] = opts.qos
                    codes.append(opts.qos)
                core.subscribed(ev.packet.packet_id, ev.ticket, codes)
            elif t is mp.UnsubscribeReceived:
                codes = [0 if self.subscribed.pop(f, None) is not None else 0x11
                         for f in ev.packet.filters]
                core.unsubscribed(ev.packet.packet_id, ev.ticket, codes)
            elif t is mp.DecodeError:
                self._end(core.protocol_error(ev.error))
                return
            elif t is mp.Closed:
                self._end(ev.closing)
                return
            self._check()
        self.out += core.data_to_send()

    def _deliver(self, topic: str, p: mqtt.Publish) -> None:
        """A stored publish back to its publisher, if a filter of it matches exactly."""
        qos = self.subscribed.get(topic)
        if qos is None:
            return
        qos = min(qos, p.qos)
        if qos and self.core.window <= 0:
            return
        msg = Stored(topic, p.payload, p.qos, dict(p.properties))
        self.core.deliver(msg, qos, p.retain, None, topic, 0, now_s=0.0)

    def _check(self) -> None:
        core = self.core
        assert core._inbound_unacked >= 0, "unacknowledged publishes counted below zero"
        assert core.answers_pending <= LIMITS.receive_maximum + 64, "answers pile up"
        if core.flows is not None:
            limit = min(core.receive_maximum, LIMITS.max_inflight)
            assert len(self.flows.outgoing) <= limit, "more in flight than the window"

    def _end(self, closing: mp.Closing) -> None:
        self.refused = isinstance(closing, mp.Refused)
        self.out += self.core.data_to_send() + self.core.close(closing)
        self.closed = True

    def eof(self) -> None:
        if not self.closed:
            self._end(mp.Closing("connection closed by the client"))


def check_output(d: Driver, sent: bytes) -> None:
    """Everything the server sent decodes as server-to-client packets of the connection's
    version; a client whose CONNECT was not accepted gets at most one CONNACK, a refusal
    (in the version its CONNECT asked for, which the server may not have parsed)."""
    out = bytes(d.out)
    if not out:
        return
    if d.core.flows is not None:
        decode(out, d.core.version, sent)
        return
    for version in (5, 4, 3):
        try:
            packets = decode(out, version, sent)
            break
        except AssertionError:
            continue
    else:
        raise AssertionError(f"a refused client got bytes that do not decode: {out!r}")
    assert len(packets) == 1 and isinstance(packets[0], mqtt.Connack), packets
    assert packets[0].reason_code != 0, "CONNACK success without a session"


def decode(out: bytes, version: int, sent: bytes) -> list[Any]:
    dec = mqtt.Decoder(server=False, version=version, max_packet_size=1 << 28)
    try:
        packets = dec.feed(out)
    except ProtocolError as exc:
        raise AssertionError(f"the server sent bytes that do not decode as {version} "
                             f"({exc}): {out[:200]!r} after {sent[:200]!r}") from exc
    assert not dec._buf, f"the server sent a truncated packet: {out[-100:]!r}"
    return packets


def one_input(data: bytes) -> None:
    if len(data) < 2:
        return
    step, data = max(1, data[0]), data[1:]
    d = Driver()
    for i in range(0, len(data), step):
        d.feed(data[i : i + step])
    d.eof()
    check_output(d, data)


def seeds() -> list[bytes]:
    """A CONNECT of each version, then subscribe, publishes of each QoS, acks, ping."""
    out = []
    for v in (3, 4, 5):
        pkts: list[Any] = [
            mqtt.Connect(client_id=f"seed{v}", protocol_level=v, clean_start=v != 4),
            mqtt.Subscribe(1, [("fz/a", mqtt.SubscriptionOptions(2)),
                               ("fz/b", mqtt.SubscriptionOptions(1))]),
            mqtt.Publish("fz/a", b"0", qos=0),
            mqtt.Publish("fz/b", b"1", qos=1, packet_id=2),
            mqtt.Publish("fz/c", b"2", qos=2, packet_id=3, retain=True),
            mqtt.Pubrel(3), mqtt.Puback(1), mqtt.Pubrec(2), mqtt.Pubcomp(2),
            mqtt.Unsubscribe(4, ["fz/a"]), mqtt.Pingreq(), mqtt.Disconnect(),
        ]
        out.append(b"\xff" + b"".join(mqtt.encode(p, v) for p in pkts))
    # A v5 subscriber with topic aliases and a small maximum packet size receiving
    # expiring QoS 1 messages, QoS 2 exchanges around a burst (Receive Maximum), a
    # client publishing to $SYS, and one refused.
    v5 = [
        mqtt.Connect(client_id="seed-alias", protocol_level=5, clean_start=False,
                     properties={"topic_alias_maximum": 4, "maximum_packet_size": 128,
                                 "receive_maximum": 2, "session_expiry_interval": 60}),
        mqtt.Subscribe(1, [("fz/e", mqtt.SubscriptionOptions(1))]),
        *(mqtt.Publish("fz/e", b"e" * (i * 40), qos=1, packet_id=10 + i,
                       properties={"message_expiry_interval": 30, "topic_alias": 1})
          for i in range(4)),
        mqtt.Publish("fz/q2", b"q", qos=2, packet_id=20), mqtt.Pubrel(20),
        mqtt.Publish("fz/q2", b"q", qos=2, packet_id=20, dup=True),
        mqtt.Publish("$SYS/broker/uptime", b"x", qos=1, packet_id=21, retain=True),
        mqtt.Auth(0x19, {"authentication_method": "x"}),
        mqtt.Disconnect(),
    ]
    out.append(b"\xff" + b"".join(mqtt.encode(p, 5) for p in v5))
    out.append(b"\x07" + mqtt.encode(mqtt.Connect(client_id="refuse-me"), 4))
    return out


def main() -> None:
    corpus = [a for a in sys.argv[1:] if not a.startswith("-")]
    if corpus and not Path(corpus[0]).is_file():  # a corpus directory: seeds go in first
        Path(corpus[0]).mkdir(parents=True, exist_ok=True)
        for i, seed in enumerate(seeds()):
            (Path(corpus[0]) / f"seed-{i}").write_bytes(seed)
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
