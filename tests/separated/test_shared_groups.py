"""Shared subscriptions with members on two gateways over one store: each message goes
to one member of the group, whichever gateway it is on (store.leases)."""

from __future__ import annotations

import time

from tests.mqtt.paho_client import Client
from tests.separated.conftest import uid


def drain(*clients: Client, quiet: float = 0.5) -> list[bytes]:
    """Every payload the clients received until none came for `quiet` seconds."""
    out: list[bytes] = []
    last = time.monotonic()
    while time.monotonic() - last < quiet:
        for c in clients:
            while not c.messages.empty():
                out.append(c.messages.get().payload)
                last = time.monotonic()
        time.sleep(0.05)
    return out


def members(a, b, base: str) -> tuple[Client, Client]:
    ma, mb = Client(a.port, uid("ma")), Client(b.port, uid("mb"))
    ma.subscribe(f"$share/g/{base}/#", 1)
    mb.subscribe(f"$share/g/{base}/#", 1)
    return ma, mb


def publish(port: int, base: str, payloads: list[bytes]) -> None:
    pub = Client(port, uid("pub"))
    for body in payloads:
        pub.publish(f"{base}/x", body, 1)
    pub.disconnect()


def test_each_message_reaches_one_member_whichever_gateway_it_is_on(cluster) -> None:
    """Before, each gateway handed every message to a member of its own: twice."""
    _, (a, b), _ = cluster
    base = uid("sh")
    ma, mb = members(a, b, base)
    sent = [f"m{i}".encode() for i in range(40)]
    publish(a.port, base, sent[:20])
    publish(b.port, base, sent[20:])
    got = drain(ma, mb, quiet=2.5)  # (a fresh store grants its first lease after 1.5 s)
    assert sorted(got) == sorted(sent), f"{len(got)} received for {len(sent)} sent"
    ma.disconnect()
    mb.disconnect()


def probe(ma: Client, mb: Client, port: int, base: str) -> int:
    """Which of the two members (0: ma, 1: mb) the group hands out to: a message
    published once reaches exactly one (a fresh store grants its first lease after
    1.5 s)."""
    publish(port, base, [b"probe"])
    time.sleep(2.5)
    on = [len(_all(ma)), len(_all(mb))]
    assert sorted(on) == [0, 1], f"the probe reached the members {on} times"
    return on.index(1)


def test_when_the_holders_members_leave_the_other_gateway_goes_on(cluster) -> None:
    """The gateway handing out loses its last member: the other takes the group over
    where it was left, and its position in the store stays for it."""
    _, (a, b), _ = cluster
    base = uid("sh")
    ma, mb = members(a, b, base)
    holder, other = ((ma, mb), (mb, ma))[probe(ma, mb, a.port, base)]
    holder.disconnect()
    later = [f"l{i}".encode() for i in range(10)]
    publish(b.port, base, later)
    assert sorted(m.payload for m in other.expect(10, timeout=10)) == sorted(later)
    assert drain(other) == []  # nothing twice
    other.disconnect()


def test_a_killed_holder_is_replaced_and_nothing_is_lost(cluster) -> None:
    """SIGKILL of the gateway handing out: within the lease timeout the other one
    hands out, from where the killed one kept the group's position."""
    _, (a, b), _ = cluster
    base = uid("sh")
    ma, mb = members(a, b, base)
    killed, survivor, other = ((a, b, mb), (b, a, ma))[probe(ma, mb, b.port, base)]
    killed.kill()
    later = [f"k{i}".encode() for i in range(10)]
    publish(survivor.port, base, later)
    assert {m.payload for m in other.expect(10, timeout=15)} == set(later)
    other.disconnect()


def _all(c: Client) -> list:
    out = []
    while not c.messages.empty():
        out.append(c.messages.get())
    return out
