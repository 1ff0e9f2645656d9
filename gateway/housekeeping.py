"""The gateway's periodic work: where sessions and shared groups resume, session
expiry, $SYS values, the wildcard filters in use. None of it may end the gateway:
each round is guarded (gateway.background)."""

from __future__ import annotations

import logging
import time
from functools import cache, partial
from importlib.metadata import PackageNotFoundError, version

import trio

from gateway.background import Background
from gateway.config import GatewayConfig
from gateway.reserved import SERVER_ID
from gateway.retained import Retained
from gateway.sessions import SessionRegistry
from gateway.shared import SharedGroups
from gateway.stats import Stats
from gateway.wills import Wills
from lightqueue.topic import is_wildcard
from store.api import Message, Store, StoreError

log = logging.getLogger("lightgate.gateway")


class Housekeeping:
    def __init__(self, config: GatewayConfig, store: Store, stats: Stats,
                 background: Background, *, sessions: SessionRegistry, groups: SharedGroups,
                 wills: Wills, retained: Retained) -> None:
        self.config = config
        self.store = store
        self.stats = stats
        self.background = background
        self.sessions = sessions
        self.groups = groups
        self.wills = wills
        self.retained = retained

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Restore what the store holds, then the periodic rounds; the background
        nursery is open from `task_status.started()` on."""
        bg, cfg = self.background, self.config
        await bg.guarded(self.retained.load_budget)
        async with trio.open_nursery() as nursery:
            bg.nursery = nursery
            await bg.guarded(self.restore_sessions)  # before the expiry check
            task_status.started()
            nursery.start_soon(bg.every, cfg.offsets_flush_interval, self.flush_offsets)
            nursery.start_soon(partial(bg.every, cfg.expiry_check_interval,
                                       self.sessions.expire, at_once=True))
            nursery.start_soon(partial(bg.every, cfg.sys_interval, self.publish_sys,
                                       at_once=True))
            nursery.start_soon(bg.every, cfg.wildcard_touch_s, self.touch_wildcards)

    async def restore_sessions(self) -> None:
        """One scan of the stored sessions at start: how many there are (for
        --max-sessions; each expiry sweep counts again), and the wills whose delay was
        running when the gateway stopped."""
        try:
            items = await self.store.meta_items("sessions")
        except StoreError as exc:  # separated mode, store away: the expiry sweep counts
            log.warning("stored sessions not counted, pending wills not restored: %s", exc)
            return
        self.sessions.persistent = len(items)
        self.wills.restore(items)

    async def touch_wildcards(self) -> None:
        """Tell the store which wildcard queues this gateway's sessions and shared groups
        read, so that it keeps indexing into them (and only them)."""
        filters = [q for q in {*self.sessions.by_queue, *self.groups.by_queue}
                   if is_wildcard(q)]
        if not filters:
            return
        await self.store.add_wildcards(filters)

    async def flush_offsets(self) -> None:
        """Where every session and shared group resumes; a failure keeps them dirty, so
        the next round flushes them."""
        await self.sessions.flush_all_offsets()
        await self.groups.flush_offsets()

    async def publish_sys(self) -> None:
        """The broker's statistics, to the `$SYS` subscribers here and as the values a
        new subscription finds (Retained.statistics): not into the store, as Mosquitto
        keeps `$SYS` out of its persistence. They are this gateway's, and said again
        each round; stored, they were 9 records every round, and a `$SYS` topic in the
        store's pages beside the devices'."""
        st = self.stats
        totals = st.totals()
        store_stats = (await self.store.get_stats())["commitlog"]
        values = {
            "$SYS/broker/version": f"lightgate version {lightgate_version()}",
            "$SYS/broker/uptime": f"{int(time.time() - st.started)} seconds",
            "$SYS/broker/clients/connected": st.connections,
            "$SYS/broker/clients/total": len(self.sessions.by_id),
            "$SYS/broker/messages/received": totals["messages_in"],
            "$SYS/broker/messages/sent": totals["messages_out"],
            "$SYS/broker/bytes/received": totals["bytes_in"],
            "$SYS/broker/bytes/sent": totals["bytes_out"],
            "$SYS/broker/store/bytes": store_stats["bytes"],
            "$SYS/broker/store/segments": store_stats["segments"],
        }
        now = int(time.time() * 1000)
        msgs = [Message(t, str(v).encode(), 0, True, SERVER_ID, born_ts=now, store_ts=now)
                for t, v in values.items()]
        for msg in msgs:
            self.retained.statistic(msg)
        for queue, readers in list(self.sessions.by_queue.items()):
            if queue.startswith("$"):  # only a filter naming `$` matches a `$` topic
                for s in list(readers):
                    conn = s.connection
                    if conn is not None and conn.delivery is not None and conn.alive:
                        conn.delivery.statistics(msgs)


@cache
def lightgate_version() -> str:
    """The installed package's version ($SYS/broker/version)."""
    try:
        return version("lightgate")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"
