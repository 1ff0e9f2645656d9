"""What a bridge to Lightgate relies on, over a raw socket: the bridge bit of a
try_private CONNECT."""

from __future__ import annotations

import pytest

from gateway import mqtt

# -- try_private: a CONNECT with the bridge bit ---------------------------------------------


def test_bridge_bit_round_trips_through_the_codec() -> None:
    for level in (3, 4):
        data = mqtt.encode(mqtt.Connect("edge", level, bridge=True), level)
        assert data[2 + 2 + len(mqtt.PROTOCOL_NAMES[level])] == mqtt.BRIDGE_BIT | level
        [p] = mqtt.Decoder().feed(data)
        assert isinstance(p, mqtt.Connect) and p.bridge and p.protocol_level == level
        [plain] = mqtt.Decoder().feed(mqtt.encode(mqtt.Connect("edge", level), level))
        assert not plain.bridge
    with pytest.raises(ValueError):
        mqtt.encode(mqtt.Connect("edge", 5, bridge=True), 5)
    v5 = bytearray(mqtt.encode(mqtt.Connect("edge", 5), 5))
    v5[8] |= mqtt.BRIDGE_BIT  # 0x85: no such thing; 5.0 has subscription options for it
    with pytest.raises(mqtt.UnsupportedProtocolError):
        mqtt.Decoder().feed(bytes(v5))
