"""A native gateway node in front of a store group whose master is killed with SIGKILL
mid-burst: the gateway's PUBLISH frames are stamped (an idempotent producer's id, epoch
and sequence), and those whose answers the dead master took are sent again, stamped the
same, to the master the group elects; it recognises the ones the old master had stored
(the producers' sequences travel with the log) and keeps every message once."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from serving import plane
from tests.conftest import RedisServer, Server
from tests.ha.cluster import Group, read_topic, wait_for
from tests.security.helpers import native
from tests.separated.test_native_gateway import publisher, resending_burst, uid

pytestmark = pytest.mark.skipif(
    plane.NATIVE is None or not hasattr(plane.NATIVE.Engine, "start_remote"),
    reason="the native data plane is not built")

DEVICES, COUNT = 4, 600


def carried(g: Group, i: int) -> int:
    return int(native(g.nodes[i], "STATS", creds=None)["native_carried"])


def test_master_killed_mid_burst_every_publish_stored_once_on_the_new_master(
        tmp_path: Path, redis_server: RedisServer, monkeypatch) -> None:
    monkeypatch.setenv("LIGHTGATE_NATIVE", "1")
    monkeypatch.setenv("LIGHTGATE_GROUP_NATIVE", "1")  # the master's native server too
    g = Group(tmp_path, 3, "--replication", "sync", "--min-insync", "2", "--notify",
              redis_server.url).start()
    gw: Server | None = None
    try:
        m = g.master(20)
        wait_for(lambda: len(g.insync(m)) == 3, 15, "all three in sync")
        before = carried(g, m)
        gw = Server(None, "--store", g.addrs, "--notify", redis_server.url,
                    "--io-threads", "1", command="gateway").start()
        base = uid("gonce")
        devs = [publisher(gw, "native", 5)[0] for _ in range(DEVICES)]
        for d in devs:
            d.sock.settimeout(60)
        results: dict[int, tuple[dict[int, int], int]] = {}
        progress: list[int] = []
        runs = [threading.Thread(target=lambda n=n, d=d: results.__setitem__(
            n, resending_burst(d, f"{base}{n}/t", COUNT, progress=progress)))
            for n, d in enumerate(devs)]
        for r in runs:
            r.start()
        deadline = time.monotonic() + 30
        while len(progress) < 200:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # The master's native server carries the gateway's connection (its PUBLISH
        # frames answered natively, held for the in-sync set): more carried since the
        # gateway came than this STATS request's own connection.
        assert carried(g, m) >= before + 2
        g.nodes[m].kill()
        for r in runs:
            r.join(120)
        assert len(results) == DEVICES, "a device did not finish"
        new = g.master(10)
        assert new != m
        addr = f"{g.nodes[new].host}:{g.nodes[new].native_port}"
        refused = sum(results[n][1] for n in range(DEVICES))
        kept = [read_topic(addr, f"{base}{n}") for n in range(DEVICES)]
        twice = sum(len(k) - len(set(k)) for k in kept)
        missing = sum(len({b"%05d" % i for i, code in results[n][0].items() if code == 0}
                          - set(kept[n])) for n in range(DEVICES))
        unacked = sum(1 for n in range(DEVICES) for c in results[n][0].values() if c)
        print("master killed mid-burst:", dict(refused=refused, twice=twice,
                                               missing=missing, unacked=unacked))
        assert (refused, twice, missing, unacked) == (0, 0, 0, 0), (
            f"{refused} publishes refused and sent again, {twice} stored twice, "
            f"{missing} acknowledged and missing, {unacked} never acknowledged")
        assert kept == [[b"%05d" % i for i in range(COUNT)]] * DEVICES
        for d in devs:
            d.close()
    finally:
        if gw is not None and gw.proc is not None:
            gw.kill()
        g.stop()
