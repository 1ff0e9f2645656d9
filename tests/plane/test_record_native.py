"""The native CommitLog record encoder against the Python one, the specification: the
same bytes for any message, and Python's error for what neither may store."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving import plane
from store import record
from store.record import Message

if plane.NATIVE is None:
    if os.environ.get("LIGHTGATE_NATIVE") == "1":
        pytest.fail("LIGHTGATE_NATIVE=1 but the native extension is not installed")
    pytest.skip("the native extension is not installed", allow_module_level=True)

text = st.text(st.characters(exclude_characters="\x00"), max_size=30)
props = st.dictionaries(
    st.sampled_from(["content_type", "response_topic", "message_expiry_interval",
                     "correlation_data", "user_properties", "$b64"]),
    st.one_of(st.integers(0, 2**32), text, st.binary(max_size=20),
              st.lists(st.tuples(text, text), max_size=3)), max_size=3)


@settings(max_examples=500, deadline=None)
@given(topic=text.filter(bool), body=st.binary(max_size=300), qos=st.integers(0, 2),
       retain=st.booleans(), client=text, key=text, properties=props,
       born=st.integers(0, 2**63 - 1), stored=st.integers(0, 2**63 - 1),
       queues=st.lists(st.tuples(text.filter(bool), st.integers(0, 2**64 - 1)), max_size=4))
def test_same_bytes_as_python(topic: str, body: bytes, qos: int, retain: bool, client: str,
                              key: str, properties: dict, born: int, stored: int,
                              queues: list[tuple[str, int]]) -> None:
    msg = Message(topic, body, qos, retain, client, properties, born, key, stored)
    msg.queues = queues
    try:
        expected = record.encode_python(msg)
    except Exception as exc:  # noqa: BLE001 - whatever Python refuses, native refuses alike
        with pytest.raises(type(exc)):
            record.encode(msg)
        return
    got = record.encode(msg)
    assert got == expected
    back = record.decode(got, 0, 0)
    assert (back.topic, back.body, back.queues) == (topic, body, queues)


def test_an_idempotent_producers_marks_and_stamp() -> None:
    """The first record of an idempotent append carries its mark and the producer's
    stamp in its properties, the rest their mark: the same bytes either way."""
    for mark, producer in ((record.MARK_FIRST, ["p-1", 2, 7]),
                           (record.MARK_MORE, None)):
        msg = Message("t", b"x", 1, True, "c", {"content_type": "a"}, 5, "", 9)
        msg.queues = [("t", 3)]
        msg.mark, msg.producer = mark, producer
        assert record.encode(msg) == record.encode_python(msg)
        back = record.decode(record.encode(msg), 0, 0)
        assert back.mark == mark and back.retain


def test_too_long_a_field_gets_pythons_error() -> None:
    msg = Message("t" * 70_000, b"x", store_ts=1)
    msg.queues = [("t", 0)]
    with pytest.raises(Exception) as native:
        record.encode(msg)
    with pytest.raises(Exception) as python:
        record.encode_python(msg)
    assert type(native.value) is type(python.value)
    assert str(native.value) == str(python.value)


def test_pythons_error_comes_first_whatever_fails() -> None:
    """A topic that is no UTF-8 and properties that are no record's: Python's encoder
    fails on the topic before it looks at the properties, and so must `encode`."""
    msg = Message("t\udc80", b"x", properties={"$b64": "\x80"}, store_ts=1)
    msg.queues = [("t", 0)]
    with pytest.raises(UnicodeEncodeError):
        record.encode(msg)
