"""`lightgate gateway` on the native plane: its quiet plain-TCP publishers are carried
by the engine, whose appends go to `lightgate store` as native-protocol PUBLISH frames
(a Rust client), each PUBACK once the store's answer says stored. Both planes: with
LIGHTGATE_NATIVE=0 everything runs in Python, as before. Real processes, real Redis,
a real SIGKILL of the store mid-burst."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import trio

from gateway import mqtt
from serving import plane
from store import protocol as p
from store.client import NativeClient
from tests.conftest import RedisServer, Server
from tests.ha.cluster import read_topic
from tests.ha.test_disk_full_group import _mount, fill
from tests.mqtt.paho_client import Client
from tests.mqtt.raw import RawClient
from tests.native.tcp_proxy import TcpProxy
from tests.plane.test_handover import native_counters
from tests.security.helpers import ADMIN, add_user, allow
from tests.security.test_tls import SecureClient, port_of

PROMOTED = "promoted to the native plane"

PLANES = [
    pytest.param("native", marks=pytest.mark.skipif(
        plane.NATIVE is None or not hasattr(plane.NATIVE.Engine, "start_remote"),
        reason="the native data plane is not built")),
    "python",
]


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(params=PLANES)
def plane_name(request) -> str:
    return request.param


@pytest.fixture
def shape(plane_name: str, tmp_path, redis_server: RedisServer,
          monkeypatch) -> Iterator[tuple]:
    which = plane_name
    monkeypatch.setenv("LIGHTGATE_NATIVE", "1" if which == "native" else "0")
    store = Server(tmp_path / "store", "--notify", redis_server.url, command="store").start()
    gw = Server(None, "--store", store.native, "--notify", redis_server.url,
                "--io-threads", "1", command="gateway").start()
    yield which, store, gw
    for srv in (gw, store):
        if srv.proc is not None:
            assert srv.stop() == 0, srv.logs()[-3000:]


def store_stats(addr: str) -> dict:
    async def call() -> dict:
        async with NativeClient.open(addr) as c:
            return (await c.request(p.STATS, {}))[0]
    return trio.run(call)


def wait_promoted(gw: Server, client_id: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not any(f"client {client_id!r} (" in line and PROMOTED in line for line in gw.log):
        assert time.monotonic() < deadline, f"{client_id} not promoted: {gw.logs()[-3000:]}"
        time.sleep(0.02)


def publisher(gw: Server, which: str, version: int = 4) -> tuple[RawClient, str]:
    """A device: connected, and carried natively on the native plane."""
    cid = uid("dev")
    deadline = time.monotonic() + 20
    while True:  # (a gateway whose store is back may refuse CONNECT for a moment)
        dev = RawClient(gw.port, version=version, timeout=10)
        if dev.connect(cid).reason_code == 0:
            break
        dev.close()
        assert time.monotonic() < deadline
        time.sleep(0.2)
    if which == "native":
        wait_promoted(gw, cid)
    return dev, cid


def burst(dev: RawClient, topic: str, count: int, window: int = 8,
          stop: threading.Event | None = None) -> dict[int, int]:
    """QoS 1 publishes of b"%05d" % i, `window` in flight: {i: PUBACK reason code} of
    those answered before the connection ended (or `count` were)."""
    acked: dict[int, int] = {}
    sent: dict[int, int] = {}  # packet id -> i
    i = 0
    try:
        while len(acked) < count:
            while i < count and len(sent) < window and not (stop and stop.is_set()):
                pid = i % 60000 + 1
                dev.send(mqtt.Publish(topic, b"%05d" % i, 1, packet_id=pid))
                sent[pid] = i
                i += 1
            if not sent:
                break
            ack = dev.recv()
            assert isinstance(ack, mqtt.Puback), ack
            acked[sent.pop(ack.packet_id)] = ack.reason_code
    except (ConnectionError, OSError):
        pass  # 3.1.1: the gateway closes a connection whose publish was not stored
    return acked


def kill_mid_burst(store: Server, dev: RawClient, topic: str, first: int) -> dict[int, int]:
    """`burst` of 3,000 from `dev`, the store killed with SIGKILL once `first` were
    answered: {i: PUBACK reason code} of those answered before its connection ended."""
    acked: dict[int, int] = {}
    ran = threading.Thread(target=lambda: acked.update(burst(dev, topic, 3000)))
    ran.start()
    deadline = time.monotonic() + 20
    while len(acked) < first and ran.is_alive():  # (read without the lock: a count)
        assert time.monotonic() < deadline
        time.sleep(0.002)
    store.kill()
    ran.join(30)
    assert not ran.is_alive()
    dev.close()
    return acked


def test_ready_line_says_which_plane(shape) -> None:
    which, _, gw = shape
    assert gw.addrs["plane"] == which


def test_carried_publishes_are_stored_and_delivered_in_order_once(shape) -> None:
    which, store, gw = shape
    base = uid("fleet")
    topic = f"{base}/t"
    sub = Client(gw.port, uid("sub"))
    sub.subscribe(f"{base}/#", 1)
    dev, cid = publisher(gw, which)
    acked = burst(dev, topic, 300)
    assert acked == dict.fromkeys(range(300), 0)
    got = [m.payload for m in sub.expect(300, timeout=20)]
    assert got == [b"%05d" % i for i in range(300)]
    sub.expect_none(0.3)
    assert read_topic(store.native, base) == got  # stored once each, in order
    if which == "native":  # carried by the engine all along: never back in Python
        assert not any(f"client {cid!r} (" in line and "back from the native plane" in line
                       for line in gw.log), gw.logs()[-3000:]
        assert native_counters(gw)["lightgate_native_messages_in_qos1_total"] == 300
    # The store carries the gateway's connections natively on the native plane (its
    # subscribers heard of each message through the store's notify all the same).
    carried = store_stats(store.native)["native_carried"]
    assert (carried > 0) == (which == "native"), carried
    dev.close()
    sub.disconnect()


@pytest.mark.parametrize("version", [4, 5])
def test_store_killed_mid_burst_loses_nothing_acknowledged(shape, version: int) -> None:
    """Every PUBACKed (reason 0) message is in the store after it restarts, and the
    gateway serves again once the store is back. A publish whose answer was lost is
    refused on Python's path (5.0: 0x80; 3.1.1: its connection closed); the native
    gateway's waits to be sent again (test_..._every_publish_stored_once)."""
    which, store, gw = shape
    base = uid("kill")
    topic = f"{base}/t"
    dev, _ = publisher(gw, which, version)
    acked = kill_mid_burst(store, dev, topic, 50)
    stored_ok = [i for i, code in acked.items() if code == 0]
    assert stored_ok, acked
    if version == 5:
        assert set(acked.values()) <= {0, 0x80}, acked
    store.start()
    kept = read_topic(store.native, base)
    assert len(kept) == len(set(kept)), "a message stored twice"
    missing = {b"%05d" % i for i in stored_ok} - set(kept)
    assert not missing, f"{len(missing)} acknowledged messages lost: {sorted(missing)[:5]}"
    # Served again: a new device's publishes are stored.
    deadline = time.monotonic() + 20
    while True:
        dev, _ = publisher(gw, which)
        again = burst(dev, f"{base}/after", 20)
        dev.close()
        if again == dict.fromkeys(range(20), 0):
            break
        assert time.monotonic() < deadline, again
        time.sleep(0.2)


