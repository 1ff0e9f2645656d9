"""kill -9 `lightgate serve --flush sync` under QoS 2 load at random moments: each
message a QoS 2 publisher sends (and, after reconnecting, resends with DUP until its
PUBCOMP) is stored exactly once, however the crash cut the exchange (MQTT's exactly-once
promise, kept across a crash)."""

from __future__ import annotations

import collections
import random
import threading
import time
from collections.abc import Callable
from functools import partial

from gateway import mqtt
from tests.conftest import Server
from tests.faults.persistent import drain, kill_during
from tests.mqtt.raw import RawClient

PUBLISHERS = 2
WINDOW = 16  # QoS 2 exchanges in flight per publisher


class Qos2Publisher:
    """A persistent-session QoS 2 publisher whose state outlives its connections, as a
    device's would: on reconnect it resends PUBLISH (DUP) for exchanges without a PUBREC
    and PUBREL for those with one (MQTT §4.4)."""

    def __init__(self, name: str, topic: str = "q2/load") -> None:
        self.name, self.topic = name, topic
        self.sent = 0  # numbers 0..sent-1 have been handed to the broker at least once
        self.unreceived: dict[int, bytes] = {}  # pid -> payload, no PUBREC yet
        self.released: set[int] = set()  # pids with PUBREL sent, no PUBCOMP yet

    def _publish(self, c: RawClient, pid: int, dup: bool) -> None:
        c.send(mqtt.Publish(self.topic, self.unreceived[pid], qos=2, dup=dup, packet_id=pid))

    def run(self, port: int, stop: threading.Event, more: bool = True) -> None:
        """Until `stop` (or, with more=False, until nothing is in flight) or the broker
        dies. New numbers only while `more`."""
        try:
            c = RawClient(port, timeout=2.0)
            c.connect(self.name, clean=False)
            for pid in sorted(self.unreceived):
                self._publish(c, pid, dup=True)
            for pid in sorted(self.released):
                c.send(mqtt.Pubrel(pid))
            while not stop.is_set() and (more or self.unreceived or self.released):
                while more and len(self.unreceived) + len(self.released) < WINDOW:
                    pid = self.sent % 65535 + 1
                    self.unreceived[pid] = f"{self.name}-{self.sent}".encode()
                    self.sent += 1
                    self._publish(c, pid, dup=False)
                ack = c.recv()
                if isinstance(ack, mqtt.Pubrec) and ack.packet_id in self.unreceived:
                    assert ack.reason_code == 0, ack
                    del self.unreceived[ack.packet_id]
                    self.released.add(ack.packet_id)
                    c.send(mqtt.Pubrel(ack.packet_id))
                elif isinstance(ack, mqtt.Pubcomp):
                    self.released.discard(ack.packet_id)
            c.close()
        except (OSError, ConnectionError):
            pass  # the broker was killed: the state above says what to resend


def test_kill_9_under_qos2_load_stores_each_message_once(tmp_path) -> None:
    srv = Server(tmp_path / "d", "--flush", "sync", "--max-offline-messages",
                 "10000000").start()
    sub = RawClient(srv.port)
    sub.connect("q2-sub", clean=False)
    sub.subscribe("q2/#", 1)  # offline until the end: it counts stored copies
    sub.close()
    rng = random.Random(19)
    pubs = [Qos2Publisher(f"q2p{n}") for n in range(PUBLISHERS)]
    kill_during(srv, 3, rng, (0.8, 2.0), lambda _, stop: [
        threading.Thread(target=p.run, args=(srv.port, stop)) for p in pubs])
    # Finish every exchange the crashes cut (bounded: a few reconnects, 30 s).
    deadline = time.monotonic() + 30
    while any(p.unreceived or p.released for p in pubs) and time.monotonic() < deadline:
        stop = threading.Event()
        for p in pubs:
            p.run(srv.port, stop, more=False)
    assert not any(p.unreceived or p.released for p in pubs), "exchanges left unfinished"
    found = collections.Counter(drain(srv.port, "q2-sub"))
    expected = {f"{p.name}-{i}".encode() for p in pubs for i in range(p.sent)}
    lost = expected - set(found)
    duplicates = {m: n for m, n in found.items() if n > 1}
    print(f"sent {len(expected)}, stored {sum(found.values())}, lost {len(lost)}, "
          f"duplicated {len(duplicates)}; resends recognised after a restart: "
          f"{srv.logs().count('stored before a restart')}")
    assert len(expected) > 200
    assert not lost, sorted(lost)[:10]
    assert not duplicates, sorted(duplicates.items())[:10]
    assert set(found) == expected
    assert srv.stop() == 0


def test_packet_id_reused_after_a_restart_is_a_new_message(tmp_path) -> None:
    """A completed exchange's record keeps its key: a later PUBLISH with the same packet
    id (DUP set, as a client resending one whose first try never reached the broker) is
    stored, not taken for that old record's resend."""
    srv = Server(tmp_path / "d", "--flush", "sync").start()
    sub = RawClient(srv.port)
    sub.connect("reuse-sub", clean=False)
    sub.subscribe("q2/reuse", 1)
    sub.close()
    pub = Qos2Publisher("reuse", "q2/reuse")
    pub.unreceived[7] = b"first"
    pub.run(srv.port, threading.Event(), more=False)
    assert not pub.unreceived and not pub.released
    srv.kill()
    srv.start()
    c = RawClient(srv.port)
    assert c.connect("reuse", clean=False).session_present
    c.send(mqtt.Publish("q2/reuse", b"second", qos=2, dup=True, packet_id=7))
    assert isinstance(c.recv(), mqtt.Pubrec)
    c.send(mqtt.Pubrel(7))
    assert isinstance(c.recv(), mqtt.Pubcomp)
    c.close()
    assert drain(srv.port, "reuse-sub", idle_s=2.0) == [b"first", b"second"]
    assert srv.stop() == 0


