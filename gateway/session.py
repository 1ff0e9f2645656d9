"""MQTT session state: what survives a disconnect, and how it is kept in the store.

Metadata layout (column family: key -> value):
    sessions:      client_id -> {"version", "expiry", "disconnected_at"}
    subscriptions: client_id NUL filter -> {"qos", "nl", "rap", "rh", "sid"}
    offsets:       "mqtt" NUL client_id NUL queue -> {"acked": first unacknowledged offset,
                                                      "next": first offset not yet sent,
                                                      "replay": a replay's progress, while
                                                      it lasts (gateway.replay)}
    inflight:      client_id NUL "out" NUL packet_id -> {"queue", "offset", "state"}
                   client_id NUL "outs" NUL batch -> {"runs": [[first packet_id, queue,
                   first offset, count], ...], "qos"} (a batch of the native plane's
                   sends, one record for the batch, in runs of consecutive packet ids
                   and offsets; rewritten as "out" records when the session is loaded
                   or handed back to Python: gateway.handover)
                   client_id NUL "in" NUL packet_id -> {"phys"}   (QoS 2 stored, awaiting
                   PUBREL; the record's position) or {"done": phys} (released: a later DUP
                   of this packet id is a duplicate only if a newer record has its key)
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

import trio

from gateway.mqtt import SubscriptionOptions, Will
from gateway.mqtt.protocol import NEVER_EXPIRES, Outgoing
from lightqueue.since import REPLAY_PREFIX, SinceError, split_replay
from lightqueue.trie import TopicTrie
from store.api import Message, Subject

if TYPE_CHECKING:  # the replay's state refers to its session: a name only, no import
    from gateway.replay_state import Replay

NUL = "\x00"
SHARE_PREFIX = "$share/"


class Group(Protocol):
    """A shared group a session is in (gateway.shared.SharedGroup)."""

    queue: str

    @property
    def name(self) -> str: ...  # $share/{group}/{filter}

    def wake(self) -> None: ...

    def acked(self, offset: int) -> None: ...

    def take_back(self, msg: Message) -> None: ...


class Client(Protocol):
    """A session's live connection, as the broker, the admin API and the session's
    shared groups talk to it (gateway.connection.Connection)."""

    peer: str
    alive: bool
    subject: Subject | None  # who authenticated on it
    connected_at: float | None

    @property
    def keepalive(self) -> int: ...

    def kick(self, why: str = ..., not_authorized: bool = False) -> None:
        """Close it with a DISCONNECT saying so (v5)."""

    async def take_over(self) -> None:
        """A new connection claims the client id: close, and return once detached."""

    def auth_changed(self) -> None:
        """Users or policies changed: decisions it cached no longer hold."""

    def drain_now(self, queue: str) -> bool:
        """`queue` grew: deliver from it (right here when it can). False: nothing
        delivers yet (before CONNACK), the session keeps the news."""
        ...

    def has_window(self) -> bool: ...

    async def push_shared(self, group: Group, msg: Message, buffered: bool = False
                          ) -> bool: ...

    async def flush_out(self) -> None: ...


def parse_shared(topic_filter: str) -> tuple[str, str] | None:
    """('group', 'a/+') for '$share/group/a/+'; None for an ordinary filter.

    Here, not in shared.py: a Subscription needs it to restore itself, and shared.py
    builds on Session, so the parsing lives with the lower of the two."""
    if not topic_filter.startswith(SHARE_PREFIX):
        return None
    group, sep, real = topic_filter[len(SHARE_PREFIX):].partition("/")
    if not group or not sep or not real or "+" in group or "#" in group:
        raise ValueError(f"invalid shared subscription {topic_filter!r}")
    return group, real


def parse_replay(topic_filter: str) -> tuple[str, str] | None:
    """('-1h', 'plant/#') for '$replay/-1h/plant/#'; None for any other filter. Raises
    ValueError (a SinceError) when it starts so but is not one (the since is not parsed
    here: gateway.replay does, against a clock)."""
    return split_replay(topic_filter) if topic_filter.startswith(REPLAY_PREFIX) else None


def subscription_key(topic_filter: str) -> str:
    """Where a subscription sits in Session.subscriptions: the queue it reads (so a
    session reads each filter once, `F` or `$replay/<since>/F`), or a shared
    subscription's whole filter (its group reads the queue, not the session)."""
    if topic_filter.startswith(REPLAY_PREFIX):
        try:
            return split_replay(topic_filter)[1]
        except SinceError:
            return topic_filter
    return topic_filter