NATIVE_ONLY = pytest.mark.skipif(
    plane.NATIVE is None or not hasattr(plane.NATIVE.Engine, "start_remote"),
    reason="the native data plane is not built")


def resending_burst(dev: RawClient, topic: str, count: int, window: int = 8,
                    progress: list[int] | None = None) -> tuple[dict[int, int], int]:
    """`burst`, but a publish refused (0x80) is sent again, as a device that wants its
    message stored does: ({i: the last PUBACK's reason code}, refusals seen)."""
    acked: dict[int, int] = {}
    sent: dict[int, int] = {}  # packet id -> i
    todo = list(range(count - 1, -1, -1))  # a stack: refused ones go again first
    refusals, next_pid = 0, 1
    while len(acked) < count:
        while todo and len(sent) < window:
            i = todo.pop()
            dev.send(mqtt.Publish(topic, b"%05d" % i, 1, packet_id=next_pid))
            sent[next_pid] = i
            next_pid = next_pid % 60000 + 1
        ack = dev.recv()
        assert isinstance(ack, mqtt.Puback), ack
        i = sent.pop(ack.packet_id)
        if ack.reason_code == 0x80 and refusals < 2000:
            refusals += 1
            todo.append(i)
            time.sleep(0.01)  # (a device's pause before it tries again)
            continue
        acked[i] = ack.reason_code
        if progress is not None:
            progress.append(i)
    return acked, refusals


