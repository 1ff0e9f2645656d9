"""The history reader on a real store (CommitLog files, RocksDB): every way it reads
(topic queues, first-level partitions, the log itself) gives what a scan of the whole log
gives, batch after batch; starts by time, `last`, `until`, retention's cut, the fixed end,
the read limit and cursors that are not ours."""

from __future__ import annotations

import random
import struct
import zlib
from pathlib import Path

import pytest
import trio

from lightqueue.since import EARLIEST, LAST, TIME, Since
from lightqueue.topic import matches
from store import history
from store.history import CursorError, exact_offset
from store.record import Message
from store.service import EmbeddedStore, StoreConfig

TOPICS = ["a/1/t", "a/2/t", "a/3/x", "a/1/t/deep", "b/1/t", "b/2/t", "$SYS/a/t", "a"]
FILTERS = ["a/1/t", "a/+/t", "a/#", "#", "+/1/t", "+/+/t", "b/#", "a/9/t", "nothing/#"]


def config(tmp_path: Path, **kw) -> StoreConfig:
    return StoreConfig(data_dir=tmp_path, segment_size=64 * 1024, retention_hours=None, **kw)


async def fill(store: EmbeddedStore, rng: random.Random, n: int, pause_every: int = 0
               ) -> None:
    """`n` messages over TOPICS in random batches, with a server app's message to the
    first-level topic and a retry copy now and then (neither is MQTT history)."""
    i = 0
    while i < n:
        batch = [Message(rng.choice(TOPICS), b"m%d" % (i + k), qos=k % 2, client_id="c")
                 for k in range(rng.randrange(1, 9))]
        await store.publish(batch)
        i += len(batch)
        if rng.random() < 0.1:
            await store.send("a", [Message("", b"app")])
            await store.append([Message("a/1/t", b"retry copy")], [["g#retry"]])
        if pause_every and i % pause_every < len(batch):
            await trio.sleep(0.003)  # store times move on


def reference(store: EmbeddedStore, topic_filter: str, since_ms: int = -1,
              until: int | None = None) -> list[tuple[str, bytes]]:
    """What the history must be: a scan of the whole log."""
    end = store.index.checkpoint()
    return [(m.topic, m.body) for m in store.commitlog.scan(store.commitlog.min_offset, end)
            if matches(topic_filter, m.topic) and exact_offset(m) is not None
            and m.store_ts >= since_ms and (until is None or m.store_ts < until)]


async def read_all(store: EmbeddedStore, topic_filter: str, since: str | Since = "earliest",
                   max_count: int = 7, **kw) -> tuple[list[Message], dict[str, int], bool]:
    msgs: list[Message] = []
    ends: dict[str, int] = {}
    batch = await store.history(topic_filter, since, max_count=max_count, **kw)
    cut = batch.cut
    while True:
        assert len(batch.messages) <= max_count
        msgs += batch.messages
        ends.update(batch.ends)
        if batch.done:
            return msgs, ends, cut
        batch = await store.history(topic_filter, cursor=batch.cursor, max_count=max_count)


