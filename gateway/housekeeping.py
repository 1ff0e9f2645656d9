"""The gateway's periodic work: where sessions and shared groups resume, session
expiry, $SYS values, the wildcard filters in use. None of it may end the gateway:
each round is guarded (gateway.background)."""

from __future__ import annotations

import logging
from functools import partial

import trio

from gateway import statistics
from gateway.background import Background
from gateway.config import GatewayConfig
from gateway.retained import Retained
from gateway.sessions import SessionRegistry, stored_sessions
from gateway.shared import SharedGroups
from gateway.stats import Stats
from gateway.wills import Wills
from lightqueue.topic import is_wildcard
from store.api import Store, StoreError

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
        items = stored_sessions(items)
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
        """The broker's statistics: to the `$SYS` subscribers here, and as the current
        values a new subscription finds; never into the store (gateway.statistics)."""
        commitlog = (await self.store.get_stats())["commitlog"]
        msgs = statistics.round_of(self.stats, len(self.sessions.by_id), commitlog)
        for msg in msgs:
            self.retained.statistic(msg)
        statistics.hand_out(self.sessions.by_queue, msgs)
