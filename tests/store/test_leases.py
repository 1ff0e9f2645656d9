"""store.leases: one gateway at a time hands out a shared group's messages."""

from __future__ import annotations

from store.leases import FENCE_S, LEASE_ASK_S, LEASE_TIMEOUT_S, Leases


def settled() -> tuple[Leases, float]:
    """A registry past the grace of its first ask (a store that has been up)."""
    leases = Leases()
    leases.ask("warm", {"other": False}, 0.0)
    t = 0.0
    while t < FENCE_S:
        t += LEASE_ASK_S
        leases.ask("warm", {"other": False}, t)
    return leases, t


def test_the_first_asker_holds_and_keeps_it_while_it_asks() -> None:
    leases, t = settled()
    assert leases.ask("gw-a", {"g": False}, t) == {"g": "gw-a"}
    assert leases.ask("gw-b", {"g": False}, t) == {"g": "gw-a"}
    for _ in range(20):
        t += LEASE_ASK_S
        assert leases.ask("gw-b", {"g": False}, t) == {"g": "gw-a"}
        assert leases.ask("gw-a", {"g": True}, t) == {"g": "gw-a"}


def test_a_silent_holder_loses_it_only_after_it_fenced_itself() -> None:
    leases, t = settled()
    leases.ask("gw-a", {"g": False}, t)
    start = t
    while True:
        t += LEASE_ASK_S
        holder = leases.ask("gw-b", {"g": False}, t)["g"]
        if holder == "gw-b":
            break
        assert holder == "gw-a"
    # gw-a stopped handing out FENCE_S after its last answer, well before
    assert t - start > LEASE_TIMEOUT_S > FENCE_S


def test_a_holder_that_leaves_hands_it_to_the_next_asker_at_once() -> None:
    leases, t = settled()
    leases.ask("gw-a", {"g": False}, t)
    leases.ask("gw-b", {"g": False}, t)
    assert leases.leave("gw-a", ["g"], t) == {"g": 1}  # gw-b still reads it
    assert leases.ask("gw-b", {"g": False}, t + 0.01) == {"g": "gw-b"}
    assert leases.leave("gw-b", ["g"], t + 0.02) == {"g": 0}  # the position may go
    assert "g" not in leases.holders()


def test_after_a_restart_only_the_holder_that_says_so_is_granted_at_first() -> None:
    """A new master knows no holder: the gateway that held the group asks saying so and
    keeps it; one that did not hold it waits out FENCE_S, by when any holder that did
    not ask has stopped on its own."""
    leases = Leases()
    assert leases.ask("gw-b", {"g": False}, 100.0) == {"g": None}
    assert leases.ask("gw-a", {"g": True}, 100.2) == {"g": "gw-a"}
    assert leases.ask("gw-b", {"h": False}, 100.3) == {"h": None}
    assert leases.ask("gw-b", {"h": False}, 100.0 + FENCE_S + 0.01) == {"h": "gw-b"}


def test_a_quiet_spell_longer_than_the_fence_starts_a_grace_again() -> None:
    leases, t = settled()
    t += FENCE_S + 1  # nobody asked (this node was not the master, say)
    assert leases.ask("gw-b", {"g": False}, t) == {"g": None}
    assert leases.ask("gw-b", {"g": False}, t + FENCE_S) == {"g": "gw-b"}


def test_groups_whose_gateways_all_went_silent_are_forgotten() -> None:
    leases, t = settled()
    leases.ask("gw-a", {"g": False}, t)
    t += LEASE_TIMEOUT_S + 1
    leases.ask("warm", {"other": False}, t)
    assert "g" not in leases.holders()
