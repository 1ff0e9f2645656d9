from __future__ import annotations

from pathlib import Path

import pytest
import trio

from store.record import Message
from store.service import EmbeddedStore, StoreConfig


def config(tmp_path: Path, **kw) -> StoreConfig:
    return StoreConfig(data_dir=tmp_path, segment_size=64 * 1024, **kw)


async def test_publish_routes_to_exact_wildcard_and_partition_queues(tmp_path: Path) -> None:
    seen: list[set[str]] = []
    async with EmbeddedStore.open(config(tmp_path), notify=seen.append) as store:
        assert store.register_wildcard("home/+/temp")
        assert store.register_wildcard("home/#")
        assert not store.register_wildcard("home/#")  # idempotent
        [msg] = await store.publish([Message("home/bath/temp", b"21.5", qos=1, client_id="d1")])
        names = [q for q, _ in msg.queues]
        part = store.router.partition_for("home", "home/bath/temp")
        assert names == ["home/bath/temp", "home/#", "home/+/temp", part]
        assert seen and set(names) <= set().union(*seen)
        [other] = await store.publish([Message("home/kitchen/light", b"on")])
        assert [q for q, _ in other.queues][:2] == ["home/kitchen/light", "home/#"]
        # $-topics are not indexed into leading-wildcard queues
        store.register_wildcard("#")
        [sys_msg] = await store.publish([Message("$SYS/x", b"1")])
        assert "#" not in [q for q, _ in sys_msg.queues]

        res = await store.pull("home/#", 0, 10)
        assert [m.body for m in res.messages] == [b"21.5", b"on"]
        assert (res.next_offset, res.min_offset, res.max_offset) == (2, 0, 2)
        assert res.messages[0].client_id == "d1" and res.messages[0].qos == 1
        assert (await store.pull("home/#", 2, 10)).messages == []


async def test_wildcards_and_topics_survive_restart(tmp_path: Path) -> None:
    async with EmbeddedStore.open(config(tmp_path)) as store:
        store.register_wildcard("a/+")
        store.create_topic("a", 8)
    async with EmbeddedStore.open(config(tmp_path)) as store:
        assert store.router.wildcards() == ["a/+"]
        assert store.router.partitions("a") == 8
        [m] = await store.publish([Message("a/b", b"x")])
        assert "a/+" in [q for q, _ in m.queues]


async def test_send_to_first_level_topic_and_command_devices(tmp_path: Path) -> None:
    async with EmbeddedStore.open(config(tmp_path)) as store:
        [plain] = await store.send("billing", [Message("", b"invoice", key="order-7")])
        assert [q for q, _ in plain.queues] == [store.router.partition_for("billing", "order-7")]
        assert plain.topic == "billing"
        [cmd] = await store.send("home", [Message("home/bath/cmd", b"heat")])
        assert [q for q, _ in cmd.queues][0] == "home/bath/cmd"
        with pytest.raises(ValueError):
            await store.send("home", [Message("garden/x", b"no")])
        with pytest.raises(ValueError):
            await store.send("bad/topic", [Message("", b"no")])
        by_id = await store.get_message(plain.msg_id)
        assert by_id.body == b"invoice"
        assert [m.body for m in await store.find_by_key("order-7")] == [b"invoice"]


async def test_publish_rejects_bad_topics(tmp_path: Path) -> None:
    async with EmbeddedStore.open(config(tmp_path)) as store:
        for bad in ("a/+", "#", "", "a\x00b"):
            with pytest.raises(ValueError):
                await store.publish([Message(bad, b"x")])
        assert store.commitlog.max_offset == 0  # nothing written


async def test_concurrent_publishers_share_group_commits(tmp_path: Path) -> None:
    async with EmbeddedStore.open(config(tmp_path, flush="sync")) as store:
        async def publisher(n: int) -> None:
            for i in range(50):
                await store.publish([Message(f"p/{n}", b"%d" % i, qos=1)])

        async with trio.open_nursery() as nursery:
            for n in range(20):
                nursery.start_soon(publisher, n)
        assert store.commitlog.stats["messages"] == 1000
        assert store.commitlog.stats["fsyncs"] < 1000
        res = await store.pull("p/3", 0, 100)
        assert [m.body for m in res.messages] == [b"%d" % i for i in range(50)]


async def test_pull_after_retention_starts_at_the_new_minimum(tmp_path: Path) -> None:
    cfg = config(tmp_path, retention_bytes=20 * 1024)
    async with EmbeddedStore.open(cfg) as store:
        for i in range(400):
            await store.publish([Message("r/1", b"%04d" % i + b"." * 200)])
        assert await store.enforce_retention()
        res = await store.pull("r/1", 0, 5)
        assert res.min_offset > 0 and res.messages[0].offset_in("r/1") == res.min_offset
        assert store.stats()["commitlog"]["bytes"] <= 20 * 1024 + 64 * 1024


async def test_metadata_column_families(tmp_path: Path) -> None:
    async with EmbeddedStore.open(config(tmp_path)) as store:
        meta = store.meta
        meta.put("sessions", "dev-1", {"expiry": 60, "will": {"payload": b"\x00bye"}})
        with meta.batch() as b:
            b.put("subscriptions", "dev-1\x00a/+", {"qos": 1})
            b.put("subscriptions", "dev-1\x00b/#", {"qos": 2})
            b.put("subscriptions", "dev-2\x00c", {"qos": 0})
        assert meta.get("sessions", "dev-1")["will"]["payload"] == b"\x00bye"
        assert [k for k, _ in meta.items("subscriptions", "dev-1\x00")] == [
            "dev-1\x00a/+", "dev-1\x00b/#",
        ]
        meta.delete_prefix("subscriptions", "dev-1\x00")
        assert [k for k, _ in meta.items("subscriptions")] == ["dev-2\x00c"]
        with pytest.raises(KeyError):
            meta.get("nope", "x")
    async with EmbeddedStore.open(config(tmp_path)) as store:
        assert store.meta.get("sessions", "dev-1")["expiry"] == 60
