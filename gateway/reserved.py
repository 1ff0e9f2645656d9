"""Topics starting with `$` belong to the server (MQTT §4.7.2); which ones a client may
write anyway, as a publish or as its will.

Bridges need one kind: an edge broker's bridge publishes its state, retained, on
`$SYS/broker/connection/<client id>/state` ("0" as the will of its CONNECT, "1" once
connected; Mosquitto's `notifications true`, its default). Mosquitto accepts client
writes on exactly those `$SYS` topics; EMQX leaves `$` topics to its ACL. Here:

- without --auth (no policies to ask): BRIDGE_STATE topics, and no other `$` topic;
  `$SYS/broker/...` holds the broker's own statistics;
- with --auth the policies decide, as for any topic. `#` and `+` do not match a topic
  starting with `$`, so only a grant naming one (`Topic:$SYS/broker/connection/#`, or
  a Super user's every right) lets a client write there;
- `$share/...` never: it is a shared subscription's filter, not a topic.
"""

from __future__ import annotations

from gateway.session import SHARE_PREFIX
from lightqueue.topic import matches

BRIDGE_STATE = "$SYS/broker/connection/+/state"
SERVER_ID = "$SYS"  # the client id the broker publishes its own $SYS values with
_STATISTICS = "$SYS/broker/"


def refusal(topic: str, policies: bool) -> str | None:
    """Why no client may publish on `topic` or name it as its will before any policy is
    asked, or None. `policies`: whether policies decide (--auth)."""
    if not topic.startswith("$"):
        return None
    if topic.startswith(SHARE_PREFIX):
        return "is a shared subscription filter, not a topic"
    if policies or matches(BRIDGE_STATE, topic):
        return None
    return "reserved for the server"


def is_broker_statistic(topic: str, client_id: str) -> bool:
    """One of the values the broker publishes about itself: a fixed set. A client's
    write on a `$` topic (a bridge's state) is not one: it counts like any other."""
    return (client_id == SERVER_ID and topic.startswith(_STATISTICS)
            and not matches(BRIDGE_STATE, topic))