@dataclass(slots=True)
class Subscription:
    topic_filter: str  # as subscribed, '$share/{group}/{filter}' for a shared one
    options: SubscriptionOptions
    subscription_id: int | None = None
    shared: tuple[str, str] | None = None  # (group, filter) of a shared subscription
    replay: tuple[str, str] | None = None  # (since, filter) of '$replay/{since}/{filter}'

    @property
    def queue(self) -> str:
        # A subscription reads the light queue named by its filter: the exact-topic queue
        # for a plain topic, the wildcard queue for a wildcard filter.
        if self.shared:
            return self.shared[1]
        return self.replay[1] if self.replay else self.topic_filter

    @property
    def key(self) -> str:
        """Its place in Session.subscriptions (see subscription_key)."""
        return self.topic_filter if self.shared else self.queue

    def to_meta(self) -> dict[str, Any]:
        o = self.options
        return {"qos": o.qos, "nl": o.no_local, "rap": o.retain_as_published,
                "rh": o.retain_handling, "sid": self.subscription_id}

    @classmethod
    def from_meta(cls, topic_filter: str, d: dict[str, Any]) -> Subscription:
        opts = SubscriptionOptions(d["qos"], d.get("nl", False), d.get("rap", False),
                                   d.get("rh", 0))
        return cls(topic_filter, opts, d.get("sid"), parse_shared(topic_filter),
                   parse_replay(topic_filter))


NONE_YET: Mapping[str, Subscription] = MappingProxyType({})  # a session's subscriptions


