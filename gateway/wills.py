"""Wills: published when a connection ends without DISCONNECT, at once or after the
Will Delay Interval (MQTT 5 §3.1.3.2.2) unless the client is back by then; a will
waiting out its delay is kept in the session's record, so a restart publishes it too."""

from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple

import trio

from gateway.background import Background
from gateway.locks import ClientLocks
from gateway.mqtt import Will
from gateway.retained import Retained, stored_size
from gateway.session import NEVER_EXPIRES, Session
from gateway.stats import Stats
from store.api import Message, Store, StoreError

log = logging.getLogger("lightgate.gateway")
WILL_SETTLE_S = 5.0  # a will's publish and its record's update, at most, at shutdown


class PendingWill(NamedTuple):
    will: Will
    due: float  # epoch seconds
    scope: trio.CancelScope  # cancels the wait


class Wills:
    def __init__(self, store: Store, retained: Retained, stats: Stats,
                 background: Background, locks: ClientLocks) -> None:
        self.store = store
        self.retained = retained
        self.stats = stats
        self.background = background
        self.locks = locks
        self.pending: dict[str, PendingWill] = {}  # by client id

    def schedule(self, s: Session, will: Will) -> None:
        """Publish the will now, or after its Will Delay Interval unless the client is
        back by then; never later than the session's end."""
        delay = int(will.properties.get("will_delay_interval", 0))
        if s.persistent and s.expiry != NEVER_EXPIRES:
            delay = min(delay, s.expiry)
        elif not s.persistent:
            delay = 0
        if delay <= 0 or not self.background.running:
            self.background.spawn(self.publish, s.client_id, will)
        else:
            self._hold(s.client_id, will, time.time() + delay, restored=False, claim=s.claim)

    async def client_back(self, client_id: str, clean_start: bool) -> None:
        """A CONNECT for `client_id` (under its lock): a will waiting for it goes now if
        the session ends [MQTT-3.1.2-8], else not at all [MQTT-3.1.3-9]."""
        pending = self.pending.pop(client_id, None)
        if pending is None:
            return
        pending.scope.cancel()
        if clean_start:
            self.background.spawn(self.publish, client_id, pending.will)
        else:
            await self._drop_stored(client_id, pending.due)

    def record(self, client_id: str) -> dict[str, Any] | None:
        """The will waiting for `client_id`, as its session's record keeps it."""
        pending = self.pending.get(client_id)
        if pending is None:
            return None
        will = pending.will
        return {"topic": will.topic, "payload": will.payload, "qos": will.qos,
                "retain": will.retain, "props": will.properties, "due": pending.due}

    def restore(self, sessions: list[tuple[str, Any]]) -> None:
        """The wills whose delay was running when the gateway stopped, from the stored
        sessions: published when due, or at once if overdue (the record holds when)."""
        for client_id, info in sessions:
            w = info.get("will")
            if w and client_id not in self.pending:
                will = Will(w["topic"], w["payload"], w["qos"], w["retain"], w["props"] or {})
                self._hold(client_id, will, w["due"], restored=True)

    def _hold(self, client_id: str, will: Will, due: float, restored: bool,
              claim: str | None = None) -> None:
        """Publish `will` at `due` unless a connection to its session comes first
        (`client_back` cancels it) [MQTT-3.1.3-9]. `claim`: the session's on this
        gateway, one of several (gateway.takeover)."""
        scope = trio.CancelScope()
        self.pending[client_id] = PendingWill(will, due, scope)
        self.background.spawn(self._delayed, client_id, will, due, scope, restored, claim)

    async def _delayed(self, client_id: str, will: Will, due: float,
                       scope: trio.CancelScope, restored: bool, claim: str | None) -> None:
        with scope:
            await trio.sleep(max(0.0, due - time.time()))
        pending = self.pending.get(client_id)
        if scope.cancelled_caught or pending is None or pending.scope is not scope:
            return  # the client is back (or a newer will took its place)
        del self.pending[client_id]
        if restored or claim is not None:
            # The client may have come back through another gateway: that one rewrote
            # the record, without the will, under a claim of its own. (A record this
            # gateway could not write yet, the store away, says neither: published.)
            try:
                info = await self.store.meta_get("sessions", client_id)
            except StoreError:
                info = None
            if info is not None and (
                    info.get("claim") not in (None, claim) if claim is not None
                    else "will" not in info):
                return
        # Published and struck from the session's record as one step that a shutdown
        # waits for (bounded): cut between the two, the restart would publish it again.
        with trio.CancelScope(shield=True), trio.move_on_after(WILL_SETTLE_S):
            await self.publish(client_id, will)
            async with self.locks.hold(client_id):
                await self._drop_stored(client_id, due)

    async def _drop_stored(self, client_id: str, due: float) -> None:
        """Remove the will due at `due` from the session's record (it went, or the
        client is back); a record written since is left alone."""
        info = await self.store.meta_get("sessions", client_id)
        if info is not None and (info.get("will") or {}).get("due") == due:
            del info["will"]
            await self.store.meta_put("sessions", client_id, info)

    async def publish(self, client_id: str, will: Will) -> None:
        props = {k: v for k, v in will.properties.items() if k != "will_delay_interval"}
        retain = will.retain
        if retain and will.payload:
            why = self.retained.budget.admit(will.topic, client_id,
                                             stored_size(will.topic, will.payload, props))
            if why is not None:  # still published, not retained
                self.stats.limit_refusals += 1
                log.warning("will of %r on %r not retained: %s", client_id, will.topic, why)
                retain = False
        msg = Message(will.topic, will.payload, will.qos, retain, client_id,
                      props, born_ts=int(time.time() * 1000))
        try:
            await self.retained.publish(msg)
            self.stats.wills += 1
            log.info("will of %r published on %r", client_id, will.topic)
        except Exception:
            log.exception("will of %r could not be published", client_id)
