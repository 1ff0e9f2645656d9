"""Shared subscriptions with members on two gateways over one store: each message goes
to one member of the group, whichever gateway it is on (store.leases)."""

from __future__ import annotations

import time

from tests.conftest import Server
from tests.ha.proxy import Proxy
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


def test_a_holder_cut_off_from_the_store_stops_and_the_other_takes_over(
        tmp_path, redis_server) -> None:
    """Gateway A holds the group and its link to the store is cut (a TCP proxy the test
    owns: packets dropped). B takes the group over within the lease timeout; once the
    link heals, A stays idle: every message reaches a member once."""
    store = Server(tmp_path / "store", "--notify", redis_server.url, command="store").start()
    host, port = store.native.rsplit(":", 1)
    link = Proxy((host, int(port)))
    a = Server(None, "--store", link.addr, "--notify", redis_server.url,
               command="gateway").start()
    b = Server(None, "--store", store.native, "--notify", redis_server.url,
               command="gateway").start()
    try:
        base = uid("sh")
        ma, mb = members(a, b, base)
        if probe(ma, mb, b.port, base) == 1:  # B holds it: hand it to A
            mb.disconnect()
            time.sleep(1.0)
            mb = Client(b.port, uid("mb"))
            mb.subscribe(f"$share/g/{base}/#", 1)
            assert probe(ma, mb, b.port, base) == 0
        link.cut()
        during = [f"c{i}".encode() for i in range(10)]
        publish(b.port, base, during)
        assert {m.payload for m in mb.expect(10, timeout=15)} == set(during)
        link.heal()
        time.sleep(3.0)  # A's link back: it asks again, and is told B holds the group
        after = [f"h{i}".encode() for i in range(10)]
        publish(b.port, base, after)
        got = drain(ma, mb, quiet=2.0)
        assert sorted(got) == sorted(after), got
        assert _all(ma) == []
        mb.disconnect()
    finally:
        link.cut()
        for srv in (a, b, store):
            srv.kill()
        link.close()