@dataclass(eq=False, slots=True)  # identity: sessions live in sets; slots: 100k of them
class Session:
    """The containers a session may never use (an idle device subscribes to nothing and
    has nothing in flight) are made on first use, behind the properties below: made
    eagerly they were 1.9 kB and ten objects the garbage collector walks, per device."""

    client_id: str
    persistent: bool
    version: int = 4
    expiry: int = 0  # seconds after disconnect (v5); persistent 3.1.1 sessions: NEVER
    # Read-only and shared while there are none (most devices subscribe to nothing);
    # a dict of its own from the first `add_subscription` on.
    subscriptions: Mapping[str, Subscription] = field(default_factory=lambda: NONE_YET)
    will: Will | None = None
    connection: Client | None = None  # None while offline
    disconnected_at: float | None = None
    wakeup: trio.Event | None = None  # the delivery task's, while it waits (gateway.delivery)
    next_packet_id: int = 1
    _trie: TopicTrie[str] | None = None
    _cursors: dict[str, int] | None = None  # queue -> next offset to send
    _outgoing: OrderedDict[int, Outgoing] | None = None
    _incoming_qos2: set[int] | None = None
    _incoming_phys: dict[int, int] | None = None  # pid -> its record's phys
    _dirty: set[str] | None = None  # queues with news since the last look
    _recent: OrderedDict[int, None] | None = None  # delivered phys offsets
    _offsets_dirty: set[str] | None = None
    # queue -> highest offset in flight when the session was restored from the store. A
    # resume reads from the first unacked offset; everything up to here was either
    # acknowledged or is being resent with DUP, so it is not sent again.
    _restored_upto: dict[str, int] | None = None
    _groups: set[Group] | None = None  # shared groups this session is in
    _replays: dict[str, Replay] | None = None  # queue -> a replay under way (gateway.replay)
    # Who made it, with auth on ("backend:name"): only they resume it. None: a session
    # stored before sessions had owners (the first to resume it claims it), or auth off.
    owner: str | None = None
    # The token its connection's open wrote to its record in the store (a gateway of
    # several: gateway.takeover); None otherwise.
    claim: str | None = None

    def has_state(self) -> bool:
        """Subscriptions, messages in flight or shared groups: a delivery task is due."""
        return bool(self.subscriptions or self._outgoing or self._groups)

    def has_dirty_offsets(self) -> bool:
        return bool(self._offsets_dirty)

    @property
    def trie(self) -> TopicTrie[str]:
        if self._trie is None:
            self._trie = TopicTrie()
        return self._trie

    @property
    def cursors(self) -> dict[str, int]:
        if self._cursors is None:
            self._cursors = {}
        return self._cursors

    @property
    def outgoing(self) -> OrderedDict[int, Outgoing]:
        if self._outgoing is None:
            self._outgoing = OrderedDict()
        return self._outgoing

    def in_flight(self) -> int:
        return 0 if self._outgoing is None else len(self._outgoing)

    @property
    def incoming_qos2(self) -> set[int]:
        if self._incoming_qos2 is None:
            self._incoming_qos2 = set()
        return self._incoming_qos2

    @property
    def incoming_phys(self) -> dict[int, int]:
        if self._incoming_phys is None:
            self._incoming_phys = {}
        return self._incoming_phys

    @property
    def dirty(self) -> set[str]:
        if self._dirty is None:
            self._dirty = set()
        return self._dirty

    @property
    def recent(self) -> OrderedDict[int, None]:
        if self._recent is None:
            self._recent = OrderedDict()
        return self._recent

    @property
    def offsets_dirty(self) -> set[str]:
        if self._offsets_dirty is None:
            self._offsets_dirty = set()
        return self._offsets_dirty

    @property
    def restored_upto(self) -> dict[str, int]:
        if self._restored_upto is None:
            self._restored_upto = {}
        return self._restored_upto

    @property
    def groups(self) -> set[Group]:
        if self._groups is None:
            self._groups = set()
        return self._groups

    @property
    def replays(self) -> dict[str, Replay]:
        if self._replays is None:
            self._replays = {}
        return self._replays

    # -- subscriptions ----------------------------------------------------------------
    def add_subscription(self, sub: Subscription) -> bool:
        """True if new (a replaced subscription keeps its queue position)."""
        key = sub.key
        subs = self.subscriptions
        if type(subs) is not dict:
            subs = self.subscriptions = {}
        new = key not in subs
        subs[key] = sub
        if sub.shared is None:  # shared ones are read by their group, not the session
            self.trie.add(key, key)
        return new

    def subscription(self, topic_filter: str) -> Subscription | None:
        """The subscription made with exactly this filter, if any."""
        sub = self.subscriptions.get(subscription_key(topic_filter))
        return sub if sub is not None and sub.topic_filter == topic_filter else None

    def remove_subscription(self, topic_filter: str) -> bool:
        sub = self.subscription(topic_filter)
        if sub is None:
            return False
        key = sub.key
        subs = self.subscriptions
        assert type(subs) is dict
        del subs[key]
        if not subs:
            self.subscriptions = NONE_YET
        if sub.shared is None:
            self.trie.remove(key, key)
            self.cursors.pop(sub.queue, None)
            self.dirty.discard(sub.queue)
            if self._replays:
                self._replays.pop(sub.queue, None)
        return True

    def reading(self) -> list[str]:
        """Queues this session reads itself (every subscription but shared ones)."""
        return [sub.queue for sub in self.subscriptions.values() if sub.shared is None]

    def matching(self, topic: str) -> list[Subscription]:
        return [self.subscriptions[f] for f in self.trie.match(topic) if f in self.subscriptions]

    def readers(self, queue: str, topic: str) -> list[Subscription]:
        """The subscriptions a message of `queue` on `topic` is for. The common case, one
        subscription, needs no trie walk: a message of its queue matches it by construction
        (subscriptions are keyed by the queue they read)."""
        if len(self.subscriptions) == 1:
            sub = self.subscriptions.get(queue)
            if sub is not None and sub.shared is None:
                return [sub]
        return self.matching(topic)

    # -- delivery bookkeeping ---------------------------------------------------------
    def notify(self, queue: str) -> None:
        self.dirty.add(queue)
        if self.wakeup is not None:
            self.wakeup.set()

    def take_dirty(self) -> set[str]:
        dirty, self._dirty = self._dirty, None
        self.wakeup = None
        return dirty if dirty is not None else set()

    def seen(self, phys_offset: int) -> bool:
        """Remember a delivered message; True if it was delivered already (overlapping
        subscriptions put one message in several queues: one copy goes out)."""
        if phys_offset in self.recent:
            return True
        self.recent[phys_offset] = None
        if len(self.recent) > 10_000:
            self.recent.popitem(last=False)
        return False

    def allocate_packet_id(self) -> int:
        for _ in range(65535):
            pid = self.next_packet_id
            self.next_packet_id = pid % 65535 + 1
            if pid not in self.outgoing:
                return pid
        raise RuntimeError("no free packet id")  # the in-flight window prevents this

    def acked_offset(self, queue: str) -> int | None:
        """Lowest offset of `queue` not yet acknowledged: where a resume starts."""
        pending = [o.offset for o in self.outgoing.values() if o.queue == queue]
        if pending:
            return min(pending)
        return self.cursors.get(queue)

    def expired(self, now: float | None = None) -> bool:
        if self.connection is not None or self.disconnected_at is None:
            return False
        if self.expiry == NEVER_EXPIRES:
            return False
        return (now or time.time()) - self.disconnected_at >= self.expiry


def sub_key(client_id: str, topic_filter: str) -> str:
    return f"{client_id}{NUL}{topic_filter}"


def offset_key(client_id: str, queue: str) -> str:
    return f"mqtt{NUL}{client_id}{NUL}{queue}"


def out_key(client_id: str, packet_id: int) -> str:
    return f"{client_id}{NUL}out{NUL}{packet_id:05d}"


def batch_key(client_id: str, batch: int) -> str:
    """The record of a batch of sends the native plane made (gateway.handover): its
    sends' packet ids and positions, one record for the batch."""
    return f"{client_id}{NUL}outs{NUL}{batch:020d}"


def batch_prefix(client_id: str) -> str:
    return f"{client_id}{NUL}outs{NUL}"


def in_key(client_id: str, packet_id: int) -> str:
    return f"{client_id}{NUL}in{NUL}{packet_id:05d}"


def qos2_key(client_id: str, packet_id: int) -> str:
    """The record key of a persistent session's QoS 2 publish: the store indexes it, so
    the packet id is durable with the append itself (client ids hold no NUL, the index's
    separator; the packet id is what follows the last "/")."""
    return f"mqtt-qos2/{client_id}/{packet_id}"