@NATIVE_ONLY
def test_store_killed_mid_burst_every_publish_stored_once(
        tmp_path, redis_server: RedisServer, monkeypatch) -> None:
    """The store killed with SIGKILL while four 5.0 devices publish, and started again:
    the gateway's frames whose answers were lost are sent again, stamped the same, once
    it is back, and the store keeps each once: no device sees a refusal, every message
    is stored exactly once, in each device's order. (Python's gateway refuses those
    publishes, and a device that sends one again may store it twice: at least once.)"""
    monkeypatch.setenv("LIGHTGATE_NATIVE", "1")
    store = Server(tmp_path / "store", "--notify", redis_server.url, command="store").start()
    gw = Server(None, "--store", store.native, "--notify", redis_server.url,
                "--io-threads", "1", command="gateway").start()
    try:
        base = uid("once")
        devs = [publisher(gw, "native", 5)[0] for _ in range(4)]
        for d in devs:
            d.sock.settimeout(60)
        results: dict[int, tuple[dict[int, int], int]] = {}
        progress: list[int] = []
        runs = [threading.Thread(target=lambda n=n, d=d: results.__setitem__(
            n, resending_burst(d, f"{base}{n}/t", 800, progress=progress)))
            for n, d in enumerate(devs)]
        for r in runs:
            r.start()
        deadline = time.monotonic() + 20
        while len(progress) < 200:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        store.kill()
        time.sleep(0.5)
        store.start()
        for r in runs:
            r.join(90)
        assert len(results) == 4, "a device did not finish"
        refused = sum(results[n][1] for n in range(4))
        twice = missing = unacked = 0
        kept = [read_topic(store.native, f"{base}{n}") for n in range(4)]
        for (acked, _), held in zip((results[n] for n in range(4)), kept, strict=True):
            twice += len(held) - len(set(held))
            missing += len({b"%05d" % i for i, code in acked.items() if code == 0} - set(held))
            unacked += sum(1 for code in acked.values() if code != 0)
        assert (refused, twice, missing, unacked) == (0, 0, 0, 0), (
            f"{refused} publishes refused and sent again, {twice} stored twice, "
            f"{missing} acknowledged and missing, {unacked} never acknowledged")
        assert kept == [[b"%05d" % i for i in range(800)]] * 4  # each device's in order
        for d in devs:
            d.close()
    finally:
        for srv in (gw, store):
            if srv.proc is not None:
                srv.stop()


class PublishSilencer(TcpProxy):
    """A proxy that makes the connection that next carries a PUBLISH frame go silent:
    the store gets the frame and stores it, and its answer, and all after it on that
    connection, never come back (the connection stays open)."""

    armed = False

    def _pump(self, src: socket.socket, dst: socket.socket,
              pair: tuple[socket.socket, socket.socket], answers: bool) -> None:
        if answers:
            super()._pump(src, dst, pair, answers)
            return
        try:
            while data := src.recv(65536):
                if self.armed and len(data) >= p.HEAD.size:
                    _, _, kind, code, _, _ = p.HEAD.unpack_from(data)
                    if kind == p.REQUEST and code == p.PUBLISH:
                        with self._lock:
                            self.armed = False
                            self._silent.add(dst)
                            self.silenced += 1
                dst.sendall(data)
        except OSError:
            pass
        self._close(pair)


