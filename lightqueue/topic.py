"""MQTT topic names and filters: validation and matching rules (MQTT 3.1.1 §4.7, 5.0 §4.7).

Every check here is linear in the length of its input: no regular expressions, so no
pathological filter can make matching slow (amqtt's ReDoS).
"""

from __future__ import annotations

MAX_TOPIC_BYTES = 65535


class TopicError(ValueError):
    """A topic name or filter that breaks the MQTT rules."""


def _check_common(text: str, what: str) -> None:
    if not text:
        raise TopicError(f"{what} must be at least one character long")
    if "\x00" in text:
        raise TopicError(f"{what} must not contain U+0000")
    if len(text.encode("utf-8", "surrogatepass")) > MAX_TOPIC_BYTES:
        raise TopicError(f"{what} is longer than {MAX_TOPIC_BYTES} bytes")


def validate_topic_name(topic: str) -> str:
    """Return `topic` if it is a valid topic name for PUBLISH, else raise TopicError."""
    _check_common(topic, "topic name")
    if "+" in topic or "#" in topic:
        raise TopicError(f"topic name {topic!r} must not contain wildcards")
    return topic


def validate_topic_filter(topic_filter: str) -> str:
    """Return `topic_filter` if it is a valid subscription filter, else raise TopicError."""
    _check_common(topic_filter, "topic filter")
    levels = topic_filter.split("/")
    last = len(levels) - 1
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != last):
            raise TopicError(f"'#' must be a whole last level in {topic_filter!r}")
        if "+" in level and level != "+":
            raise TopicError(f"'+' must be a whole level in {topic_filter!r}")
    return topic_filter


def is_wildcard(topic_filter: str) -> bool:
    return "+" in topic_filter or "#" in topic_filter


def first_level(topic: str) -> str:
    """The first-level topic ('home' for 'home/bath/temp'), consumed by server apps."""
    return topic.split("/", 1)[0]


def matches(topic_filter: str, topic: str) -> bool:
    """Whether `topic` matches `topic_filter`; `$`-topics never match a leading wildcard."""
    if topic.startswith("$") and topic_filter[:1] in ("+", "#"):
        return False
    f_levels = topic_filter.split("/")
    t_levels = topic.split("/")
    for i, f in enumerate(f_levels):
        if f == "#":
            return True
        if i >= len(t_levels):
            return False
        if f != "+" and f != t_levels[i]:
            return False
    return len(f_levels) == len(t_levels)
