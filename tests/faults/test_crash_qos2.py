"""kill -9 `lightgate serve --flush sync` under QoS 2 load at random moments: each
message a QoS 2 publisher sends (and, after reconnecting, resends with DUP until its
PUBCOMP) is stored exactly once, however the crash cut the exchange (MQTT's exactly-once
promise, kept across a crash)."""

from __future__ import annotations

import collections
import random
import threading
import time

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