@NATIVE_ONLY
def test_a_publish_whose_store_connection_went_silent_is_sent_again_and_stored_once(
        tmp_path, redis_server: RedisServer, monkeypatch) -> None:
    """A proxy between the gateway and the store forwards a PUBLISH frame, which the
    store stores, and its answer never comes: the node still answers a probe, so only
    the attempt's timeout (10 s, the SDK's) ends that connection; the frame goes again
    on a new one, stamped the same, and the store answers it as stored from before.
    The device's PUBACK says stored, and the message is in the store once."""
    monkeypatch.setenv("LIGHTGATE_NATIVE", "1")
    store = Server(tmp_path / "store", "--notify", redis_server.url, command="store").start()
    proxy = PublishSilencer(("127.0.0.1", store.native_port))
    gw = Server(None, "--store", proxy.addr, "--notify", redis_server.url,
                "--io-threads", "1", command="gateway").start()
    try:
        base = uid("silent")
        dev, _ = publisher(gw, "native", 5)
        dev.sock.settimeout(30)
        assert burst(dev, f"{base}/t", 5, window=1) == dict.fromkeys(range(5), 0)
        proxy.armed = True
        started = time.monotonic()
        dev.send(mqtt.Publish(f"{base}/t", b"%05d" % 5, 1, packet_id=500))
        ack = dev.recv()
        assert isinstance(ack, mqtt.Puback) and (ack.packet_id, ack.reason_code) == (500, 0)
        assert proxy.silenced == 1 and time.monotonic() - started >= 9
        later = burst(dev, f"{base}/t", 5, window=1)
        assert later == dict.fromkeys(range(5), 0)
        assert read_topic(store.native, base) == [b"%05d" % i for i in range(6)] + [
            b"%05d" % i for i in range(5)]
        dev.close()
    finally:
        proxy.close()
        for srv in (gw, store):
            if srv.proc is not None:
                srv.stop()


def test_a_websocket_publisher_is_carried_too(shape) -> None:
    """The gateway's WebSocket listener is the engine's on the native plane, as in serve:
    a quiet WebSocket publisher is carried, its publishes stored and delivered."""
    which, store, gw = shape
    base = uid("ws")
    sub = Client(gw.port, uid("sub"))
    sub.subscribe(f"{base}/#", 1)
    pub_id = uid("wpub")
    pub = SecureClient(port_of(gw, "ws"), pub_id, tls=None, transport="websockets")
    if which == "native":
        wait_promoted(gw, pub_id)
    for i in range(20):
        pub.publish(f"{base}/t", b"%02d" % i, 1)
    assert [m.payload for m in sub.expect(20, timeout=10)] == [b"%02d" % i for i in range(20)]
    assert read_topic(store.native, base) == [b"%02d" % i for i in range(20)]
    pub.disconnect()
    sub.disconnect()


