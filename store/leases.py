"""Leases on shared subscription groups: which gateway hands out a group's messages.

An MQTT shared group (`$share/{group}/{filter}`) may have members on several gateways
over one store. Every gateway reads the filter's light queue; if each handed out what it
read to its own members, every message would go once per gateway. So one gateway at a
time holds the group's lease and hands out; the others keep their members connected and
idle until the holder leaves or goes silent. MQTT lets the server pick any member for a
message, so members on idle gateways getting nothing is within the rules.

Gateways ask every LEASE_ASK_S for all their groups at once (`ask`); the holder keeps
the lease while it asks, and loses it LEASE_TIMEOUT_S after its last ask. A holder
stops handing out on its own once FENCE_S passed without an answer (a gateway cut off
from the store), before the store gives the lease to another: FENCE_S < LEASE_TIMEOUT_S.

Leases live in the master's memory only. After a restart, a failover, or any quiet
spell longer than FENCE_S, the registry cannot know who held what; every holder has
fenced itself by then or is about to ask saying it holds (`held`). For FENCE_S after
such a spell only those claims are granted, so a gateway that did not hold a group
does not start while the one that did is still handing out.

Sans-IO: the caller passes the time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LEASE_ASK_S = 0.5
FENCE_S = 1.5
LEASE_TIMEOUT_S = 3.0


@dataclass
class _Lease:
    holder: str | None = None
    members: dict[str, float] = field(default_factory=dict)  # gateway -> last ask

    def expire(self, now: float) -> None:
        for m in [m for m, t in self.members.items() if now - t > LEASE_TIMEOUT_S]:
            del self.members[m]
        if self.holder not in self.members:
            self.holder = None


class Leases:
    def __init__(self) -> None:
        self.leases: dict[str, _Lease] = {}
        self._last_ask: float | None = None
        self._grace_until = 0.0
        self._swept = 0.0

    def ask(self, member: str, held: dict[str, bool], now: float) -> dict[str, str | None]:
        """`member` reads these groups (name -> whether it believes it holds the
        lease): each group's holder, which may be `member` now."""
        if self._last_ask is None or now - self._last_ask > FENCE_S:
            self._grace_until = now + FENCE_S  # who held what is unknown (see above)
        self._last_ask = now
        if now - self._swept > LEASE_TIMEOUT_S:
            self._sweep(now)
        out: dict[str, str | None] = {}
        for name, claims in held.items():
            lease = self.leases.setdefault(name, _Lease())
            lease.expire(now)
            lease.members[member] = now
            if lease.holder is None and (claims or now >= self._grace_until):
                lease.holder = member
            out[name] = lease.holder
        return out

    def leave(self, member: str, names: list[str], now: float) -> dict[str, int]:
        """`member` has no members of these groups left: each group's count of
        gateways still reading it (0: the group's position may go)."""
        out: dict[str, int] = {}
        for name in names:
            lease = self.leases.get(name)
            if lease is not None:
                lease.members.pop(member, None)
            out[name] = self._expire(name, now)
        return out

    def _sweep(self, now: float) -> None:
        """Forget the groups whose every gateway went silent (stopped, or gone)."""
        self._swept = now
        for name in list(self.leases):
            self._expire(name, now)

    def _expire(self, name: str, now: float) -> int:
        """The count of gateways still reading group `name`; none: it is forgotten."""
        lease = self.leases.get(name)
        if lease is None:
            return 0
        lease.expire(now)
        if not lease.members:
            del self.leases[name]
        return len(lease.members)

    def holders(self) -> dict[str, str | None]:
        return {name: lease.holder for name, lease in self.leases.items()}
