"""Wildcard queues follow live filters: every message is indexed into every
registered wildcard filter, so one nobody reads any more is unregistered after
`wildcard_idle_s` unless a gateway touched it or a stored reader position names it."""

from __future__ import annotations

from pathlib import Path

import trio

from store.record import Message
from store.service import EmbeddedStore, StoreConfig


def config(tmp_path: Path, idle: float) -> StoreConfig:
    return StoreConfig(data_dir=tmp_path, segment_size=64 * 1024, wildcard_idle_s=idle)

# The tests that call drop_idle_wildcards themselves open the store with an idle time of
# an hour (its own loop sleeps a minute) and pass 0.2 s to the call.
IDLE = 0.2


async def queues_of(store: EmbeddedStore, topic: str) -> list[str]:
    [msg] = await store.publish([Message(topic, b"x")])
    return [q for q, _ in msg.queues]


async def test_an_idle_wildcard_is_unregistered_and_comes_back_on_use(tmp_path: Path) -> None:
    async with EmbeddedStore.open(config(tmp_path, idle=3600)) as store:
        await store.add_wildcard("a/+")
        assert "a/+" in await queues_of(store, "a/x")
        assert await store.drop_idle_wildcards(IDLE) == []  # used a moment ago
        await trio.sleep(0.3)
        assert await store.drop_idle_wildcards(IDLE) == ["a/+"]
        assert "a/+" not in await queues_of(store, "a/x")
        assert store.stats()["wildcards_dropped"] == 1
        assert await store.meta_get("wildcards", "a/+") is None  # not back after a restart
        # Used again: registered again, its offsets going on where they were.
        await store.add_wildcard("a/+")
        [msg] = await store.publish([Message("a/y", b"again")])
        assert msg.offset_in("a/+") == 1


async def test_touched_and_held_wildcards_stay(tmp_path: Path) -> None:
    async with EmbeddedStore.open(config(tmp_path, idle=3600)) as store:
        await store.add_wildcards(["live/+", "held/+", "gone/+"])
        # An offline persistent session's position names held/+ (client \0 queue).
        await store.meta_put("offsets", "dev-1\x00held/+", {"acked": 0, "next": 0})
        for _ in range(3):
            await trio.sleep(0.1)
            await store.add_wildcards(["live/+"])  # a gateway's periodic touch
        assert await store.drop_idle_wildcards(IDLE) == ["gone/+"]
        assert "held/+" in await queues_of(store, "held/x")
        assert "live/+" in await queues_of(store, "live/x")


async def test_after_a_restart_registered_wildcards_get_a_full_idle_period(
        tmp_path: Path) -> None:
    async with EmbeddedStore.open(config(tmp_path, idle=3600)) as store:
        await store.add_wildcard("r/+")
        await trio.sleep(0.3)
    async with EmbeddedStore.open(config(tmp_path, idle=3600)) as store:
        assert await store.drop_idle_wildcards(IDLE) == []  # gateways have not come back yet
        assert "r/+" in await queues_of(store, "r/x")
        await trio.sleep(0.3)
        assert await store.drop_idle_wildcards(IDLE) == ["r/+"]


async def test_the_clean_up_runs_by_itself(tmp_path: Path) -> None:
    async with EmbeddedStore.open(config(tmp_path, idle=0.2)) as store:
        await store.add_wildcard("auto/#")
        with trio.fail_after(5):
            while "auto/#" in store.router.wildcards():
                await trio.sleep(0.05)
        assert store.stats()["wildcards_dropped"] == 1


async def test_idle_zero_never_unregisters(tmp_path: Path) -> None:
    async with EmbeddedStore.open(config(tmp_path, idle=0)) as store:
        await store.add_wildcard("keep/+")
        await trio.sleep(0.1)
        assert "keep/+" in store.router.wildcards()
