"""A test network for store groups: one Linux network namespace per store node, joined
by a bridge in the test's own namespace, and partitions made from outside the processes
with routes (iproute2 only), as Jepsen cuts links between hosts.

Each node has three addresses, one per subnet, so that one kind of traffic can be cut
while the others flow:

- data  10.N.0.(11+i): the native port (clients, gateways, replication),
- raft  10.N.1.(11+i): the controller's Raft port,
- mgmt  10.N.2.(11+i): HTTP (the test reads /api/v1/cluster there; never cut).

The bridge holds 10.N.{0,1,2}.1, the test's (and the gateways') side. A cut between two
places adds a blackhole route on each side to the other's address of that kind: packets
of established connections are dropped (TCP retransmits them once the cut heals) and new
connections fail at once, as across a partitioned network. Needs root (CI runs as root).
"""

from __future__ import annotations

import itertools
import os
import random
import subprocess
from dataclasses import dataclass, field

KINDS = {"data": 0, "raft": 1, "mgmt": 2}
HOST = -1  # the test's own namespace (the bridge side: gateways, clients, Redis)


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True, timeout=10)


def require(why_not: str | None = None) -> None:
    """Skip the calling test when namespaces (or what `why_not` names) are missing, or
    fail it when LIGHTGATE_REQUIRE_NETNS is set (`make test`, CI)."""
    why_not = why_not or available()
    if why_not is None:
        return
    import pytest

    if os.environ.get("LIGHTGATE_REQUIRE_NETNS", "") not in ("", "0"):
        pytest.fail(why_not)
    pytest.skip(why_not)


def available() -> str | None:
    """None if namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"lgprobe{os.getpid()}"
    try:
        _ip("netns", "add", name)
        _ip("netns", "del", name)
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        return f"cannot make a network namespace: {exc}"
    return None


_NETS = itertools.count()


def _fresh_tag() -> str:
    """A name part no other network of this host has: the pid at a fixed width (two
    workers' pids never read as one) and a count within the process (three networks of
    one test drew the same random suffix once in CI)."""
    return f"{os.getpid() % 100000:05d}{next(_NETS) % 100:02d}"


def _free_net() -> int:
    """A second octet no other test network on this host uses: each pytest worker draws
    from its own range (tests in one worker run one at a time), skipping any in use."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    base = 100 + 30 * (int(worker) % 5 if worker.isdigit() else 0)
    out = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True,
                         timeout=10).stdout
    free = [n for n in range(base, base + 30) if f" 10.{n}." not in out]
    return random.choice(free or list(range(base, base + 30)))


@dataclass
class Net:
    """`n` namespaces on a bridge; `cut`/`heal` between them and the host side."""

    n: int
    net: int = field(default_factory=_free_net)
    tag: str = field(default_factory=_fresh_tag)
    cuts: set[tuple[int, int, str]] = field(default_factory=set)

    @property
    def bridge(self) -> str:
        return f"lgb{self.tag}"

    def ns(self, i: int) -> str:
        return f"lgn{self.tag}-{i}"

    def ip(self, i: int, kind: str) -> str:
        """Node i's address of `kind`; HOST: the bridge's."""
        last = 1 if i == HOST else 11 + i
        return f"10.{self.net}.{KINDS[kind]}.{last}"

    def prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program inside node i's namespace."""
        return ["ip", "netns", "exec", self.ns(i)]

    def up(self) -> Net:
        try:
            self._make()
        except BaseException:
            self.down()  # a half-made network would hold its names and subnet
            raise
        return self

    def _make(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        for kind in KINDS:
            _ip("addr", "add", f"{self.ip(HOST, kind)}/24", "dev", self.bridge)
        for i in range(self.n):
            ns, veth = self.ns(i), f"lgv{self.tag}{i}"
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge, "up")
            for kind in KINDS:
                _ip("-n", ns, "addr", "add", f"{self.ip(i, kind)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def _route(self, op: str, at: int, to: int, kind: str) -> None:
        where = [] if at == HOST else ["-n", self.ns(at)]
        _ip(*where, "route", op, "blackhole", f"{self.ip(to, kind)}/32", check=op == "add")

    def cut(self, a: int, b: int, kinds: tuple[str, ...] = ("data", "raft")) -> None:
        """Cut the link between a and b (node indexes or HOST) for these kinds of
        traffic, both ways."""
        for kind in kinds:
            key = (min(a, b), max(a, b), kind)
            if key in self.cuts:
                continue
            self._route("add", a, b, kind)
            self._route("add", b, a, kind)
            self.cuts.add(key)

    def isolate(self, i: int, kinds: tuple[str, ...] = ("data", "raft")) -> None:
        """Cut node i from every other node and from the host side."""
        for j in [*range(self.n), HOST]:
            if j != i:
                self.cut(i, j, kinds)

    def heal(self) -> None:
        for a, b, kind in sorted(self.cuts):
            self._route("del", a, b, kind)
            self._route("del", b, a, kind)
        self.cuts.clear()

    def down(self) -> None:
        for i in range(self.n):
            _ip("netns", "del", self.ns(i), check=False)
        _ip("link", "del", self.bridge, check=False)
