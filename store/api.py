"""The store's one public face: the gateway talks to the store through one async
interface with two implementations, as RocketMQ's broker codes against `MessageStore`.

Other rooms import the store from here only (tests/test_architecture.py holds the
gateway to it): the `Store` protocol and its remote implementation, `RemoteStore` (the
native-protocol client); the message type; the error family; the auth subject and
manager a gateway decides with, and what its own authentication backends answer in
(Credentials, Decision, TopicAcl, the stored SCRAM verifiers); the store's HTTP routes.
No engine: the in-process store (store.service.EmbeddedStore, started by
store.app.store_node) is wired to a gateway on the command line's side
(lightgate/embedded.py), so that a gateway process of the separated mode never loads
RocksDB, the CommitLog or the Raft controller.
The modules behind it import one another directly and may change shape freely.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from store.auth import AUTH_EVENT, AuthConfig, AuthError, AuthManager, Subject
from store.auth.audit import to_file as audit_to_file
from store.auth.backends import ALLOW, DENY, IGNORE, Backend, Credentials, Decision
from store.auth.manager import DecisionCache
from store.auth.passwords import SCRAM_ITERATIONS, SCRAM_METHOD
from store.auth.passwords import parse_verifier as parse_scram_verifier
from store.auth.topic_acl import TopicAcl
from store.client import AuthFailed, NativeClient, RemoteStore
from store.common import (
    FutureLike,
    HistoryBatch,
    PullResult,
    QueueSeek,
    StoreClosedError,
    StoreError,
    StoreFullError,
    StoreUnavailable,
    await_future,
)
from store.http import store_routes, topic_rows
from store.http_auth import auth_app
from store.leases import FENCE_S as LEASE_FENCE_S
from store.leases import LEASE_ASK_S
from store.record import Message, encode_properties

__all__ = [
    "ALLOW", "AUTH_EVENT", "DENY", "IGNORE", "LEASE_ASK_S", "LEASE_FENCE_S",
    "SCRAM_ITERATIONS", "SCRAM_METHOD",
    "AuthConfig", "AuthError", "AuthFailed", "AuthManager", "Backend", "Credentials",
    "Decision", "DecisionCache", "FutureLike", "HistoryBatch", "LocalStore", "Message",
    "NativeClient", "PullResult", "QueueSeek", "RemoteStore", "Store", "StoreClosedError",
    "StoreError", "StoreFullError", "StoreUnavailable", "Subject", "TopicAcl",
    "audit_to_file", "auth_app", "await_future", "encode_properties",
    "parse_scram_verifier", "store_routes", "topic_rows",
]


class Store(Protocol):
    """What the gateway calls on a store, embedded or remote. Errors: StoreError and
    its family (StoreFullError: the disk is full; StoreUnavailable: reconnecting)."""

    # -- appends ---------------------------------------------------------------------
    def publish_start(self, messages: list[Message], *, validated: bool = False
                      ) -> FutureLike:
        """Submit MQTT messages without waiting (appended in submission order); the
        future (see await_future) gives them back stored: offsets, queues, timestamps.
        `validated`: the caller checked every topic name already."""
        ...

    async def publish(self, messages: list[Message]) -> list[Message]: ...

    # -- reads -----------------------------------------------------------------------
    async def pull(self, queue: str, offset: int, max_count: int = 32) -> PullResult: ...

    async def get_message(self, msg_id: str) -> Message:
        """Raises KeyError (or ValueError) when there is no such message."""
        ...

    async def queue_end(self, queue: str) -> int:
        """One past the last entry of `queue`: where a new subscription starts."""
        ...

    async def last_key_offset(self, key: str) -> int | None:
        """The CommitLog position of the newest record stored with `key`, or None."""
        ...

    async def queue_ends(self, queues: Sequence[str]) -> dict[str, int]: ...

    async def queue_tail_start(self, queue: str, start: int, max_bytes: int) -> int:
        """Where a reader at `start` resumes if it may be at most `max_bytes` behind."""
        ...

    # -- replay (store.history) ---------------------------------------------------------
    async def seek_time(self, queue: str, ms: int) -> QueueSeek:
        """The first offset of `queue` stored at or after `ms` (ms since the epoch)."""
        ...

    async def history(self, topic_filter: str, since: Any = "earliest", *,
                      until: str | int | None = None, cursor: str | None = None,
                      max_count: int = 1024, max_bytes: int = 4 << 20) -> HistoryBatch:
        """A batch of the stored messages of every topic `topic_filter` matches, from
        `since` (lightqueue.since: earliest, last, RFC 3339, -15m, epoch ms) to `until`,
        in store order. The first batch fixes the end once every append submitted
        before it is written; pass `cursor` (with the same filter) for the next.
        `ends`: each topic's next offset in its exact-topic queue, for a live reader to
        take over there. ValueError for bad input (filter, since, cursor)."""
        ...

    # -- wildcard queues ---------------------------------------------------------------
    async def add_wildcard(self, topic_filter: str) -> None: ...

    async def add_wildcards(self, filters: Sequence[str]) -> None:
        """Register, or touch, every filter (unused ones are dropped after a while)."""
        ...

    # -- metadata (column family, key) -> JSON-able value ----------------------------
    async def meta_get(self, cf: str, key: str) -> Any: ...

    async def meta_put(self, cf: str, key: str, value: Any) -> None: ...

    async def meta_delete(self, cf: str, key: str) -> None: ...

    async def meta_items(self, cf: str, prefix: str = "", limit: int | None = None
                         ) -> list[tuple[str, Any]]: ...

    async def meta_write(self, ops: Sequence[tuple[str, str, str, Any]]) -> None:
        """Apply ("put"|"delete"|"delete_prefix", cf, key, value) ops atomically."""
        ...

    async def get_stats(self) -> dict[str, Any]: ...

    async def cluster(self) -> dict[str, Any]:
        """The store group's view: {"role", "epoch", ..., "nodes": [{"addr", "role",
        "epoch", "offset", "replicated_offset", "lag_bytes", "insync"}]} (one master row
        for a store that is not in a group)."""
        ...


@runtime_checkable
class LocalStore(Store, Protocol):
    """What the in-process store adds: reads answered without waiting when they can be.
    The gateway's cache uses these when its store is one (isinstance)."""

    def pull_now(self, queue: str, offset: int, max_count: int = 32) -> PullResult | None:
        """`pull` in this thread if it can be answered at once, else None."""
        ...

    async def pull_stored(self, queue: str, offset: int, max_count: int = 32) -> PullResult:
        """`pull` past the ring of recent messages (after `pull_now` said None)."""
        ...
