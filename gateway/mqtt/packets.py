"""MQTT control packets as plain slotted dataclasses, one per packet type.

The same classes serve 3.1 (level 3), 3.1.1 (level 4) and 5.0 (level 5): fields that only
exist in v5 (properties, most reason codes) are simply left at their defaults for v3/v4.
They are mutable ``slots=True`` dataclasses rather than frozen ones because frozen
dataclasses pay for ``object.__setattr__`` on every construction, and a broker builds
millions of Publish objects. Treat them as values anyway.

`properties` is a dict keyed by snake_case property names; see ``properties.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

Properties = dict[str, Any]

# Standard protocol name for each supported protocol level.
PROTOCOL_NAMES: dict[int, str] = {3: "MQIsdp", 4: "MQTT", 5: "MQTT"}

# Set on the protocol level byte by a broker bridging to us ("try_private" in Mosquitto:
# 0x83 for 3.1, 0x84 for 3.1.1). MQTT 5 needs no such bit: its subscription options say
# No Local and Retain As Published themselves.
BRIDGE_BIT = 0x80


@dataclass(slots=True)
class Will:
    topic: str
    payload: bytes = b""
    qos: int = 0
    retain: bool = False
    properties: Properties = field(default_factory=dict)


@dataclass(slots=True)
class Connect:
    TYPE: ClassVar[int] = 1
    client_id: str = ""
    protocol_level: int = 4
    protocol_name: str = ""  # "" means the standard name for protocol_level
    clean_start: bool = True  # "clean session" in 3.1/3.1.1
    keepalive: int = 60
    username: str | None = None
    password: bytes | None = None
    will: Will | None = None
    properties: Properties = field(default_factory=dict)
    bridge: bool = False  # a 3.1/3.1.1 CONNECT with BRIDGE_BIT: a broker bridging to us

    def __post_init__(self) -> None:
        if not self.protocol_name:
            self.protocol_name = PROTOCOL_NAMES.get(self.protocol_level, "MQTT")


@dataclass(slots=True)
class Connack:
    TYPE: ClassVar[int] = 2
    session_present: bool = False
    reason_code: int = 0  # v5 reason code, or the 3.1/3.1.1 return code (0..5)
    properties: Properties = field(default_factory=dict)

    @property
    def return_code(self) -> int:
        """Alias of `reason_code` under its 3.1.1 name."""
        return self.reason_code


@dataclass(slots=True)
class Publish:
    TYPE: ClassVar[int] = 3
    topic: str
    payload: bytes = b""
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int | None = None  # None exactly when qos == 0
    properties: Properties = field(default_factory=dict)


@dataclass(slots=True)
class Puback:
    TYPE: ClassVar[int] = 4
    packet_id: int
    reason_code: int = 0
    properties: Properties = field(default_factory=dict)


@dataclass(slots=True)
class Pubrec:
    TYPE: ClassVar[int] = 5
    packet_id: int
    reason_code: int = 0
    properties: Properties = field(default_factory=dict)


@dataclass(slots=True)
class Pubrel:
    TYPE: ClassVar[int] = 6
    packet_id: int
    reason_code: int = 0
    properties: Properties = field(default_factory=dict)


@dataclass(slots=True)
class Pubcomp:
    TYPE: ClassVar[int] = 7
    packet_id: int
    reason_code: int = 0
    properties: Properties = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SubscriptionOptions:
    """Per-filter options; only `qos` exists before v5."""

    qos: int = 0
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0  # 0 send retained, 1 only on new subscription, 2 never


@dataclass(slots=True)
class Subscribe:
    TYPE: ClassVar[int] = 8
    packet_id: int
    subscriptions: list[tuple[str, SubscriptionOptions]]
    properties: Properties = field(default_factory=dict)


@dataclass(slots=True)
class Suback:
    TYPE: ClassVar[int] = 9
    packet_id: int
    reason_codes: list[int]  # one per filter; 3.1.1 return codes are 0, 1, 2, 0x80
    properties: Properties = field(default_factory=dict)


@dataclass(slots=True)
class Unsubscribe:
    TYPE: ClassVar[int] = 10
    packet_id: int
    filters: list[str]
    properties: Properties = field(default_factory=dict)


@dataclass(slots=True)
class Unsuback:
    TYPE: ClassVar[int] = 11
    packet_id: int
    reason_codes: list[int] = field(default_factory=list)  # v5 only; ignored for v3/v4
    properties: Properties = field(default_factory=dict)


@dataclass(slots=True)
class Pingreq:
    TYPE: ClassVar[int] = 12


@dataclass(slots=True)
class Pingresp:
    TYPE: ClassVar[int] = 13


@dataclass(slots=True)
class Disconnect:
    TYPE: ClassVar[int] = 14
    reason_code: int = 0  # v5 only
    properties: Properties = field(default_factory=dict)


@dataclass(slots=True)
class Auth:
    """v5 only (enhanced authentication)."""

    TYPE: ClassVar[int] = 15
    reason_code: int = 0
    properties: Properties = field(default_factory=dict)


Packet = (
    Connect | Connack | Publish | Puback | Pubrec | Pubrel | Pubcomp | Subscribe | Suback
    | Unsubscribe | Unsuback | Pingreq | Pingresp | Disconnect | Auth
)
