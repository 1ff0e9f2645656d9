"""Coverage-guided fuzzing (atheris/libFuzzer) of the MQTT codec.

    python tests/fuzz/fuzz_codec.py -runs=1000000 [-max_len=4096] [corpus_dir]

Each input picks a protocol version and a decoder side from its first byte, then feeds
the rest in chunks split where the input says. Anything but ProtocolError is a bug, and
every packet that decodes must encode and decode back to itself.
"""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

with atheris.instrument_imports():
    from gateway import mqtt
    from gateway.mqtt import ProtocolError

CONNECT = {v: mqtt.encode(mqtt.Connect(client_id="fuzz", protocol_level=v), v)
           for v in (3, 4, 5)}


def one_input(data: bytes) -> None:
    if len(data) < 2:
        return
    mode, split = data[0], data[1]
    version = (3, 4, 5)[mode % 3]
    server = bool(mode & 0x04)
    payload = data[2:]
    if server:
        dec = mqtt.Decoder(max_packet_size=1 << 16)
        if mode & 0x08:  # after a valid CONNECT, or raw from the first byte
            dec.feed(CONNECT[version])
    else:
        dec = mqtt.Decoder(server=False, version=version, max_packet_size=1 << 16)
    step = max(1, split)
    packets = []
    try:
        for i in range(0, len(payload), step):
            packets.extend(dec.feed(payload[i : i + step]))
    except ProtocolError:
        return
    for p in packets:
        v = dec.version or version
        try:
            raw = mqtt.encode(p, v)
        except ValueError:
            continue  # e.g. a CONNECT's version differs from the decoder's
        if isinstance(p, mqtt.Connect):
            back = mqtt.Decoder()  # a fresh server side learns the version from it
        else:
            back = mqtt.Decoder(server=server, version=v)
        try:
            again = back.feed(raw)
        except ProtocolError as exc:
            raise AssertionError(f"re-encoded {p!r} does not decode: {exc}") from exc
        assert again == [p], (p, again)


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
