"""Coverage-guided fuzzing (atheris/libFuzzer) of the native protocol's input side: the
frame decoder, the message descriptions in SEND/PUBLISH frames, their validation, and the
CommitLog record they become.

    python tests/fuzz/fuzz_native.py -runs=1000000 [-max_len=4096] [corpus_dir]

Each input is bytes from a native client, fed in chunks split where its first byte says.
A bug is any of:
- the decoder raising anything but ProtocolError (a TypeError from a `{"$b64": 5}` header
  ended the whole server, unauthenticated);
- a message that passes `validate_message` but does not become a record that decodes
  back to itself (such a record stopped every later start in recovery);
- a message validated for MQTT that the gateway's PublishTemplate refuses (a stored
  `qos=3` ended every subscriber's delivery loop, on every reconnect).
native_seeds.SEED_INPUTS are the shapes that found those; the test starts from them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

with atheris.instrument_imports():
    from lightqueue.topic import validate_topic_name
    from store import protocol as p
    from store import record
    from store.validate import validate_message

from gateway.mqtt import PublishTemplate  # noqa: E402 - the judge, not fuzzed
from gateway.mqtt.properties import publish_properties  # noqa: E402


def one_input(data: bytes) -> None:
    if len(data) < 2:
        return
    step = max(1, data[0])
    dec = p.FrameDecoder(max_frame=1 << 16)
    frames = []
    try:
        for i in range(1, len(data), step):
            frames.extend(dec.feed(data[i : i + step]))
    except p.ProtocolError:
        return
    for f in frames:
        if f.code not in (p.SEND, p.PUBLISH):
            continue
        try:
            msgs = p.unpack_messages(f.header.get("messages", []), f.body)
        except p.ProtocolError:
            continue
        topic = str(f.header.get("topic", ""))
        for m in msgs:
            mqtt = f.code == p.PUBLISH or bool(m.topic and m.topic != topic)
            try:
                validate_message(m, mqtt=mqtt)
            except ValueError:
                continue
            _check_stored(m, mqtt)


def _check_stored(m: record.Message, mqtt: bool) -> None:
    m.store_ts, m.queues = 1, [("q", 0)]
    try:
        raw = record.encode(m)
    except ValueError:
        return  # refused before it is stored: fine
    back = record.decode(raw)  # raises CorruptRecord: the bug this guards against
    assert (back.topic, back.body, back.qos, back.retain) == (m.topic, m.body, m.qos,
                                                              m.retain)
    if not mqtt:
        return
    try:
        validate_topic_name(m.topic)  # as the store's routing does before it appends
    except ValueError:
        return
    try:
        PublishTemplate(back.topic, back.body, back.qos, back.retain,
                        publish_properties(back.properties))
    except ValueError as exc:
        raise AssertionError(f"validated for MQTT but not publishable: {exc}") from exc


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