class Qos2Receiver:
    """A persistent-session QoS 2 subscriber whose state outlives its connections: a
    message is the application's when its PUBLISH first comes (MQTT's method B); a
    PUBLISH whose packet id awaits PUBREL is a resend; PUBREL ends the exchange."""

    def __init__(self, port: int, client_id: str) -> None:
        self.port, self.client_id = port, client_id
        self.awaiting: dict[int, bytes] = {}  # PUBREC sent, no PUBREL yet
        self.got: collections.Counter[bytes] = collections.Counter()
        self.c: RawClient | None = None

    def connect(self) -> bool:
        self.c = RawClient(self.port, timeout=5.0)
        return self.c.connect(self.client_id, clean=False).session_present

    def read(self) -> list[object]:
        """The packets of one read (or those the CONNECT's read left)."""
        c = self.c
        assert c is not None
        if c.pending:
            packets, c.pending = c.pending, []
            return packets
        data = c.sock.recv(65536)
        if not data:
            raise ConnectionError("closed by the server")
        return c.decoder.feed(data)

    def answer(self, packets: list[object], pubrec: bool = True) -> list[object]:
        """Take `packets` in; the answers go in one write (`pubrec`: PUBREC too)."""
        out: list[object] = []
        for p in packets:
            if isinstance(p, mqtt.Publish):
                if p.packet_id not in self.awaiting:
                    self.got[p.payload] += 1
                    self.awaiting[p.packet_id] = p.payload
                if pubrec:
                    out.append(mqtt.Pubrec(p.packet_id))
            elif isinstance(p, mqtt.Pubrel):
                self.awaiting.pop(p.packet_id, None)
                out.append(mqtt.Pubcomp(p.packet_id))
        assert self.c is not None
        if out:
            self.c.send_raw(b"".join(mqtt.encode(x, 4) for x in out))
        return out

    def finished(self, sent: set[bytes]) -> bool:
        return sent <= self.got.keys() and not self.awaiting

    def until(self, done: Callable[[], bool], idle_s: float) -> None:
        """Take and answer everything until `done()`, or `idle_s` of quiet."""
        assert self.c is not None
        self.c.sock.settimeout(idle_s)
        try:
            while not done():
                self.answer(self.read())
        except TimeoutError:
            pass


def publish_qos2(port: int, payloads: list[bytes]) -> None:
    pub = RawClient(port)
    pub.connect("q2-pub")
    for i, body in enumerate(payloads, 1):
        pub.send(mqtt.Publish("q2o/t", body, qos=2, packet_id=i))
    for _ in payloads:
        rec = pub.recv()
        assert isinstance(rec, mqtt.Pubrec)
        pub.send(mqtt.Pubrel(rec.packet_id))
    for _ in payloads:
        assert isinstance(pub.recv(), mqtt.Pubcomp)
    pub.close()


def test_kill_9_mid_qos2_delivery_never_gives_a_subscriber_a_message_twice(
        tmp_path) -> None:
    """kill -9 at the two points where a QoS 2 delivery's stored state fell behind what
    the subscriber saw: right after it got PUBREL for a window of messages (the state
    was kept after the PUBREL went out: a restart resent the PUBLISH, new to a client
    that had released it), and right after it completed them (the in-flight record
    went before the offsets said they were sent: a restart delivered them again). Each
    message reaches the application once; a resend it is owed is a resend."""
    srv = Server(tmp_path / "d", "--flush", "sync").start()
    rx = Qos2Receiver(srv.port, "q2-out")
    rx.connect()
    assert rx.c is not None and rx.c.subscribe("q2o/#", 2).reason_codes == [2]
    sent: list[bytes] = []
    for n in range(4):
        batch = [b"%d-%d" % (n, i) for i in range(64)]
        sent += batch
        publish_qos2(srv.port, batch)
        if n % 2 == 0:  # PUBREC for the whole window at once; kill once PUBRELs came
            publishes: list[object] = []
            while len(publishes) < 32:
                packets = rx.read()
                rx.answer(packets, pubrec=False)
                publishes += [p for p in packets if isinstance(p, mqtt.Publish)]
            rx.c.send_raw(b"".join(mqtt.encode(mqtt.Pubrec(p.packet_id), 4)
                                   for p in publishes))
            while not rx.answer(rx.read()):  # PUBCOMP for the PUBRELs of one read
                pass
        else:  # every exchange completed, then the kill
            rx.until(partial(rx.finished, set(sent)), 5.0)
            time.sleep(0.05)
        srv.kill()
        rx.c.close()
        srv.start()
        assert rx.connect()
        rx.until(lambda: False, 1.0)  # what it is owed, and anything it is not
    assert rx.c is not None
    rx.c.close()
    twice = sorted(m for m, k in rx.got.items() if k > 1)
    assert not twice, f"{len(twice)} messages delivered twice: {twice[:8]}"
    assert set(rx.got) == set(sent) and not rx.awaiting
    assert srv.stop() == 0
