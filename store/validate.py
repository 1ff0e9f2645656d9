"""What a message from a native client must be before it is stored.

The MQTT gateway validates what devices send with its codec; messages that server apps
send over the native port reach the same subscribers, so they get the same rules here
(the store may not import the gateway). A stored message that no PUBLISH can carry would
otherwise be refused by every subscriber's encoder, on every reconnect.
"""

from __future__ import annotations

from typing import Any

from lightqueue.topic import validate_topic_name
from store.record import Message

U32_MAX = 0xFFFF_FFFF

# MQTT 5 PUBLISH properties a stored message may carry (topic_alias and
# subscription_identifier are per connection and per subscriber, never stored).
PUBLISH_PROPERTIES = {
    "payload_format_indicator", "message_expiry_interval", "content_type",
    "response_topic", "correlation_data", "user_property",
}
# Every other MQTT 5 property name (§2.2.2.2): none of them belongs on a message.
OTHER_MQTT_PROPERTIES = {
    "topic_alias", "subscription_identifier", "session_expiry_interval",
    "assigned_client_identifier", "server_keep_alive", "authentication_method",
    "authentication_data", "request_problem_information", "will_delay_interval",
    "request_response_information", "response_information", "server_reference",
    "reason_string", "receive_maximum", "topic_alias_maximum", "maximum_qos",
    "retain_available", "maximum_packet_size", "wildcard_subscription_available",
    "subscription_identifier_available", "shared_subscription_available",
}


def validate_message(m: Message, mqtt: bool) -> None:
    """Raise ValueError unless `m` can be stored; `mqtt`: it goes to MQTT subscribers, so
    the MQTT properties it names must be PUBLISH properties with valid values. Any other
    name is the application's own; MQTT 5 subscribers get those as user properties."""
    if type(m.qos) is not int or m.qos not in (0, 1, 2):
        raise ValueError(f"qos must be 0, 1 or 2, not {m.qos!r}")
    if not isinstance(m.retain, bool):
        raise ValueError(f"retain must be true or false, not {m.retain!r}")
    if not isinstance(m.properties, dict) or not all(isinstance(k, str) for k in m.properties):
        raise ValueError("properties must be an object with string keys")
    if mqtt:
        for name, value in m.properties.items():
            _check_property(name, value)


def _check_property(name: str, value: Any) -> None:
    if name in OTHER_MQTT_PROPERTIES:
        raise ValueError(f"property {name!r} cannot be carried by an MQTT PUBLISH")
    if name not in PUBLISH_PROPERTIES:
        return  # the application's own
    ok = True
    if name == "payload_format_indicator":
        ok = type(value) is int and value in (0, 1)
    elif name == "message_expiry_interval":
        ok = type(value) is int and 0 <= value <= U32_MAX
    elif name == "content_type":
        ok = isinstance(value, str)
    elif name == "response_topic":
        ok = isinstance(value, str)
        if ok:
            validate_topic_name(value)
    elif name == "correlation_data":
        ok = isinstance(value, bytes)
    elif name == "user_property":
        ok = isinstance(value, list | tuple) and all(
            isinstance(pair, list | tuple) and len(pair) == 2
            and all(isinstance(x, str) for x in pair) for pair in value)
    if not ok:
        raise ValueError(f"property {name!r} has an invalid value {value!r}")
