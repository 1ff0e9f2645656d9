"""What each native-protocol request needs to be allowed (ACL 2.0 covers every API).

- Server apps: SEND needs PUB on the first-level topic and on any MQTT topic it
  addresses; PULL/QUEUE_* need SUB (or GET) on the queue's topic, and PULL hands out
  only the messages whose own topic the reader may SUB (or GET); HISTORY needs SUB (or
  GET) on the whole filter, as an MQTT SUBSCRIBE does, and hands out only the messages
  whose own topic the reader may read, with PULL's check; consumer groups need SUB on
  the group (NACK also the right to pull the message it names); TOPIC_CREATE needs
  CREATE; STATS, message lookup, gateway lists need Cluster GET, and a lookup
  (GET_MESSAGE, FIND_KEY) hands out only the messages whose own topic the reader may
  read, with PULL's check.
- Nodes: a gateway authenticates as a node user (`lightgate user add NAME --node`, a role
  no policy grants); that covers the requests only nodes make (PUBLISH routed on behalf
  of devices, whose own rights the gateway checked; metadata, users' included: the
  gateway checks MQTT passwords itself; wildcard registration; gateway heartbeats).
- Store nodes: a replica fetches the master's log (REPL_FETCH) only after proving it
  holds the group secret (a HELLO answering the connection's challenge).
- Users and policies (USER_*, ACL_*, metadata writes to `users`/`acl`): Super only.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightqueue.routing import split_partition_queue
from lightqueue.topic import is_wildcard
from store import protocol as p


@dataclass(frozen=True)
class Need:
    rtype: str
    name: str
    actions: tuple[str, ...]  # any one of them is enough
    is_filter: bool = False


NODE = "node"  # marker: only a node user or a Super user
SUPER = "super"  # marker: only a Super user
STORE_NODE = "store node"  # marker: only a store node of the group (the group secret)

AUTH_CFS = ("users", "acl")
_NODE_CODES = {p.PUBLISH, p.WILDCARD_ADD, p.GATEWAY_HEARTBEAT, p.SHARED_LEASE,
               p.META_GET, p.META_ITEMS}
_SUPER_CODES = {p.USER_ADD, p.USER_UPDATE, p.USER_DELETE, p.USER_LIST, p.ACL_ADD,
                p.ACL_DELETE, p.ACL_LIST}
_CLUSTER_GET = {p.STATS, p.CLUSTER, p.GATEWAY_LIST, p.GET_MESSAGE, p.FIND_KEY}
_GROUP_CODES = {p.COMMIT, p.FETCH_OFFSETS}


def queue_need(queue: str, actions: tuple[str, ...] = ("SUB", "GET")) -> Need:
    """The resource behind a light queue name."""
    for suffix in ("#retry", "#dlq"):
        if queue.endswith(suffix):
            return Need("Group", queue[: -len(suffix)], ("SUB",))
    part = split_partition_queue(queue)
    if part is not None:
        return Need("Topic", part[0], actions)
    return Need("Topic", queue, actions, is_wildcard(queue))


def message_need(topic: str) -> Need:
    """What reading one message needs, whatever queue it came from: a wildcard or
    partition queue holds topics that the right on the queue's name may not cover
    (Allow home/# with Deny home/secret)."""
    return Need("Topic", topic, ("SUB", "GET"))


def needs(frame: p.Frame, mqtt_topics: list[str] | None = None) -> list[Need] | str:
    """The rights `frame` needs: a list of Need (all required), NODE, SUPER or
    STORE_NODE."""
    code, h = frame.code, frame.header
    if code in _SUPER_CODES:
        return SUPER
    if code == p.REPL_FETCH:
        return STORE_NODE
    if code in (p.META_PUT, p.META_DELETE, p.META_WRITE):
        cfs = [str(op[1]) for op in h.get("ops", [])] if code == p.META_WRITE else [h.get("cf")]
        return SUPER if any(cf in AUTH_CFS for cf in cfs) else NODE
    if code in _NODE_CODES:
        return NODE
    if code in _CLUSTER_GET:
        return [Need("Cluster", "", ("GET",))]
    if code == p.SEND:
        topic = str(h.get("topic", ""))
        out = [Need("Topic", topic, ("PUB",))]
        out += [Need("Topic", t, ("PUB",)) for t in set(mqtt_topics or ()) if t != topic]
        return out
    if code == p.HISTORY:
        topic_filter = str(h.get("filter", ""))
        return [Need("Topic", topic_filter, ("SUB", "GET"), is_wildcard(topic_filter))]
    if code in (p.PULL, p.QUEUE_RANGE, p.QUEUE_TAIL, p.QUEUE_SEEK):
        return [queue_need(str(h.get("queue", "")))]
    if code == p.QUEUE_ENDS:
        return [queue_need(str(q)) for q in h.get("queues", [])]
    if code == p.HEARTBEAT:
        return [Need("Group", str(h.get("group", "")), ("SUB",)),
                Need("Topic", str(h.get("topic", "")), ("SUB",))]
    if code in _GROUP_CODES:
        return [Need("Group", str(h.get("group", "")), ("SUB",))]
    if code == p.NACK:  # and the message's own topic, checked by the handler
        return [Need("Group", str(h.get("group", "")), ("SUB",)),
                queue_need(str(h.get("queue", "")))]
    if code == p.TOPIC_CREATE:
        return [Need("Topic", str(h.get("topic", "")), ("CREATE",))]
    if code == p.TOPIC_DESCRIBE:
        return [Need("Topic", str(h.get("topic", "")), ("SUB", "GET"))]
    if code == p.TOPIC_LIST:
        return []  # filtered per topic by the handler
    if code == p.PRODUCER_INIT:
        return []  # any user: the id is theirs alone, its SENDs need PUB (--max-producers)
    return NODE  # anything new is closed until someone decides otherwise
