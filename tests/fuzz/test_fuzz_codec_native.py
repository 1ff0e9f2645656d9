"""Runs the coverage-guided fuzzer of the native MQTT codec (judged by the Python codec)
for a bounded number of inputs, from valid client packets of both versions.

`make test` runs a short burst; `make soak` runs 1,000,000 inputs (LIGHTGATE_FUZZ_RUNS)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gateway import mqtt
from serving import plane
from tests.fuzz.runner import run_fuzzer

pytest.importorskip("atheris", reason="atheris is not installed (test extra)")
if plane.NATIVE is None or not hasattr(plane.NATIVE, "MqttDecoder"):
    if os.environ.get("LIGHTGATE_NATIVE") == "1":
        pytest.fail("LIGHTGATE_NATIVE=1 but the native MQTT codec is not installed")
    pytest.skip("the native MQTT codec is not installed", allow_module_level=True)

FUZZER = Path(__file__).with_name("fuzz_codec_native.py")
RUNS = int(os.environ.get("LIGHTGATE_FUZZ_RUNS", "20000"))


def _seeds() -> list[bytes]:
    """Valid streams, for each version and budget (mode byte) and a chunk size of 7."""
    packets = [
        mqtt.Publish("a/b", b"x" * 40, 1, packet_id=1),
        mqtt.Publish("", b"hi", 0, properties={"topic_alias": 3}),
        mqtt.Publish("t", b"", 2, True, True, 9, {"content_type": "c",
                                                  "user_property": [("k", "v")]}),
        mqtt.Puback(1, 0x10, {"reason_string": "r"}), mqtt.Pubrec(4, 0x80), mqtt.Pubrel(2),
        mqtt.Pubcomp(5, 0x92), mqtt.Pingreq(),
        mqtt.Subscribe(3, [("a/#", mqtt.SubscriptionOptions(1))]),
        mqtt.Disconnect(0x04, {"session_expiry_interval": 5}),
    ]
    seeds = []
    for version in (4, 5):
        wire = b"".join(mqtt.encode(p, version) for p in packets
                        if version == 5 or not (getattr(p, "properties", None)
                                                or getattr(p, "reason_code", 0)))
        seeds += [bytes((mode | (version == 5), 7)) + wire for mode in (0, 2, 6)]
    return seeds


def test_native_codec_agrees_under_coverage_guided_fuzzing(tmp_path: Path) -> None:
    run_fuzzer(FUZZER, RUNS, tmp_path, "-max_len=1024", seeds=_seeds())