@pytest.fixture(params=["topics", "partitions-or-log"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Read through topic queues, or (no filter is narrow enough) through partitions and
    the log: the history must not depend on it."""
    if request.param != "topics":
        monkeypatch.setattr(history, "MERGE_MAX_QUEUES", 0)
    return request.param


async def test_every_way_of_reading_gives_the_scans_answer(tmp_path: Path, mode: str) -> None:
    async with EmbeddedStore.open(config(tmp_path)) as store:
        store.register_wildcard("a/+/t")  # a registered filter changes nothing
        await fill(store, random.Random(1), 3000)
        for topic_filter in FILTERS:
            want = reference(store, topic_filter)
            got, ends, cut = await read_all(store, topic_filter, max_count=97)
            assert [(m.topic, m.body) for m in got] == want, topic_filter
            assert not cut
            # ends: each topic's next offset in its own queue, after its last message
            for topic in {t for t, _ in want}:
                assert ends[topic] == store.index.max_offset(topic)
            assert [m.phys_offset for m in got] == sorted(m.phys_offset for m in got)
        assert ("$SYS/a/t", b"m0") not in reference(store, "#")


async def test_start_by_time_until_and_small_batches(tmp_path: Path, mode: str) -> None:
    async with EmbeddedStore.open(config(tmp_path)) as store:
        await fill(store, random.Random(2), 1500, pause_every=40)
        times = sorted({m.store_ts for m in store.commitlog.scan(0)})
        assert len(times) > 10
        for since in (times[0] - 1, times[len(times) // 3], times[-1], times[-1] + 1):
            for topic_filter in ("a/+/t", "#", "a/1/t"):
                until = times[2 * len(times) // 3]
                got, _, _ = await read_all(store, topic_filter, Since(TIME, since), until=until)
                assert [(m.topic, m.body) for m in got] == reference(
                    store, topic_filter, since, until), (topic_filter, since)
                got, _, _ = await read_all(store, topic_filter, str(since), max_count=1)
                assert [(m.topic, m.body) for m in got] == reference(store, topic_filter,
                                                                     since)


async def test_last_is_the_newest_message_of_each_topic(tmp_path: Path) -> None:
    async with EmbeddedStore.open(config(tmp_path)) as store:
        await fill(store, random.Random(3), 400)
        for topic_filter in ("a/#", "#", "a/1/t", "+/+/t"):
            every = reference(store, topic_filter)
            newest = {topic: body for topic, body in every}
            got, ends, _ = await read_all(store, topic_filter, LAST, max_count=2)
            assert {m.topic: m.body for m in got} == newest
            assert len(got) == len(newest)
            assert [m.phys_offset for m in got] == sorted(m.phys_offset for m in got)
            assert all(ends[t] == store.index.max_offset(t) for t in newest)


async def test_the_first_batch_fixes_the_end(tmp_path: Path) -> None:
    async with EmbeddedStore.open(config(tmp_path)) as store:
        await store.publish([Message("a/1/t", b"%d" % i) for i in range(10)])
        first = await store.history("a/#", max_count=4)
        await store.publish([Message("a/2/t", b"later")])  # after the history began
        rest, _, _ = await read_all(store, "a/#")
        msgs = first.messages
        batch = first
        while not batch.done:
            batch = await store.history("a/#", cursor=batch.cursor, max_count=4)
            msgs += batch.messages
        assert [m.body for m in msgs] == [b"%d" % i for i in range(10)]
        assert rest[-1].body == b"later"  # a new history sees it


async def test_read_limit_holds_a_batch_back_without_ending_it(tmp_path: Path) -> None:
    async with EmbeddedStore.open(config(tmp_path)) as store:
        stored = await store.publish([Message("a/1/t", b"%d" % i) for i in range(6)])
        limit = stored[3].phys_offset  # the first three are acknowledged
        batch = await store.history("a/1/t", max_count=100, read_limit=limit)
        assert [m.body for m in batch.messages] == [b"0", b"1", b"2"] and not batch.done
        assert batch.ends == {"a/1/t": 3}
        batch = await store.history("a/1/t", cursor=batch.cursor, read_limit=limit)
        assert batch.messages == [] and not batch.done
        batch = await store.history("a/1/t", cursor=batch.cursor)
        assert [m.body for m in batch.messages] == [b"3", b"4", b"5"] and batch.done


async def test_retention_cuts_the_history_and_says_so(tmp_path: Path, mode: str) -> None:
    async with EmbeddedStore.open(config(tmp_path, retention_bytes=150_000)) as store:
        await fill(store, random.Random(4), 500, pause_every=50)
        early = store.commitlog.min_offset
        await store.publish([Message("b/1/t", b"x" * 2000) for _ in range(100)])
        assert await store.enforce_retention()
        assert store.commitlog.min_offset > early
        oldest = min(m.store_ts for m in store.commitlog.scan(store.commitlog.min_offset))
        for topic_filter in ("#", "b/1/t", "b/#"):
            got, _, cut = await read_all(store, topic_filter, EARLIEST, max_count=50)
            assert cut, topic_filter
            assert [(m.topic, m.body) for m in got] == reference(store, topic_filter)
            _, _, cut = await read_all(store, topic_filter, str(oldest - 1000))
            assert cut
            _, _, cut = await read_all(store, topic_filter, str(oldest + 1))
            assert not cut
        seek = await store.seek_time("b/1/t", 0)
        assert seek.cut and seek.offset == seek.min_offset > 0
        assert not (await store.seek_time("b/1/t", oldest + 1)).cut


async def test_cursors_not_given_out_here_are_refused(tmp_path: Path) -> None:
    async with EmbeddedStore.open(config(tmp_path)) as store:
        msgs = await store.publish([Message("a/1/t", b"%d" % i)
                                    for i in range(20)])
        batch = await store.history("#", max_count=3)
        with pytest.raises(CursorError, match="belongs to the filter '#'"):
            await store.history("a/#", cursor=batch.cursor)
        for junk in ("", "!!!", "e30", "x" * 5000, "abc", "a.b", "e30.e30"):
            with pytest.raises(CursorError, match="not a history cursor this store gave"):
                await store.history("#", cursor=junk)
        # A position inside a record (where a body could hide a record) is not a start.
        key = store.history_reader.key
        state = history.decode_cursor(batch.cursor, "#", key)
        state.pos = msgs[5].phys_offset + 7
        state.mode = history.LOG
        with pytest.raises(CursorError, match="no record starts"):
            await store.history("#", cursor=state.token(key))
        with pytest.raises(ValueError, match="in the future"):
            await store.history("#", "2999-01-01T00:00:00Z")
        with pytest.raises(ValueError):
            await store.history("a/#/b")


async def test_a_cursor_is_signed_and_a_forged_one_is_refused(tmp_path: Path) -> None:
    """A cursor is the state and its MAC under a key kept in the data directory: changed
    in any field, or written as an unsigned state, it is refused; the real one still
    reads on after a restart (same key), and not on another store (another key)."""
    import base64

    import orjson

    async with EmbeddedStore.open(config(tmp_path / "one")) as store:
        await store.publish([Message("a/1/t", b"%d" % i) for i in range(20)])
        batch = await store.history("#", max_count=3)
    state_b64, _, mac = batch.cursor.partition(".")
    assert mac, "a cursor carries its MAC"
    state = orjson.loads(base64.urlsafe_b64decode(state_b64 + "=" * (-len(state_b64) % 4)))
    forged = dict(state, p=0)  # back to the start of the log: what it held unsigned
    forged_b64 = base64.urlsafe_b64encode(orjson.dumps(forged)).rstrip(b"=").decode()
    async with EmbeddedStore.open(config(tmp_path / "one")) as store:
        for bad in (f"{forged_b64}.{mac}", forged_b64, state_b64, f"{state_b64}.{mac[:-2]}"):
            with pytest.raises(CursorError, match="not a history cursor this store gave out"):
                await store.history("#", cursor=bad)
        again = await store.history("#", cursor=batch.cursor, max_count=100)
        assert [m.body for m in again.messages] == [b"%d" % i for i in range(3, 20)]
    async with EmbeddedStore.open(config(tmp_path / "two")) as other:
        await other.publish([Message("a/1/t", b"%d" % i) for i in range(20)])
        with pytest.raises(CursorError, match="not a history cursor this store gave out"):
            await other.history("#", cursor=batch.cursor)


async def test_a_groups_nodes_share_the_cursor_key(tmp_path: Path) -> None:
    """Nodes of a store group sign with a key derived from the group secret: a cursor the
    master gave out reads on at a replica (the same log) that becomes master."""
    import shutil

    from store.cursor_key import KEY_FILE, group_key

    async with EmbeddedStore.open(config(tmp_path / "master")) as store:
        store.history_reader.key = group_key(b"the group secret")
        await store.publish([Message("a/1/t", b"%d" % i) for i in range(20)])
        batch = await store.history("#", max_count=3)
    shutil.copytree(tmp_path / "master", tmp_path / "replica")
    (tmp_path / "replica" / KEY_FILE).unlink()  # a node's own key is its own
    async with EmbeddedStore.open(config(tmp_path / "replica")) as replica:
        with pytest.raises(CursorError):
            await replica.history("#", cursor=batch.cursor)
        replica.history_reader.key = group_key(b"the group secret")
        rest = await replica.history("#", cursor=batch.cursor, max_count=100)
        assert [m.body for m in rest.messages] == [b"%d" % i for i in range(3, 20)]


def fake_record(topic: str, ts: int) -> bytes:
    """A whole, CRC-valid record, as a client could send one inside a message body."""
    from store import record
    m = Message(topic, b"fake", store_ts=ts, queues=[(topic, 0)])
    raw = record.encode(m)
    assert zlib.crc32(raw[12:]) == struct.unpack(">I", raw[8:12])[0]
    return raw


async def test_seek_by_time_over_the_log_skips_records_hidden_in_bodies(tmp_path: Path
                                                                       ) -> None:
    async with EmbeddedStore.open(config(tmp_path)) as store:
        rng = random.Random(5)
        stored = []
        for i in range(2000):  # ~1.2 MB over ~20 segments, store times rising
            body = fake_record("a/1/t", 1) if i % 7 == 0 else bytes(rng.randrange(300, 900))
            stored += await store.publish([Message(f"x/{i % 13}", body)])
            if i % 100 == 0:
                await trio.sleep(0.002)
        reader, end = store.history_reader, store.index.checkpoint()
        probes = sorted({m.store_ts for m in stored})
        for ms in (0, *probes, probes[-1] + 1):
            want = next((m.phys_offset for m in stored if m.store_ts >= ms), end)
            assert reader.position_at_time(ms, end) == want, ms


async def test_sync_flush_the_first_batch_waits_for_appends_submitted_before(tmp_path: Path
                                                                             ) -> None:
    """With --flush sync a writer thread appends: an append submitted before the history
    began (not yet written) is in it, one submitted after is not."""
    async with EmbeddedStore.open(config(tmp_path, flush="sync", flush_interval_ms=5)) as store:
        await store.publish([Message("s/1", b"first")])
        before = store.publish_start([Message("s/1", b"submitted before")])
        batch = await store.history("s/#")
        after = store.publish_start([Message("s/1", b"after")])
        assert [m.body for m in batch.messages] == [b"first", b"submitted before"]
        assert batch.done and batch.end == before.result()[0].phys_offset + before.result(
            )[0].size
        assert after.result()[0].phys_offset >= batch.end
