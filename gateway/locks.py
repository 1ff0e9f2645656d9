"""One CONNECT per client id at a time: takeover, session load and attach, and a
delayed will's last step, in order, so that the last CONNECT wins."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio


@dataclass
class _Entry:
    lock: trio.Lock = field(default_factory=trio.Lock)
    users: int = 0  # holding or waiting


class ClientLocks:
    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    @asynccontextmanager
    async def hold(self, client_id: str) -> AsyncIterator[None]:
        entry = self._entries.get(client_id)
        if entry is None:
            entry = self._entries[client_id] = _Entry()
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:  # nobody holds or waits: no entry per client id ever seen
                del self._entries[client_id]
