"""Session takeover across gateways: a client connects on one gateway while another
still holds its old connection (half-open after the device roamed, or still up). MQTT
says the server closes the existing connection; with several gateways over one store,
the one holding it is told to. A clean session keeps nothing in the store, but its
record is written all the same (expiry 0: a claim, not a session to resume) so that
its connection is found.

The session's record in the store says which gateway holds it connected and under which
claim: a token each connection's open writes there (`SessionRegistry._open`). The
gateway the client came to asks that gateway, over the notify bus, to release the claim
it read; the holder closes that connection as it closes one taken over on its own
listeners (MQTT 5: DISCONNECT, 0x8E Session taken over), which detaches the session and
records its end in the store; the asker, which waits for that record, then resumes the
session. Without the ask it waited for the holder's keepalive to end the old
connection, or gave up waiting after RELEASE_WAIT_S and served the session
from a record the holder went on changing.

The claim makes the ask exact: a client that came back to the holder meanwhile made a
new claim, and a stale ask leaves its new connection alone.

The claim also tells a gateway whether its copy of an offline session is still the
store's: the record keeps the last claim when its connection ends, so a record with
another claim (or none left) was resumed elsewhere since. Such a copy is dropped
(`forget_here`) rather than resumed stale when its client comes back, or discarded at
its expiry: that discard deleted, from the store, the session the other gateway serves.

An ask is a notify name no
topic can have (MQTT forbids U+0000 in topics and client ids): RELEASE, then the
holder's id, the claim and the client id, U+0000 apart. Like every notify event it is
trusted as the bus is: whoever can write to the notify channel can end connections.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any, Protocol

import trio

if TYPE_CHECKING:
    from gateway.locks import ClientLocks
    from gateway.session import Session
    from store.api import Store


class SessionRegistry(Protocol):
    """What of gateway.sessions.SessionRegistry a takeover uses."""

    store: Store
    locks: ClientLocks
    by_id: dict[str, Session]
    gateway_id: str | None
    ask_release: Callable[[str, str, str], None] | None

    async def unload(self, s: Session, *, keep_groups: bool = False) -> None: ...

log = logging.getLogger("lightgate.gateway")

RELEASE = "\x00release\x00"
# How long a gateway waits at most for another that holds a session connected to
# release it (that gateway's end of the old connection recorded); one that died never
# does, and the session is then taken as the store holds it.
RELEASE_WAIT_S = 2.0


def release_ask(holder: str, claim: str, client_id: str) -> str:
    """The notify name asking gateway `holder` to release `client_id`'s `claim`."""
    return f"{RELEASE}{holder}\x00{claim}\x00{client_id}"


def parse_release(name: str) -> tuple[str, str, str] | None:
    """(holder, claim, client id) of an ask; None for any other name."""
    if not name.startswith(RELEASE):
        return None
    parts = name[len(RELEASE):].split("\x00", 2)
    if len(parts) != 3:
        return None
    holder, claim, client_id = parts
    return holder, claim, client_id


def asks_among(names: Collection[str]) -> list[str]:
    """The release asks among a notify batch's names. A batch without any costs one
    call, not one per name (a fleet's batch names a queue per device): an ask, as every
    name starting with U+0000, sorts before any topic."""
    if not names or min(names) >= "\x01":
        return []
    return [name for name in names if name.startswith(RELEASE)]


async def released_elsewhere(reg: SessionRegistry, client_id: str
                             ) -> dict[str, Any] | None:
    """The session's record in the store, once no other gateway holds it connected:
    while one does, ask it to release it and wait, RELEASE_WAIT_S at most. A client
    that left it and came here at once is otherwise served from what that gateway kept
    before it took in the client's last acknowledgements (they came again here) or
    wrote after it (a clean start's discard undone). Its detach records
    `disconnected_at` once what the client acknowledged is kept."""
    info: dict[str, Any] | None = await reg.store.meta_get("sessions", client_id)
    if reg.gateway_id is None:
        return info
    asked = False
    with trio.move_on_after(RELEASE_WAIT_S) as waited:
        while True:
            if info is None or "disconnected_at" in info \
                    or info.get("gateway") in (None, reg.gateway_id):
                return info
            claim = info.get("claim")
            if not asked and reg.ask_release is not None and isinstance(claim, str):
                reg.ask_release(str(info["gateway"]), claim, client_id)
                asked = True
            await trio.sleep(0.02)
            info = await reg.store.meta_get("sessions", client_id)
    if waited.cancelled_caught:
        log.info("session %r: gateway %s did not release it within %g s (gone?); "
                 "taken as the store holds it", client_id,
                 info and info.get("gateway"), RELEASE_WAIT_S)
    return info


async def release(reg: SessionRegistry, client_id: str, claim: str) -> None:
    """Another gateway's client took the session over: its connection here, if it is
    still the one that made `claim`, closes as a takeover here closes it (the session
    detached, its end recorded for that gateway to resume)."""
    async with reg.locks.hold(client_id):
        session = reg.by_id.get(client_id)
        if session is None or session.claim != claim or session.connection is None:
            return  # gone already, or its client came back here since
        log.info("session %r: its client connected on another gateway; closing its "
                 "connection here", client_id)
        await session.connection.take_over()


async def current_here(reg: SessionRegistry, s: Session) -> bool:
    """Whether `s`, offline here, is still the store's session: no other gateway
    resumed it since it left this one. Always, with one gateway."""
    if reg.gateway_id is None or s.claim is None:
        return True
    info = await reg.store.meta_get("sessions", s.client_id)
    return info is not None and info.get("claim") == s.claim


async def forget_here(reg: SessionRegistry, s: Session) -> None:
    """Drop this gateway's copy of `s`, offline here and another gateway's now: nothing
    of it in the store changes (a shared group keeps its position)."""
    if reg.by_id.get(s.client_id) is s:
        del reg.by_id[s.client_id]
    await reg.unload(s, keep_groups=True)  # (its new gateway resends from the record)
    log.info("session %r: resumed on another gateway since it left this one; this "
             "gateway's copy dropped", s.client_id)
