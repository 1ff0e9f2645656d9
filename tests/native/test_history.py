"""HISTORY and QUEUE_SEEK over the native protocol against a real `lightgate serve`: the
remote store gives what the embedded one does, bad input gets a 400 that says why, and
with --auth a reader gets only the topics it may read."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import trio

from store import protocol as p
from store.client import NativeClient, RemoteStore
from store.common import HistoryBatch
from tests.conftest import Server
from tests.mqtt.paho_client import Client
from tests.native.test_protocol import Raw
from tests.security.helpers import add_user, allow, auth_server


def remote(server: Server, fn: Any, creds: tuple[str, str] | None = None) -> Any:
    """Run `fn(store)` against a RemoteStore on `server`; exceptions come back raised."""

    async def call() -> Any:
        async with NativeClient.open(server.native, credentials=creds) as client:
            try:
                return await fn(RemoteStore(client))
            except Exception as exc:  # noqa: BLE001 - returned: a nursery would wrap it
                return exc

    out = trio.run(call)
    if isinstance(out, Exception):
        raise out
    return out


def read_all(server: Server, topic_filter: str, since: str = "earliest", max_count: int = 3,
             creds: tuple[str, str] | None = None, **kw: Any) -> list[HistoryBatch]:
    async def run(store: RemoteStore) -> list[HistoryBatch]:
        batches = [await store.history(topic_filter, since, max_count=max_count, **kw)]
        while not batches[-1].done:
            batches.append(await store.history(topic_filter, cursor=batches[-1].cursor,
                                               max_count=max_count))
        return batches

    return remote(server, run, creds)


@pytest.fixture
def published(server: Server) -> Iterator[tuple[Server, list[int]]]:
    """Devices' messages over three topics, in a known order; the store times between."""
    dev = Client(server.port, "dev-hist")
    marks = []
    for i in range(12):
        dev.publish(f"home/{['bath', 'hall', 'secret'][i % 3]}/temp", b"%d" % i, qos=1)
        if i % 4 == 3:
            time.sleep(0.02)
            marks.append(int(time.time() * 1000))
    dev.publish("garden/t", b"g", qos=1)
    dev.disconnect()
    yield server, marks


def test_history_over_the_wire_in_store_order(published) -> None:
    server, marks = published
    batches = read_all(server, "home/+/temp")
    got = [m for b in batches for m in b.messages]
    assert [m.body for m in got] == [b"%d" % i for i in range(12)]
    assert all(len(b.messages) <= 3 for b in batches) and len(batches) >= 4
    assert got[0].topic == "home/bath/temp" and got[0].qos == 1 and got[0].client_id == "dev-hist"
    assert got[0].queues == [("home/bath/temp", 0)] and got[0].store_ts > 0
    ends: dict[str, int] = {}
    for b in batches:
        ends.update(b.ends)
    assert ends == {"home/bath/temp": 4, "home/hall/temp": 4, "home/secret/temp": 4}
    assert not batches[0].cut
    later = [m.body for b in read_all(server, "home/#", str(marks[1])) for m in b.messages]
    assert later == [b"%d" % i for i in range(8, 12)]
    last = [m.body for b in read_all(server, "#", "last") for m in b.messages]
    assert last == [b"9", b"10", b"11", b"g"]
    until = [m.body for b in read_all(server, "home/#", until=str(marks[0]))
             for m in b.messages]
    assert until == [b"%d" % i for i in range(4)]


def test_seek_by_time_over_the_wire(published) -> None:
    server, marks = published
    seek = remote(server, lambda s: s.seek_time("home/bath/temp", marks[1]))
    assert (seek.offset, seek.min_offset, seek.max_offset, seek.cut) == (3, 0, 4, False)
    assert remote(server, lambda s: s.seek_time("home/bath/temp", 0)).offset == 0
    assert remote(server, lambda s: s.seek_time("nobody/here", 0)).offset == 0


@pytest.mark.parametrize(("header", "why"), [
    ({"filter": "home/#", "since": "yesterday"}, "is not a time"),
    ({"filter": "home/#", "since": "2999-01-01T00:00:00Z"}, "in the future"),
    ({"filter": "home/#/x"}, "'#' must be a whole last level"),
    ({"filter": "home/#", "cursor": "bm9wZQ"}, "not a history cursor"),
    ({"filter": "home/#", "until": "later"}, "is not a time"),
    ({"since": "earliest"}, "filter"),
])
def test_bad_input_gets_a_400_that_says_why(server: Server, header: dict, why: str) -> None:
    c = Raw(server.native)
    answer = c.call(p.HISTORY, header)
    assert answer.kind == p.ERROR and answer.header["status"] == 400, answer.header
    assert why in answer.header["error"]
    with pytest.raises(ValueError, match="not a time"):  # the remote store raises as the
        remote(server, lambda s: s.history("a/#", "soon"))  # embedded one does


@pytest.fixture(scope="module")
def auth_srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = auth_server(tmp_path_factory.mktemp("history-auth"))
    add_user(s, "reader", "pw")
    allow(s, "reader", "Topic:home/#", "SUB")
    allow(s, "reader", "Topic:home/secret/temp", "SUB", deny=True)
    add_user(s, "dev", "pw")
    allow(s, "dev", "Topic:#", "PUB")
    dev = Client(s.port, "dev-acl", username="dev", password="pw")
    for i in range(6):
        dev.publish(f"home/{['bath', 'secret'][i % 2]}/temp", b"%d" % i, qos=1)
    dev.disconnect()
    yield s
    assert s.stop() == 0, s.logs()[-3000:]


def test_a_reader_gets_only_the_topics_it_may_read(auth_srv: Server) -> None:
    creds = ("reader", "pw")
    batches = read_all(auth_srv, "home/#", creds=creds, max_count=2)
    assert [m.body for b in batches for m in b.messages] == [b"0", b"2", b"4"]
    assert all("home/secret/temp" not in b.ends for b in batches)
    for cursor in (b.cursor for b in batches if b.cursor):  # no topic names in a cursor
        assert "secret" not in cursor
    for refused in ("#", "home/secret/temp", "garden/#"):
        with pytest.raises(p.RemoteError) as err:
            read_all(auth_srv, refused, creds=creds)
        assert err.value.status == 403, refused
    with pytest.raises(p.RemoteError) as err:
        remote(auth_srv, lambda s: s.seek_time("garden/t", 0), creds)
    assert err.value.status == 403
    # A Super user (as a node, the gateway) reads everything: a gateway checks its clients.
    every = read_all(auth_srv, "home/#", creds=("admin", "admin-secret"), max_count=10)
    assert len([m for b in every for m in b.messages]) == 6
