"""MQTT reason codes (5.0 §2.4) and 3.1/3.1.1 CONNACK return codes, plus the codec's errors.

Plain ints rather than an IntEnum: reason codes are compared and packed on the hot path,
and an enum member costs an attribute lookup and a conversion every time.
"""

from __future__ import annotations

# --- MQTT 5.0 reason codes (names as in the spec, upper snake case) ---
SUCCESS = 0x00
NORMAL_DISCONNECTION = 0x00
GRANTED_QOS_0 = 0x00
GRANTED_QOS_1 = 0x01
GRANTED_QOS_2 = 0x02
DISCONNECT_WITH_WILL_MESSAGE = 0x04
NO_MATCHING_SUBSCRIBERS = 0x10
NO_SUBSCRIPTION_EXISTED = 0x11
CONTINUE_AUTHENTICATION = 0x18
RE_AUTHENTICATE = 0x19
UNSPECIFIED_ERROR = 0x80
MALFORMED_PACKET = 0x81
PROTOCOL_ERROR = 0x82
IMPLEMENTATION_SPECIFIC_ERROR = 0x83
UNSUPPORTED_PROTOCOL_VERSION = 0x84
CLIENT_IDENTIFIER_NOT_VALID = 0x85
BAD_USER_NAME_OR_PASSWORD = 0x86
NOT_AUTHORIZED = 0x87
SERVER_UNAVAILABLE = 0x88
SERVER_BUSY = 0x89
BANNED = 0x8A
SERVER_SHUTTING_DOWN = 0x8B
BAD_AUTHENTICATION_METHOD = 0x8C
KEEP_ALIVE_TIMEOUT = 0x8D
SESSION_TAKEN_OVER = 0x8E
TOPIC_FILTER_INVALID = 0x8F
TOPIC_NAME_INVALID = 0x90
PACKET_IDENTIFIER_IN_USE = 0x91
PACKET_IDENTIFIER_NOT_FOUND = 0x92
RECEIVE_MAXIMUM_EXCEEDED = 0x93
TOPIC_ALIAS_INVALID = 0x94
PACKET_TOO_LARGE = 0x95
MESSAGE_RATE_TOO_HIGH = 0x96
QUOTA_EXCEEDED = 0x97
ADMINISTRATIVE_ACTION = 0x98
PAYLOAD_FORMAT_INVALID = 0x99
RETAIN_NOT_SUPPORTED = 0x9A
QOS_NOT_SUPPORTED = 0x9B
USE_ANOTHER_SERVER = 0x9C
SERVER_MOVED = 0x9D
SHARED_SUBSCRIPTIONS_NOT_SUPPORTED = 0x9E
CONNECTION_RATE_EXCEEDED = 0x9F
MAXIMUM_CONNECT_TIME = 0xA0
SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED = 0xA1
WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED = 0xA2

# For logs and error messages; 0x00 has several spec names, "SUCCESS" is the generic one.
REASON_NAMES: dict[int, str] = {
    value: name
    for name, value in reversed(list(globals().items()))
    if name.isupper() and isinstance(value, int)
}
REASON_NAMES[0x00] = "SUCCESS"

# --- Which v5 reason codes each packet type may carry (5.0 §3.x.2.1) ---
CONNACK_REASONS = frozenset(
    {0x00, 0x80, 0x81, 0x82, 0x83, 0x84, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8A, 0x8C, 0x90,
     0x95, 0x97, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9F}
)
PUBACK_REASONS = frozenset({0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99})  # and PUBREC
PUBREL_REASONS = frozenset({0x00, 0x92})  # and PUBCOMP
SUBACK_REASONS = frozenset(
    {0x00, 0x01, 0x02, 0x80, 0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1, 0xA2}
)
UNSUBACK_REASONS = frozenset({0x00, 0x11, 0x80, 0x83, 0x87, 0x8F, 0x91})
DISCONNECT_REASONS = frozenset(
    {0x00, 0x04, 0x80, 0x81, 0x82, 0x83, 0x87, 0x89, 0x8B, 0x8D, 0x8E, 0x8F, 0x90, 0x93, 0x94,
     0x95, 0x96, 0x97, 0x98, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9E, 0x9F, 0xA0, 0xA1, 0xA2}
)
AUTH_REASONS = frozenset({0x00, 0x18, 0x19})

# 3.1/3.1.1 SUBACK return codes (0x80 = failure, added in 3.1.1; accepted for 3.1 too).
SUBACK_V3_RETURN_CODES = frozenset({0x00, 0x01, 0x02, 0x80})
SUBACK_FAILURE = 0x80

# --- MQTT 3.1 / 3.1.1 CONNACK return codes (3.1.1 §3.2.2.3) ---
CONNACK_ACCEPTED = 0
CONNACK_UNACCEPTABLE_PROTOCOL_VERSION = 1
CONNACK_IDENTIFIER_REJECTED = 2
CONNACK_SERVER_UNAVAILABLE = 3
CONNACK_BAD_USERNAME_OR_PASSWORD = 4
CONNACK_NOT_AUTHORIZED = 5
CONNACK_V3_RETURN_CODES = frozenset(range(6))

_V5_TO_V3_CONNACK = {
    SUCCESS: CONNACK_ACCEPTED,
    UNSUPPORTED_PROTOCOL_VERSION: CONNACK_UNACCEPTABLE_PROTOCOL_VERSION,
    CLIENT_IDENTIFIER_NOT_VALID: CONNACK_IDENTIFIER_REJECTED,
    BAD_USER_NAME_OR_PASSWORD: CONNACK_BAD_USERNAME_OR_PASSWORD,
    BAD_AUTHENTICATION_METHOD: CONNACK_BAD_USERNAME_OR_PASSWORD,
    NOT_AUTHORIZED: CONNACK_NOT_AUTHORIZED,
    BANNED: CONNACK_NOT_AUTHORIZED,
}


def connack_v5_to_v3(reason_code: int) -> int:
    """The nearest 3.1/3.1.1 CONNACK return code for a v5 CONNACK reason code.

    Anything without a closer match (server busy, quota, malformed, ...) becomes
    "server unavailable" (3), the only generic refusal 3.1.1 has.
    """
    return _V5_TO_V3_CONNACK.get(reason_code, CONNACK_SERVER_UNAVAILABLE)


class ProtocolError(Exception):
    """The peer broke the protocol. `reason_code` is the v5 reason code to report.

    A v5 server sends it in CONNACK (before the session exists) or DISCONNECT; a v3/v4
    server just closes the connection. `packets` holds the packets that were decoded
    from the same `feed()` call before the violation (usually empty).
    """

    def __init__(self, reason_code: int, message: str) -> None:
        super().__init__(reason_code, message)
        self.reason_code = reason_code
        self.message = message
        self.packets: list[object] = []

    def __str__(self) -> str:
        name = REASON_NAMES.get(self.reason_code, hex(self.reason_code))
        return f"{name} (0x{self.reason_code:02X}): {self.message}"


class UnsupportedProtocolError(ProtocolError):
    """CONNECT with an unknown protocol name or level.

    The server answers with CONNACK 0x84 if `protocol_level` is 5, else with the 3.1.1
    return code 0x01 (`v3_return_code`), then closes the connection.
    """

    v3_return_code = CONNACK_UNACCEPTABLE_PROTOCOL_VERSION

    def __init__(self, protocol_name: str, protocol_level: int) -> None:
        super().__init__(
            UNSUPPORTED_PROTOCOL_VERSION,
            f"unsupported protocol {protocol_name!r} level {protocol_level}",
        )
        self.protocol_name = protocol_name
        self.protocol_level = protocol_level
