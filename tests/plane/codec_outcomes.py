"""What a client's bytes come to through the Python MQTT codec and through the native
one, in one comparable shape: (packets, reason code of the violation or None, bytes held).
Packets are the tuples the native codec hands over; the packets it leaves to Python stay
Python packets. Shared by the differential test and the fuzzer."""

from __future__ import annotations

from typing import Any

from gateway.mqtt import (
    Decoder,
    Disconnect,
    Pingreq,
    ProtocolError,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
)
from gateway.mqtt.properties import encode_varint

Outcome = tuple[list[Any], int | None, int | None]  # packets, reason code, bytes held


def as_tuple(p: Any) -> Any:
    """A packet as the native codec hands it over (the rest stay packets: Python's)."""
    if type(p) is Publish:
        return (3, p.topic, p.payload, p.qos, p.retain, p.dup, p.packet_id, p.properties)
    if type(p) in (Puback, Pubrec, Pubrel, Pubcomp):
        return (p.TYPE, p.packet_id, p.reason_code, p.properties)
    if type(p) is Pingreq:
        return (12,)
    if type(p) is Disconnect:
        return (14, p.reason_code, p.properties)
    return p


def python_outcome(parts: list[bytes], version: int, budget: int) -> Outcome:
    dec = Decoder(max_packet_size=budget, version=version)
    got: list[Any] = []
    try:
        for part in parts:
            got += dec.feed(part)
    except ProtocolError as exc:
        return [as_tuple(p) for p in got + exc.packets], exc.reason_code, None
    return [as_tuple(p) for p in got], None, dec.buffered


def native_outcome(native: Any, parts: list[bytes], version: int, budget: int) -> Outcome:
    """`native`: the lightgate_native module. A frame it leaves for Python is decoded by
    Python, as the connection does."""
    dec = native.MqttDecoder(version, budget)
    got: list[Any] = []
    error = None
    try:
        for part in parts:
            got += dec.feed(part)
    except native.MqttError as exc:
        code, _message, before = exc.args
        got += before
        error = code
    out: list[Any] = []
    for item in got:
        if item[0] != 0:
            out.append(item)
            continue
        _, ptype, flags, body = item  # a frame left for Python: decode it as Python would
        frame = bytes(((ptype << 4) | flags,)) + encode_varint(len(body)) + body
        try:
            out += Decoder(max_packet_size=budget, version=version).feed(frame)
        except ProtocolError as exc:
            return out, exc.reason_code, None
    return out, error, None if error is not None else dec.buffered
