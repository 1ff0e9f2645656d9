"""The reactor's set of sockets (gateway.reactor): epoll where there is one (Linux), else
the platform's selector (kqueue on macOS) behind the few epoll calls the reactor makes.

On Linux the reactor keeps `select.epoll` itself: it is the Python plane's hot loop, and
`selectors` would add a key lookup and a tuple per event, and has no bound on the events
one poll returns. Elsewhere `selectors` does the work, and what epoll has that it lacks
is made up here: a mask of 0 (a socket kept in the set but not watched: paused, or a
listener resting) and the reasons' bits. trio waits on the set's own descriptor, so the
selector must have one (kqueue, /dev/poll); select() and poll() have none."""

from __future__ import annotations

import errno
import select
import selectors
from typing import Protocol

# epoll's bits, which the reactor's masks are made of on every platform.
READ = getattr(select, "EPOLLIN", 0x001)
WRITE = getattr(select, "EPOLLOUT", 0x004)
ERR = getattr(select, "EPOLLERR", 0x008)
HUP = getattr(select, "EPOLLHUP", 0x010)
RDHUP = getattr(select, "EPOLLRDHUP", 0x2000)


class Poller(Protocol):
    def fileno(self) -> int: ...
    def register(self, fd: int, eventmask: int) -> None: ...
    def modify(self, fd: int, eventmask: int) -> None: ...
    def unregister(self, fd: int) -> None: ...
    def poll(self, timeout: float = -1, maxevents: int = -1) -> list[tuple[int, int]]: ...
    def close(self) -> None: ...


def open_poller() -> Poller:
    epoll = getattr(select, "epoll", None)
    if epoll is not None:
        return epoll()
    return SelectorPoller()


def _events(mask: int) -> int:
    return ((selectors.EVENT_READ if mask & (READ | RDHUP) else 0)
            | (selectors.EVENT_WRITE if mask & WRITE else 0))


class SelectorPoller:
    """epoll's calls over `selectors.DefaultSelector` (level triggered, as the reactor
    uses epoll). Every ready socket comes back from one poll (no `maxevents` bound: a
    socket left out would come back first next time, and could starve the rest)."""

    def __init__(self) -> None:
        self._sel = selectors.DefaultSelector()
        if not hasattr(self._sel, "fileno"):
            self._sel.close()
            raise OSError(errno.ENOSYS, "no epoll, kqueue or /dev/poll on this platform: the "
                          "MQTT reactor needs one (Lightgate runs on Linux and macOS)")
        self._masks: dict[int, int] = {}  # every fd in the set, watched (mask) or not (0)

    def fileno(self) -> int:
        return self._sel.fileno()  # type: ignore[attr-defined]

    def register(self, fd: int, eventmask: int) -> None:
        if fd in self._masks:
            raise FileExistsError(errno.EEXIST, f"fd {fd} is in the set already")
        self._masks[fd] = 0
        self.modify(fd, eventmask)

    def modify(self, fd: int, eventmask: int) -> None:
        old = self._masks.get(fd)
        if old is None:
            raise FileNotFoundError(errno.ENOENT, f"fd {fd} is not in the set")
        had, wants = _events(old), _events(eventmask)
        if had and wants:
            self._sel.modify(fd, wants)
        elif wants:
            self._sel.register(fd, wants)
        elif had:
            self._sel.unregister(fd)
        self._masks[fd] = eventmask

    def unregister(self, fd: int) -> None:
        mask = self._masks.pop(fd, None)
        if mask is None:
            raise FileNotFoundError(errno.ENOENT, f"fd {fd} is not in the set")
        if _events(mask):
            self._sel.unregister(fd)

    def poll(self, timeout: float = -1, maxevents: int = -1) -> list[tuple[int, int]]:
        ready = self._sel.select(None if timeout is None or timeout < 0 else timeout)
        return [(key.fd, (READ if ev & selectors.EVENT_READ else 0)
                 | (WRITE if ev & selectors.EVENT_WRITE else 0)) for key, ev in ready]

    def close(self) -> None:
        self._sel.close()
        self._masks.clear()
