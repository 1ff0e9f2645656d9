"""Property tests for the MQTT codec: round trips for every packet type and version, and
arbitrary or mutated bytes never raise anything but ProtocolError."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.mqtt import (
    Auth,
    Connack,
    Connect,
    Decoder,
    Disconnect,
    Pingreq,
    Pingresp,
    ProtocolError,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    SubscriptionOptions,
    Unsuback,
    Unsubscribe,
    Will,
    encode,
)
from gateway.mqtt import properties as P
from gateway.mqtt import reason as R

SETTINGS = settings(
    max_examples=300, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
VERSIONS = st.sampled_from([3, 4, 5])

# --- building blocks ---------------------------------------------------------------------

# Valid MQTT UTF-8: no surrogates, no U+0000.
text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
               max_size=12)
level = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00+#/"),
                max_size=6)
topic_name = st.lists(level, min_size=1, max_size=4).map("/".join).filter(bool)


@st.composite
def topic_filter(draw: st.DrawFn) -> str:
    levels = draw(st.lists(st.one_of(level, st.just("+")), min_size=1, max_size=4))
    if draw(st.booleans()):
        levels.append("#")
    result = "/".join(levels)
    if not result:
        result = "#"
    if draw(st.integers(0, 9)) == 0:
        result = f"$share/{draw(level.filter(bool))}/{result}"
    return result


packet_id = st.integers(1, 0xFFFF)
qos = st.integers(0, 2)
payload = st.binary(max_size=300)


def _value(name: str, kind: int) -> st.SearchStrategy[Any]:
    if name == "user_property":
        return st.lists(st.tuples(text, text), min_size=1, max_size=3)
    if name == "subscription_identifier":
        return st.lists(st.integers(1, 268_435_455), min_size=1, max_size=3)
    if name == "response_topic":
        return topic_name
    lo = 1 if name in ("receive_maximum", "maximum_packet_size", "topic_alias") else 0
    return {
        P.BYTE: st.integers(0, 1),
        P.U16: st.integers(lo, 0xFFFF),
        P.U32: st.integers(lo, 0xFFFFFFFF),
        P.STR: text,
        P.BIN: st.binary(max_size=20),
    }[kind]


_KINDS = {name: kind for name, kind, _ in P._TABLE.values()}


@st.composite
def props(draw: st.DrawFn, ptype: int, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    names = sorted(P.ALLOWED[ptype] - set(exclude))
    chosen = draw(st.lists(st.sampled_from(names), unique=True, max_size=4)) if names else []
    out = {name: draw(_value(name, _KINDS[name])) for name in chosen}
    if "subscription_identifier" in out and ptype == P.SUBSCRIBE:
        out["subscription_identifier"] = out["subscription_identifier"][:1]
    if "authentication_data" in out and "authentication_method" not in out:
        out["authentication_method"] = draw(text)
    return out


def maybe_props(version: int, ptype: int, exclude: tuple[str, ...] = ()) -> Any:
    return props(ptype, exclude) if version == 5 else st.just({})


# --- packet strategies ---------------------------------------------------------------------


@st.composite
def connect(draw: st.DrawFn, version: int) -> Connect:
    will = None
    if draw(st.booleans()):
        will = Will(draw(topic_name), draw(payload), draw(qos), draw(st.booleans()),
                    draw(maybe_props(version, P.WILL)))
    username = draw(st.none() | text)
    password = draw(st.none() | st.binary(max_size=20))
    if version < 5 and username is None:
        password = None
    return Connect(draw(text), version, "", draw(st.booleans()), draw(st.integers(0, 0xFFFF)),
                   username, password, will, draw(maybe_props(version, P.CONNECT)))


@st.composite
def publish(draw: st.DrawFn, version: int, from_server: bool) -> Publish:
    q = draw(qos)
    exclude = () if from_server else ("subscription_identifier",)
    properties = draw(maybe_props(version, P.PUBLISH, exclude))
    topic = draw(topic_name)
    if "topic_alias" in properties and draw(st.booleans()):
        topic = ""
    return Publish(topic, draw(payload), q, draw(st.booleans()),
                   bool(q and draw(st.booleans())), draw(packet_id) if q else None,
                   properties)


@st.composite
def ack(draw: st.DrawFn, version: int, cls: type, ptype: int, reasons: frozenset[int]) -> Any:
    if version < 5:
        return cls(draw(packet_id))
    return cls(draw(packet_id), draw(st.sampled_from(sorted(reasons))),
               draw(props(ptype)))


@st.composite
def subscribe(draw: st.DrawFn, version: int) -> Subscribe:
    subs = []
    for f in draw(st.lists(topic_filter(), min_size=1, max_size=4)):
        if version == 5:
            opts = SubscriptionOptions(draw(qos), draw(st.booleans()) and not
                                       f.startswith("$share/"),
                                       draw(st.booleans()), draw(st.integers(0, 2)))
        else:
            opts = SubscriptionOptions(draw(qos))
        subs.append((f, opts))
    return Subscribe(draw(packet_id), subs, draw(maybe_props(version, P.SUBSCRIBE)))


@st.composite
def connack(draw: st.DrawFn, version: int) -> Connack:
    codes = R.CONNACK_REASONS if version == 5 else R.CONNACK_V3_RETURN_CODES
    code = draw(st.sampled_from(sorted(codes)))
    return Connack(bool(code == 0 and draw(st.booleans())), code,
                   draw(maybe_props(version, P.CONNACK)))


@st.composite
def suback(draw: st.DrawFn, version: int) -> Suback:
    codes = R.SUBACK_REASONS if version == 5 else R.SUBACK_V3_RETURN_CODES
    return Suback(draw(packet_id), draw(st.lists(st.sampled_from(sorted(codes)), min_size=1,
                                                 max_size=5)),
                  draw(maybe_props(version, P.SUBACK)))


@st.composite
def unsuback(draw: st.DrawFn, version: int) -> Unsuback:
    if version < 5:
        return Unsuback(draw(packet_id))
    return Unsuback(draw(packet_id), draw(st.lists(st.sampled_from(sorted(R.UNSUBACK_REASONS)),
                                                   min_size=1, max_size=5)),
                    draw(props(P.UNSUBACK)))


@st.composite
def disconnect(draw: st.DrawFn, version: int, from_server: bool) -> Disconnect:
    if version < 5:
        return Disconnect()
    exclude = ("session_expiry_interval",) if from_server else ()
    return Disconnect(draw(st.sampled_from(sorted(R.DISCONNECT_REASONS))),
                      draw(props(P.DISCONNECT, exclude)))


@st.composite
def auth(draw: st.DrawFn) -> Auth:
    return Auth(draw(st.sampled_from(sorted(R.AUTH_REASONS))), draw(props(P.AUTH)))


def acks(version: int) -> st.SearchStrategy[Any]:
    return st.one_of(
        ack(version, Puback, P.PUBACK, R.PUBACK_REASONS),
        ack(version, Pubrec, P.PUBREC, R.PUBACK_REASONS),
        ack(version, Pubrel, P.PUBREL, R.PUBREL_REASONS),
        ack(version, Pubcomp, P.PUBCOMP, R.PUBREL_REASONS),
    )


def client_packet(version: int) -> st.SearchStrategy[Any]:
    """Packets a client sends (what a server decoder accepts after CONNECT)."""
    options = [
        publish(version, from_server=False),
        acks(version),
        subscribe(version),
        st.builds(Unsubscribe, packet_id, st.lists(topic_filter(), min_size=1, max_size=4),
                  maybe_props(version, P.UNSUBSCRIBE)),
        st.just(Pingreq()),
        disconnect(version, from_server=False),
    ]
    if version == 5:
        options.append(auth())
    return st.one_of(options)


def server_packet(version: int) -> st.SearchStrategy[Any]:
    options = [
        connack(version),
        publish(version, from_server=True),
        acks(version),
        suback(version),
        unsuback(version),
        st.just(Pingresp()),
    ]
    if version == 5:
        options += [disconnect(version, from_server=True), auth()]
    return st.one_of(options)


@st.composite
def client_stream(draw: st.DrawFn) -> tuple[int, list[Any]]:
    version = draw(VERSIONS)
    first = draw(connect(version))
    return version, [first, *draw(st.lists(client_packet(version), max_size=6))]


@st.composite
def server_stream(draw: st.DrawFn) -> tuple[int, list[Any]]:
    version = draw(VERSIONS)
    return version, draw(st.lists(server_packet(version), min_size=1, max_size=6))


def chunks(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    edges = [0, *points, len(data)]
    return [data[a:b] for a, b in zip(edges, edges[1:], strict=False)]


# --- round trips ---------------------------------------------------------------------------


@SETTINGS
@given(client_stream(), st.lists(st.integers(0, 10_000), max_size=8))
def test_client_to_server_round_trip(stream: tuple[int, list[Any]], cuts: list[int]) -> None:
    version, packets = stream
    wire = b"".join(encode(p, version) for p in packets)
    assert Decoder().feed(wire) == packets
    d = Decoder()
    got = [p for part in chunks(wire, cuts) for p in d.feed(part)]
    assert got == packets
    assert d.version == version


@SETTINGS
@given(server_stream(), st.lists(st.integers(0, 10_000), max_size=8))
def test_server_to_client_round_trip(stream: tuple[int, list[Any]], cuts: list[int]) -> None:
    version, packets = stream
    wire = b"".join(encode(p, version) for p in packets)
    d = Decoder(server=False, version=version)
    got = [p for part in chunks(wire, cuts) for p in d.feed(part)]
    assert got == packets


# --- hostile input -----------------------------------------------------------------------------


def feed_all(decoder: Decoder, parts: list[bytes]) -> None:
    try:
        for part in parts:
            decoder.feed(part)
    except ProtocolError:
        pass  # the only exception allowed


@SETTINGS
@given(st.binary(max_size=200), st.lists(st.integers(0, 10_000), max_size=4))
def test_random_bytes_alone(data: bytes, cuts: list[int]) -> None:
    feed_all(Decoder(), chunks(data, cuts))
    for version in (3, 4, 5):
        feed_all(Decoder(server=False, version=version), [data])


@SETTINGS
@given(VERSIONS, st.binary(max_size=200))
def test_random_bytes_after_connect(version: int, data: bytes) -> None:
    d = Decoder()
    d.feed(encode(Connect("c", version), version))
    feed_all(d, [data])


@SETTINGS
@given(VERSIONS, st.integers(0, 15), st.integers(0, 15), st.binary(max_size=120))
def test_random_body_behind_valid_header(
    version: int, ptype: int, flags: int, body: bytes
) -> None:
    """Random bodies behind a well-formed fixed header reach every packet decoder."""
    wire = bytes(((ptype << 4) | flags, len(body))) + body
    d = Decoder()
    d.feed(encode(Connect("c", version), version))
    feed_all(d, [wire])
    feed_all(Decoder(server=False, version=version), [wire])
    if ptype == 1:
        feed_all(Decoder(), [wire])


@SETTINGS
@given(client_stream(), st.data())
def test_mutated_valid_packets(stream: tuple[int, list[Any]], data: st.DataObject) -> None:
    """Flip, insert and delete bytes of a valid stream: still only ProtocolError."""
    version, packets = stream
    wire = bytearray(b"".join(encode(p, version) for p in packets))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.integers(0, 2))
        i = data.draw(st.integers(0, max(len(wire) - 1, 0)))
        if op == 0 and wire:
            wire[i] = data.draw(st.integers(0, 255))
        elif op == 1:
            wire[i:i] = data.draw(st.binary(min_size=1, max_size=4))
        elif wire:
            del wire[i]
    feed_all(Decoder(), [bytes(wire)])
    d = Decoder()
    d.feed(encode(Connect("c", version), version))
    feed_all(d, [bytes(wire[len(encode(packets[0], version)):])])


@SETTINGS
@given(server_stream(), st.data())
def test_mutated_server_packets(stream: tuple[int, list[Any]], data: st.DataObject) -> None:
    version, packets = stream
    wire = bytearray(b"".join(encode(p, version) for p in packets))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(wire) - 1))
        wire[i] = data.draw(st.integers(0, 255))
    feed_all(Decoder(server=False, version=version), [bytes(wire)])