def test_a_full_store_disk_is_quota_exceeded(tmp_path, redis_server: RedisServer,
                                             monkeypatch, plane_name: str) -> None:
    """The store's disk full: a carried 5.0 publisher's PUBACK says Quota exceeded
    (0x97), as Python's gateway says it, and nothing it was refused is stored."""
    monkeypatch.setenv("LIGHTGATE_NATIVE", "1" if plane_name == "native" else "0")
    disk = tmp_path / "disk"
    _mount(disk)
    store = gw = None
    try:
        store = Server(disk / "data", "--notify", redis_server.url, "--segment-size",
                       str(1 << 20), command="store").start()
        gw = Server(None, "--store", store.native, "--notify", redis_server.url,
                    "--io-threads", "1", command="gateway").start()
        base = uid("full")
        dev, _ = publisher(gw, plane_name, version=5)
        assert burst(dev, f"{base}/t", 5) == dict.fromkeys(range(5), 0)
        filler = fill(disk)
        # Past what the current segment has room for (1 MiB), the store's write fails.
        codes = {}
        for i in range(5, 5 + 64):
            dev.send(mqtt.Publish(f"{base}/t", b"%05d" % i + b"x" * (64 << 10), 1,
                                  packet_id=i))
            ack = dev.recv()
            assert isinstance(ack, mqtt.Puback), ack
            codes[i] = ack.reason_code
            if ack.reason_code:
                break
        assert set(codes.values()) == {0, 0x97} or set(codes.values()) == {0x97}, codes
        filler.unlink()
        kept = [m[:5] for m in read_topic(store.native, base)]
        assert kept == [b"%05d" % i for i in range(5)] + [
            b"%05d" % i for i, code in codes.items() if code == 0]
        dev.close()
    finally:
        for srv in (gw, store):
            if srv is not None and srv.proc is not None:
                srv.stop()
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_with_auth_the_engine_joins_as_the_node_and_keeps_the_acl(
        tmp_path, redis_server: RedisServer, monkeypatch, plane_name: str) -> None:
    """The store with authentication on: the engine's own store connection says the
    gateway's node credentials (--store-auth), and a carried device publishes only where
    its rights say (elsewhere: Not authorized, 0x87, from Python, as in serve)."""
    monkeypatch.setenv("LIGHTGATE_NATIVE", "1" if plane_name == "native" else "0")
    store = Server(tmp_path / "s", "--auth", "--init-user", f"{ADMIN[0]}:{ADMIN[1]}",
                   "--notify", redis_server.url, command="store").start()
    gw = None
    try:
        base = uid("acl")
        add_user(store, "gw", "gw-pw", node=True)
        add_user(store, "dev1", "dev1-pw")
        allow(store, "dev1", f"Topic:{base}/1/#", "PUB")
        gw = Server(None, "--store", store.native, "--store-auth", "gw:gw-pw", "--notify",
                    redis_server.url, "--io-threads", "1", command="gateway").start()
        assert gw.addrs["plane"] == plane_name
        dev = RawClient(gw.port, version=5, timeout=10)
        assert dev.connect("dev1", username="dev1", password=b"dev1-pw").reason_code == 0
        if plane_name == "native":
            wait_promoted(gw, "dev1")
        assert burst(dev, f"{base}/1/t", 10) == dict.fromkeys(range(10), 0)
        dev.send(mqtt.Publish(f"{base}/2/t", b"spoof", 1, packet_id=99))
        ack = dev.recv()
        assert isinstance(ack, mqtt.Puback) and ack.reason_code == 0x87, ack
        assert burst(dev, f"{base}/1/t", 1) == {0: 0}  # carried on
        dev.close()
        assert read_topic_as(store, base) == [b"%05d" % i for i in range(10)] + [b"00000"]
    finally:
        for srv in (gw, store):
            if srv is not None and srv.proc is not None:
                srv.stop()


def read_topic_as(store: Server, topic: str, partitions: int = 4) -> list[bytes]:
    """`read_topic`, as the admin (the store has authentication on)."""

    async def main() -> list[bytes]:
        out: list[bytes] = []
        async with NativeClient.open(store.native, credentials=ADMIN) as c:
            for part in range(partitions):
                offset = 0
                while True:
                    h, body = await c.request(p.PULL, {"queue": f"{topic}#{part}",
                                                       "offset": offset, "max": 512})
                    msgs = p.unpack_messages(h["messages"], body)
                    if not msgs:
                        break
                    out += [m.body for m in msgs]
                    offset = h["next_offset"]
        return out

    return trio.run(main)
