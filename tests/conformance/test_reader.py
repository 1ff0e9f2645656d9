"""The conformance tests' own reader (reader.py) refuses what the specifications forbid
and reads what they allow: a reader that took anything would make every test that leans
on it pass for nothing. Bytes here are written out by hand from the specifications."""

from __future__ import annotations

import pytest

from gateway import mqtt
from tests.conformance.reader import (
    Connack,
    Disconnect,
    Puback,
    Publish,
    Pubrel,
    Reader,
    Suback,
    Unsuback,
    Violation,
    utf8_problem,
)


def read(data: bytes, version: int = 5) -> list:
    return Reader(version).feed(data)


GOOD = [
    (b"\x20\x03\x00\x00\x00", Connack(False, 0)),
    (b"\x20\x02\x01\x00", Connack(True, 0)),  # 3.1.1, below
    (b"\x30\x07\x00\x03a/b\x00x", Publish("a/b", b"x")),
    (b"\x32\x08\x00\x01a\x00\x07\x00hi", Publish("a", b"hi", 1, packet_id=7)),
    (b"\x30\x09\x00\x01a\x04\x0b\x07\x0b\x09p",
     Publish("a", b"p", properties={"subscription_identifier": [7, 9]})),
    (b"\x30\x06\x00\x00\x03\x23\x00\x01",
     Publish("", b"", properties={"topic_alias": 1})),
    (b"\x40\x02\x00\x05", Puback(5)),
    (b"\x40\x03\x00\x05\x87", Puback(5, 0x87)),
    (b"\x62\x02\x00\x05", Pubrel(5)),
    (b"\x90\x04\x00\x01\x00\x02", Suback(1, [2])),
    (b"\xb0\x05\x00\x01\x00\x00\x11", Unsuback(1, [0, 0x11])),
    (b"\xe0\x00", Disconnect()),
    (b"\xe0\x01\x8e", Disconnect(0x8E)),
]


@pytest.mark.parametrize(("data", "packet"), GOOD)
def test_reads_what_is_allowed(data: bytes, packet: object) -> None:
    version = 4 if data == b"\x20\x02\x01\x00" else 5
    [got] = read(data, version)
    assert got == packet and got.raw == data and got.size == len(data)


def test_reads_across_any_cut_and_several_in_one_piece() -> None:
    data = b"".join(d for d, _ in GOOD if d != b"\x20\x02\x01\x00")
    r = Reader(5)
    got = [p for i in range(len(data)) for p in r.feed(data[i:i + 1])]
    assert got == [p for d, p in GOOD if d != b"\x20\x02\x01\x00"]
    assert read(data) == got


def test_agrees_with_the_project_codec_on_well_formed_packets() -> None:
    """A cross-check, not the reference: both sides must read the same fields."""
    ups = [("k", "ü"), ("k", "\ufeff")]
    packets = [mqtt.Publish("a/ü", b"\x00\xff", 2, True, True, 9,
                            {"user_property": ups, "correlation_data": b"\x00",
                             "response_topic": "r/1", "message_expiry_interval": 7}),
               mqtt.Connack(True, 0, {"assigned_client_identifier": "x", "receive_maximum": 5,
                                      "topic_alias_maximum": 3}),
               mqtt.Suback(3, [0, 1, 0x8F], {"reason_string": "why"})]
    got = read(b"".join(mqtt.encode(p, 5) for p in packets))
    assert [type(p).__name__ for p in got] == ["Publish", "Connack", "Suback"]
    assert (got[0].topic, got[0].payload, got[0].qos, got[0].retain, got[0].dup,
            got[0].packet_id, got[0].properties["user_property"]) == \
        ("a/ü", b"\x00\xff", 2, True, True, 9, ups)
    assert got[1].properties == packets[1].properties
    assert (got[2].reason_codes, got[2].properties) == ([0, 1, 0x8F], {"reason_string": "why"})


