"""A native client that sends requests and reads none of the answers, against a real
`lightgate serve`: what its answers hold in the store stays within the connection's
budget (--native-max-unsent-bytes) plus one answer, a device's round trips go on at
their pace meanwhile, and every answer still arrives once the client reads. Before the
budget, 40 unread HISTORY answers of 16 MiB held +641 MiB."""

from __future__ import annotations

import socket
import statistics
import time
from pathlib import Path

import pytest

from store import protocol as p
from store.sdk import Producer
from tests.conftest import Server
from tests.faults.hostile import MiB, RssPeak
from tests.faults.hostile import rss as _rss
from tests.mqtt.paho_client import Client

BUDGET = 32 * MiB  # the default
# The interpreter's and allocator's slack over what is held (what any burst of large
# reads costs, whatever the budget): measured 20-40 MiB here.
SLACK = 64 * MiB
# Each attack: requests sent at once, what each answer may hold, what each must hold
# once read (bodies), and the request.
HISTORY = (40, 16 * MiB, 16 * MiB, lambda rid: p.Frame(p.REQUEST, p.HISTORY, rid, {
    "filter": "big/#", "since": "earliest", "max": 4096, "max_bytes": 16 * MiB}))
PULL = (64, 4 * MiB, 3 * MiB, lambda rid: p.Frame(p.REQUEST, p.PULL, rid, {
    "queue": "big/0", "offset": 0, "max": 1024}))  # 8 MiB there; 4 MiB by default


def _round_trips(c: Client, topic: str, n: int) -> list[float]:
    """Seconds from each QoS 1 publish to its delivery back."""
    out = []
    for i in range(n):
        started = time.perf_counter()
        c.publish(topic, b"%d" % i, 1)
        c.expect(1)
        out.append(time.perf_counter() - started)
    return out


def _native_round_trips(port: int, n: int) -> list[float]:
    """Seconds per QUEUE_RANGE round trip of another native client."""
    out = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        decoder = p.FrameDecoder()
        for i in range(n):
            started = time.perf_counter()
            s.sendall(p.encode_frame(p.Frame(p.REQUEST, p.QUEUE_RANGE, i + 1,
                                             {"queue": "rt/device"})))
            while not decoder.feed(s.recv(1 << 16)):
                pass
            out.append(time.perf_counter() - started)
    return out


def _read_answers(sock: socket.socket, n: int) -> list[int]:
    """The body sizes of the next `n` frames."""
    sock.settimeout(60)
    decoder, sizes = p.FrameDecoder(), []
    while len(sizes) < n:
        data = sock.recv(1 << 20)
        assert data, f"closed after {len(sizes)} answers"
        for frame in decoder.feed(data):
            assert frame.kind == p.RESPONSE, frame.header
            sizes.append(len(frame.body))
    return sizes


@pytest.mark.timeout(180)
@pytest.mark.parametrize("attack", [HISTORY, PULL], ids=["HISTORY", "PULL"])
def test_unread_answers_stay_within_the_connections_budget(tmp_path: Path,
                                                            attack: tuple) -> None:
    requests, answer, least, frame = attack
    srv = Server(tmp_path / "data").start()
    try:
        with Producer(srv.native) as producer:  # 24 MiB of history under big/#
            for i in range(24):
                producer.send("big", bytes([i]) * MiB, mqtt_topic=f"big/{i % 3}")
        device = Client(srv.port, "device", version=5)
        device.subscribe("rt/device", 1)
        _round_trips(device, "rt/device", 20)  # warm
        baseline = _round_trips(device, "rt/device", 60)
        native_baseline = _native_round_trips(srv.native_port, 200)
        base = _rss(srv.proc.pid)
        peak = RssPeak(srv.proc.pid)
        attacker = socket.create_connection(("127.0.0.1", srv.native_port))
        attacker.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        try:
            attacker.sendall(b"".join(p.encode_frame(frame(i + 1)) for i in range(requests)))
            time.sleep(1.0)  # the store reads what it will
            during = _round_trips(device, "rt/device", 60)
            native_during = _native_round_trips(srv.native_port, 200)
            time.sleep(2.0)
            grown = peak.stop() - base
            stats = _store_stats(srv)
            print(f"{requests} unread {p.CODE_NAMES[frame(0).code]} answers of up to "
                  f"{answer // MiB} MiB: RSS +"
                  f"{grown / MiB:.0f} MiB (base {base / MiB:.0f} MiB), held "
                  f"{stats.get('held', 0) / MiB:.1f} MiB, peak "
                  f"{stats.get('peak', 0) / MiB:.1f} MiB; "
                  f"device round trip p50 {statistics.median(baseline) * 1000:.2f} ms "
                  f"before, {statistics.median(during) * 1000:.2f} ms during, max "
                  f"{max(during) * 1000:.1f} ms; another native client's p50 "
                  f"{statistics.median(native_baseline) * 1000:.2f} ms before, "
                  f"{statistics.median(native_during) * 1000:.2f} ms during, max "
                  f"{max(native_during) * 1000:.1f} ms")
            assert stats.get("limit") == BUDGET and stats["paused"] > 0
            assert stats["peak"] <= BUDGET + answer + MiB
            assert grown < BUDGET + answer + SLACK, f"RSS grew {grown / MiB:.0f} MiB"
            assert statistics.median(during) <= 2 * statistics.median(baseline) + 0.002
            assert max(during) < 0.5
            assert statistics.median(native_during) <= \
                2 * statistics.median(native_baseline) + 0.002
            assert max(native_during) < 0.5
            # Nothing is lost: read, every answer comes, each a whole batch.
            sizes = _read_answers(attacker, requests)
            assert len(sizes) == requests and all(s >= least for s in sizes), sizes
        finally:
            peak.stop()
            attacker.close()
        device.disconnect()
    finally:
        assert srv.stop() == 0, srv.logs()[-3000:]


def _store_stats(srv: Server) -> dict:
    with socket.create_connection(("127.0.0.1", srv.native_port), timeout=10) as s:
        s.sendall(p.encode_frame(p.Frame(p.REQUEST, p.STATS, 1, {})))
        decoder = p.FrameDecoder()
        while True:
            frames = decoder.feed(s.recv(1 << 16))
            if frames:
                return frames[0].header.get("native_answer_budget", {})

