"""Coverage-guided fuzzing (atheris/libFuzzer) of the native MQTT codec through its
binding, with the Python codec as the judge.

    python tests/fuzz/fuzz_codec_native.py -runs=1000000 [-max_len=4096] [corpus_dir]

Each input picks a protocol version, a packet budget and a chunk size from its first
bytes, then feeds the rest as a client's bytes after CONNACK to both decoders. A bug is
any of: the native decoder raising anything but MqttError, or the two codecs disagreeing
on the packets decoded, the reason code they stop with, or the bytes they hold.
"""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

with atheris.instrument_imports():
    from gateway import mqtt

from serving import lightgate_native  # noqa: E402 - the fuzzed code (compiled: not instrumented)
from tests.plane.codec_outcomes import native_outcome, python_outcome  # noqa: E402

BUDGETS = (16, 64, 300, mqtt.MAX_PACKET_SIZE)


def one_input(data: bytes) -> None:
    if len(data) < 2:
        return
    mode, split = data[0], data[1]
    version = 5 if mode & 1 else 4
    budget = BUDGETS[(mode >> 1) & 3]
    payload = data[2:]
    step = max(1, split)
    parts = [payload[i : i + step] for i in range(0, len(payload), step)]
    native = native_outcome(lightgate_native, parts, version, budget)
    python = python_outcome(parts, version, budget)
    assert native == python, f"native {native!r} != python {python!r}"


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