BAD = {
    "reserved packet type 0": b"\x00\x00",
    "a CONNECT from the Server": b"\x10\x00",
    "a PINGREQ from the Server": b"\xc0\x00",
    "SUBACK flags 0001": b"\x91\x03\x00\x01\x00",
    "PUBREL flags 0000": b"\x60\x02\x00\x01",
    "PUBLISH QoS 3": b"\x36\x05\x00\x01a\x00\x01",
    "DUP on QoS 0": b"\x38\x04\x00\x01a\x00",
    "remaining length not minimal": b"\xd0\x80\x00",
    "remaining length of five bytes": b"\x30\xff\xff\xff\xff\x7f",
    "PINGRESP with a body": b"\xd0\x01\x00",
    "packet id 0": b"\x40\x02\x00\x00",
    "PUBACK reason code of PUBREL": b"\x40\x03\x00\x01\x92",
    "trailing bytes after PUBACK properties": b"\x40\x05\x00\x01\x00\x00\x00",
    "CONNACK reserved flag": b"\x20\x03\x02\x00\x00",
    "CONNACK code 0x01": b"\x20\x03\x00\x01\x00",
    "CONNACK without Property Length": b"\x20\x02\x00\x00",
    "Session Present on a refusal": b"\x20\x03\x01\x87\x00",
    "topic with a surrogate": b"\x30\x06\x00\x03a\xed\xa0\x00",
    "topic with an overlong /": b"\x30\x05\x00\x02\xc0\xaf\x00",
    "topic with U+0000": b"\x30\x05\x00\x02a\x00\x00",
    "topic above U+10FFFF": b"\x30\x07\x00\x04\xf4\x90\x80\x80\x00",
    "topic with a wildcard": b"\x30\x05\x00\x02a#\x00",
    "empty topic without an alias": b"\x30\x03\x00\x00\x00",
    "unknown property 0x7F": b"\x40\x06\x00\x01\x00\x02\x7f\x00",
    "topic alias on PUBACK": b"\x40\x07\x00\x01\x00\x03\x23\x00\x01",
    "reason string twice": b"\x40\x0c\x00\x01\x80\x08\x1f\x00\x01a\x1f\x00\x01b",
    "property past its length": b"\x40\x08\x00\x01\x80\x02\x1f\x00\x01a",
    "property id not minimal": b"\x40\x07\x00\x01\x80\x03\x9f\x00\x00",
    "topic alias 0": b"\x30\x07\x00\x01a\x03\x23\x00\x00",
    "receive maximum 0": b"\x20\x06\x00\x00\x03\x21\x00\x00",
    "maximum qos 2": b"\x20\x05\x00\x00\x02\x24\x02",
    "user property name not UTF-8": b"\x40\x0b\x00\x01\x80\x07\x26\x00\x01\xff\x00\x01v",
    "SUBACK without codes": b"\x90\x03\x00\x01\x00",
    "SUBACK code 0x03": b"\x90\x04\x00\x01\x00\x03",
    "DISCONNECT 0x04 (the Client's)": b"\xe0\x01\x04",
    "AUTH 0x19 (the Client's)": b"\xf0\x02\x19\x00",
}


@pytest.mark.parametrize("data", BAD.values(), ids=BAD.keys())
def test_refuses_what_is_forbidden(data: bytes) -> None:
    with pytest.raises(Violation):
        read(data)
    with pytest.raises(Violation):  # refused as soon as the packet is whole, not later
        read(data + b"\xd0\x00" * 4)


@pytest.mark.parametrize("data", [b"\xe0\x00", b"\x20\x03\x00\x00\x00", b"\x40\x03\x00\x01\x80",
                                  b"\xb0\x03\x00\x01\x00"], ids=["DISCONNECT", "CONNACK 5.0",
                                                                "PUBACK with a code",
                                                                "UNSUBACK with a code"])
def test_refuses_5_0_forms_in_3_1_1(data: bytes) -> None:
    with pytest.raises(Violation):
        read(data, 4)


def test_a_refusal_stops_the_reader() -> None:
    r = Reader(5)
    with pytest.raises(Violation):
        r.feed(b"\xd0\x00\x00\x00")
    with pytest.raises(Violation):
        r.feed(b"\xd0\x00")


@pytest.mark.parametrize(("text", "ok"), [
    (b"", True), (b"a/b", True), ("ü€𝄞".encode(), True), ("\uffff\ufdd0".encode(), True),
    (b"\xef\xbb\xbf", True), (b"\xc2\x80", True), (b"\xf4\x8f\xbf\xbf", True),
    (b"\xc1\xbf", False), (b"\xe0\x9f\xbf", False), (b"\xf0\x8f\xbf\xbf", False),
    (b"\xed\xa0\x80", False), (b"\xed\xbf\xbf", False), (b"\xf4\x90\x80\x80", False),
    (b"\xf5\x80\x80\x80", False), (b"\x80", False), (b"\xe2\x82", False), (b"\x00", False),
])
def test_utf8_rules(text: bytes, ok: bool) -> None:
    assert (utf8_problem(text) is None) == ok
    if ok:  # the same verdict as Python's strict decoder, where U+0000 is not the matter
        text.decode("utf-8")
