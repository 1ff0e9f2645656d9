"""NACK records on a real store: one per delivery, dropped once retention removed the
message they name (store.redelivery)."""

from __future__ import annotations

from pathlib import Path

from store.record import Message
from store.redelivery import CF, Redelivery, record_key
from store.service import EmbeddedStore, StoreConfig


async def test_records_go_with_their_messages(tmp_path: Path) -> None:
    cfg = StoreConfig(data_dir=tmp_path, segment_size=64 * 1024, retention_hours=None,
                      retention_bytes=150_000)
    async with EmbeddedStore.open(cfg) as store:
        redelivery = Redelivery(store, max_messages=0)
        [old] = await store.send("orders", [Message("", b"old", key="k")])
        queue, offset = old.queues[0]
        first = await redelivery.nack("billing", queue, offset, old)
        again = await redelivery.nack("billing", queue, offset, old)
        assert not first["repeated"] and again["repeated"]
        assert again["msg_id"] == first["msg_id"]
        key = record_key("billing", queue, offset)
        assert await store.meta_get(CF, key) is not None
        await store.send("orders", [Message("", b"x" * 2000, key="k") for _ in range(200)])
        assert await store.enforce_retention()
        assert store.index.min_offset(queue) > offset
        store._drop_gone_nacks()
        assert await store.meta_get(CF, key) is None
