"""Gateways in front of a store group that misbehaves: a master that hangs (SIGSTOP, as a
long GC pause, a frozen VM or a stuck disk would) and a group with no master yet.

A gateway must outlive any store failure and follow the group's master: requests left
unanswered make it ask the other nodes who the master is, publishes caught on the hung
master are failed back (PUBACK 0x80) so the device sends them again, and nothing a
device saw acknowledged is lost. A gateway started before its group has a master waits,
one log line per period, and serves once there is one, without a restart."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import RedisServer, Server
from tests.ha.cluster import Group, cluster, wait_for
from tests.ha.load import Publisher, collect, subscriber
from tests.mqtt.paho_client import Client

STOP_S = 15.0  # how long the master stays stopped
FIRST_ACK_LIMIT_S = 8.0  # the election alone takes about 4.5 s
GROUP_FLAGS = ("--replication", "sync", "--min-insync", "2")


@pytest.fixture
def redis(redis_server: RedisServer) -> RedisServer:
    return redis_server


def _gateway(group: Group, redis: RedisServer) -> Server:
    return Server(None, "--store", group.addrs, "--notify", redis.url,
                  "--max-offline-messages", "10000000", command="gateway")


def _alive(*servers: Server) -> bool:
    return all(s.proc is not None and s.proc.poll() is None for s in servers)


def _first_ack_after(pubs: list[Publisher], t: float) -> float | None:
    after = [a for p in pubs for a in list(p.acked_at) if a > t]
    return min(after) - t if after else None


def test_hung_master_gateways_survive_and_follow_the_new_master(
        tmp_path: Path, redis: RedisServer) -> None:
    g = Group(tmp_path, 3, *GROUP_FLAGS, "--notify", redis.url).start()
    gws: list[Server] = []
    stopped: Server | None = None
    stats: dict = {}
    try:
        m = g.master(20)
        wait_for(lambda: len(g.insync(m)) == 3, 15, "all three in sync")
        gws = [_gateway(g, redis).start() for _ in range(2)]
        sub = subscriber(gws[1].port)
        sub.subscribe("ha/#", 1)
        pubs = [Publisher(gws[i % 2].port, f"p{i}") for i in range(4)]
        stop = threading.Event()
        threads = [threading.Thread(target=p.run, args=(stop,), daemon=True) for p in pubs]
        for t in threads:
            t.start()
        wait_for(lambda: sum(len(p.acked) for p in pubs) > 50, 20, "publishing under way")

        stopped = g.nodes[m]
        assert stopped.proc is not None
        stopped.proc.send_signal(signal.SIGSTOP)
        t_stop = time.monotonic()
        # Both gateways stay up for the whole stop, and PUBACKs resume long before it ends.
        first = None
        while time.monotonic() - t_stop < STOP_S:
            assert _alive(*gws), [gw.logs()[-3000:] for gw in gws]
            first = first or _first_ack_after(pubs, t_stop)
            time.sleep(0.2)
        stopped.proc.send_signal(signal.SIGCONT)
        stats["first_ack_after_stop_s"] = round(first, 2) if first else None
        new = g.master(5)
        assert new != m
        # The old master, back, takes no writes (it stepped down); the gateways stay with
        # the new one and publishing goes on.
        assert wait_for(lambda: cluster(stopped)["role"] != "master", 10, "a step-down")
        acked_back = sum(len(p.acked) for p in pubs)
        wait_for(lambda: sum(len(p.acked) for p in pubs) > acked_back + 20, 20,
                 "publishing to go on")
        stats["old_master_role"] = cluster(stopped)["role"]

        stop.set()
        for t in threads:
            t.join(20)
        for p in pubs:
            assert not p.error, p.error
        delivered = collect(sub, 5.0)
        acked = [a for p in pubs for a in p.acked]
        lost = set(acked) - set(delivered)
        stats.update(acked=len(acked), delivered=len(delivered),
                     distinct_delivered=len(set(delivered)), lost=len(lost),
                     refused=sum(p.refused for p in pubs),
                     timeouts=sum(p.timeouts for p in pubs))
        print("SIGSTOP of the master for", STOP_S, "s:", stats)
        assert _alive(*gws)
        assert first is not None and first < FIRST_ACK_LIMIT_S, stats
        assert stats["lost"] == 0, stats
        sub.disconnect()
    finally:
        if stopped is not None and stopped.proc is not None:
            stopped.proc.send_signal(signal.SIGCONT)
        _dump(gws, g)
        for gw in gws:
            if gw.proc is not None:
                gw.kill()
        g.stop()


def test_master_stopped_for_15_s_rejoins_as_a_replica(tmp_path: Path) -> None:
    g = Group(tmp_path, 3, *GROUP_FLAGS).start()
    stopped: Server | None = None
    try:
        m = g.master(20)
        wait_for(lambda: len(g.insync(m)) == 3, 15, "all three in sync")
        stopped = g.nodes[m]
        assert stopped.proc is not None
        stopped.proc.send_signal(signal.SIGSTOP)
        time.sleep(STOP_S)
        stopped.proc.send_signal(signal.SIGCONT)
        new = g.master(5)
        assert new != m
        wait_for(lambda: len(g.insync(new)) == 3, 20, "the old master back in sync")
        assert cluster(stopped)["role"] == "replica"
    finally:
        if stopped is not None and stopped.proc is not None:
            stopped.proc.send_signal(signal.SIGCONT)
        g.stop()


WAITING = re.compile(r" WARNING .*(waiting for the store|still no store master)")


def test_gateway_started_before_its_group_has_a_master_serves_once_it_has(
        tmp_path: Path, redis: RedisServer) -> None:
    g = Group(tmp_path, 3, *GROUP_FLAGS, "--notify", redis.url)
    gw = Server(None, "--store", g.addrs, "--notify", redis.url, command="gateway")
    started: list[BaseException | None] = []
    try:
        g.nodes[0].start()  # one of three: no majority, no election, no master
        t0 = time.monotonic()
        starter = threading.Thread(target=lambda: started.append(_start(gw)), daemon=True)
        starter.start()
        # Until it says it waits (its start-up takes seconds on a busy machine), then
        # some more: it must neither exit nor call itself ready without a master.
        wait_for(lambda: any(WAITING.search(ln) for ln in gw.logs().splitlines()), 30,
                 "the gateway saying it waits for a master")
        time.sleep(3.0)
        assert gw.proc is not None and gw.proc.poll() is None, gw.logs()[-3000:]
        assert not started, "ready without a store master"
        g.nodes[1].start()
        g.nodes[2].start()
        starter.join(60)
        waited = time.monotonic() - t0
        assert started == [None], (started, gw.logs()[-3000:])
        # It said why it waited, once per period, not once per attempt.
        lines = [ln for ln in gw.logs().splitlines() if WAITING.search(ln)]
        print(f"gateway ready after {waited:.1f} s, {len(lines)} waiting lines")
        assert 1 <= len(lines) <= waited / 5 + 3, lines
        g.master(20)
        sub = Client(gw.port, "late-sub", version=5)
        sub.subscribe("late/#", 1)
        pub = Client(gw.port, "late-pub", version=5)
        pub.publish("late/x", b"hello", qos=1)
        assert [m.payload for m in sub.expect(1)] == [b"hello"]
        sub.disconnect()
        pub.disconnect()
        assert gw.proc.poll() is None
    finally:
        _dump([gw], g)
        if gw.proc is not None:
            gw.kill()
        g.stop()


def _start(srv: Server) -> BaseException | None:
    try:
        srv.start()
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        return exc
    return None


def _dump(gws: list[Server], g: Group) -> None:
    dump = os.environ.get("LIGHTGATE_HA_DUMP")  # a directory for the processes' logs
    if dump:
        for i, srv in enumerate(gws):
            Path(dump, f"gateway{i}.log").write_text(srv.logs())
        for i, node in enumerate(g.nodes):
            Path(dump, f"store{i}.log").write_text(node.logs())

