"""The connection state machine under random packet sequences over real sockets: any
order of client packets (acks for unknown ids, a second CONNECT, PUBREL out of the
blue, wildcard topics in PUBLISH...) closes at most that connection; the server keeps
serving everyone else."""

from __future__ import annotations

import socket

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway import mqtt
from tests.mqtt.raw import RawClient

TOPICS = st.sampled_from(["a", "a/b", "$SYS/x", "fz/+", "#", "", "fz/" + "x" * 50])
PIDS = st.integers(min_value=1, max_value=5)
QOS = st.integers(min_value=0, max_value=2)


def publish(topic: str, qos: int, pid: int, retain: bool) -> mqtt.Publish:
    return mqtt.Publish(topic, b"p", qos, retain, False, pid if qos else None)


PACKETS = st.one_of(
    st.builds(publish, TOPICS, QOS, PIDS, st.booleans()),
    st.builds(mqtt.Puback, PIDS), st.builds(mqtt.Pubrec, PIDS),
    st.builds(mqtt.Pubrel, PIDS), st.builds(mqtt.Pubcomp, PIDS),
    st.builds(lambda f, q, pid: mqtt.Subscribe(pid, [(f, mqtt.SubscriptionOptions(q))]),
              TOPICS, QOS, PIDS),
    st.builds(lambda f, pid: mqtt.Unsubscribe(pid, [f]), TOPICS, PIDS),
    st.just(mqtt.Pingreq()), st.just(mqtt.Disconnect()),
    st.builds(lambda v: mqtt.Connect(client_id="again", protocol_level=v), st.sampled_from([4, 5])),
)


def encode_lenient(packet: object, version: int) -> bytes:
    try:
        return mqtt.encode(packet, version)
    except ValueError:  # the encoder refuses what it knows is invalid: send raw garbage
        return b"\x30\x03\x00\x01+"


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(version=st.sampled_from([3, 4, 5]), connect_first=st.booleans(),
       packets=st.lists(PACKETS, max_size=12))
def test_random_packet_sequences_never_hurt_the_server(shared_server, version, connect_first,
                                                       packets) -> None:
    s = socket.create_connection(("127.0.0.1", shared_server.port), timeout=5)
    try:
        if connect_first:
            s.sendall(mqtt.encode(mqtt.Connect(client_id="fz", protocol_level=version),
                                  version))
        s.sendall(b"".join(encode_lenient(p, version) for p in packets))
        s.settimeout(0.2)
        try:
            while s.recv(65536):
                pass
        except (TimeoutError, ConnectionResetError):
            pass
    finally:
        s.close()
    # Health check: an ordinary client still gets a full round trip.
    c = RawClient(shared_server.port)
    c.connect("fz-health")
    c.subscribe("fz/health", 1)
    c.send(mqtt.Publish("fz/health", b"ok", qos=1, packet_id=9))
    got = [c.recv(), c.recv()]
    assert any(isinstance(p, mqtt.Publish) and p.payload == b"ok" for p in got)
    c.close()
