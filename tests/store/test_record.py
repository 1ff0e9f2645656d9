from __future__ import annotations

import pytest

from store import record
from store.record import CorruptRecord, Message


def make(**kw) -> Message:
    base = dict(
        topic="home/bath/temp",
        body=b"\x00\x01payload\xff",
        qos=2,
        retain=True,
        client_id="dev-1",
        born_ts=1234,
        key="k-9",
        store_ts=5678,
        properties={
            "user_property": [["unit", "C"], ["unit", "F"]],
            "correlation_data": b"\x00\xffbin",
            "content_type": "application/json",
            "message_expiry_interval": 60,
        },
        queues=[("home/bath/temp", 7), ("home/+/temp", 3), ("home#1", 41)],
    )
    base.update(kw)
    return Message(**base)


def test_round_trip_keeps_every_field() -> None:
    msg = make()
    raw = record.encode(msg)
    back = record.decode(raw, 0, phys_offset=4096)
    assert back.topic == msg.topic and back.body == msg.body
    assert (back.qos, back.retain, back.client_id, back.key) == (2, True, "dev-1", "k-9")
    assert (back.born_ts, back.store_ts) == (1234, 5678)
    assert back.properties == msg.properties
    assert back.queues == msg.queues
    assert back.size == len(raw) and back.phys_offset == 4096
    assert back.msg_id == "0000000000001000" and record.parse_msg_id(back.msg_id) == 4096
    assert back.offset_in("home/+/temp") == 3


def test_a_partial_decode_stops_after_the_first_queues_and_still_checks_the_crc() -> None:
    msg = make()
    raw = record.encode(msg)
    full = record.decode(raw, 0, 64)
    for n in (0, 1, 2, 3, 9):
        part = record.decode(raw, 0, 64, max_queues=n)
        assert part.queues == msg.queues[:n]
        part.queues = full.queues
        assert part == full
    flipped = bytearray(raw)
    flipped[-3] ^= 0xFF  # inside the last queue's offset, never decoded with max_queues=1
    with pytest.raises(CorruptRecord, match="CRC"):
        record.decode(bytes(flipped), 0, max_queues=1)


def test_decode_first_is_decode_of_the_first_queue() -> None:
    """The history reader's faster decode: the same message, the same refusals."""
    msgs = [make(), make(key="", properties={}), make(queues=[]), Message("t", b""),
            make(queues=[(f"q{i}", i) for i in range(record.MAX_QUEUES + 1)])]  # wide
    for msg in msgs:
        raw = b"pad" + record.encode(msg) + b"more"
        assert record.decode_first(raw, 3, 64) == record.decode(raw, 3, 64, max_queues=1)
    raw = bytearray(record.encode(make()))
    for i in range(len(raw)):
        bad = bytearray(raw)
        bad[i] ^= 0x40
        with pytest.raises(CorruptRecord):
            record.decode_first(bytes(bad), 0)
    with pytest.raises(CorruptRecord, match="length"):
        record.decode_first(bytes(raw[:-1]), 0)


def test_empty_fields_round_trip() -> None:
    msg = Message(topic="t", body=b"", queues=[])
    back = record.decode(record.encode(msg))
    assert (back.body, back.properties, back.queues, back.retain) == (b"", {}, [], False)


def test_every_single_byte_flip_is_detected() -> None:
    raw = bytearray(record.encode(make()))
    for i in range(len(raw)):
        bad = bytearray(raw)
        bad[i] ^= 0x40
        with pytest.raises(CorruptRecord):
            record.decode(bytes(bad))


def test_every_truncation_is_detected() -> None:
    raw = record.encode(make())
    for n in range(len(raw)):
        with pytest.raises(CorruptRecord):
            record.decode(raw[:n])


def test_unstorable_property_is_refused() -> None:
    with pytest.raises(TypeError):
        record.encode(make(properties={"x": object()}))
