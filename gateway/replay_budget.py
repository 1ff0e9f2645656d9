"""The bytes of replay history the gateway holds: batches read from the store and not
handed out yet (gateway.replay_state), per client and in all.

A replay reads its history a batch at a time, and the next only once the client has
taken the one before (what waits for its socket is bounded: gateway.backpressure), so
what a replay holds is what its client has yet to drain. Its first batch is read at
SUBSCRIBE, before the client has drained anything; a client with hundreds of replay
subscriptions would hold one per subscription. So a read takes no more than the room
left in the client's budget and the node's; past them a SUBSCRIBE reads one message
(enough to answer it: a start in the future, a cut by retention) and gives it back, the
replay reading its history when its turn comes. A replay whose turn it is may give
back what its client's other replays read but never handed out, and reads at least
MIN_READ whatever the budgets say, so every replay goes on: the node holds at most the
budget plus MIN_READ and a message per client handing out a replay.
"""

from __future__ import annotations

from store.api import HistoryBatch

MIN_READ = 64 * 1024
MESSAGE_OVERHEAD = 256  # a message's fields and objects beyond its topic and payload


def batch_bytes(batch: HistoryBatch) -> int:
    """What a batch holds, as counted in the budget."""
    return sum(len(m.body) + len(m.topic) + MESSAGE_OVERHEAD for m in batch.messages)


class ReplayBudget:
    def __init__(self, limit: int, per_client: int) -> None:
        self.limit = limit  # 0: no limit
        self.per_client = per_client  # 0: no limit
        self.used = 0
        self.peak = 0
        self.cut = 0  # reads made smaller than asked, or first batches given back

    def room(self, client_holds: int) -> int:
        """Bytes a client holding `client_holds` may read now."""
        room = 1 << 62
        if self.per_client:
            room = self.per_client - client_holds
        if self.limit:
            room = min(room, self.limit - self.used)
        return max(0, room)

    def lease(self, n: int) -> Lease:
        """Hold `n` bytes (reserved before a read, so that reads at once cannot all see
        the same room)."""
        self.used += n
        self.peak = max(self.peak, self.used)
        return Lease(self, n)


class Lease:
    """Bytes of the budget held by one batch: given back by `release`, or when the batch's
    holder lets go of it (a replay that ends, whichever way, frees its lease with it)."""

    __slots__ = ("budget", "n")

    def __init__(self, budget: ReplayBudget, n: int) -> None:
        self.budget, self.n = budget, n

    def resize(self, n: int) -> None:
        """What was reserved before a read becomes what the read brought."""
        budget = self.budget
        budget.used += n - self.n
        budget.peak = max(budget.peak, budget.used)
        self.n = n

    def release(self) -> None:
        self.budget.used -= self.n
        self.n = 0

    def __del__(self) -> None:
        if self.n:
            self.release()
