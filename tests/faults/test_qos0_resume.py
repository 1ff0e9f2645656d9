"""A persistent session's QoS 0 messages that were queued for a client and never written
to its socket: after the client leaves and comes back, the session resumes at them (the
gateway's unwritten output is not lost), live and in a replay. What the socket's buffers
held when the client left is lost, as QoS 0 allows (here the kernel took megabytes)."""

from __future__ import annotations

import re
import socket
import time
import uuid
from pathlib import Path

import pytest

from gateway import mqtt
from tests.conftest import Server
from tests.mqtt.raw import RawClient
from tests.mqtt.test_replay import publish

TOTAL = 8_000  # 1 KiB each: more than the socket's buffers and the gateway's output hold
READ_FIRST = 500
SNAPSHOT = 128  # a replay goes back to a snapshot: up to this many may come twice


def _message(i: int) -> bytes:
    return b"%08d" % i + b"." * 1016


class SlowClient:
    """A 3.1.1 persistent session over a socket with a small receive buffer: it reads
    `n` messages, then nothing, then leaves."""

    def __init__(self, port: int, cid: str) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.settimeout(10)
        self.sock.connect(("127.0.0.1", port))
        self.decoder = mqtt.Decoder(server=False, version=4)
        self.pending: list[object] = []
        self.send(mqtt.Connect(client_id=cid, protocol_level=4, clean_start=False))
        assert isinstance(self.recv(), mqtt.Connack)

    def send(self, packet: object) -> None:
        self.sock.sendall(mqtt.encode(packet, 4))

    def recv(self) -> object:
        while not self.pending:
            data = self.sock.recv(4096)
            assert data, "closed by the server"
            self.pending.extend(self.decoder.feed(data))
        return self.pending.pop(0)

    def publishes(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            p = self.recv()
            if isinstance(p, mqtt.Publish):
                out.append(int(p.payload[:8]))
        return out


def _rest_after(port: int, cid: str) -> list[int]:
    """Back again: every message until the last one."""
    again = RawClient(port, version=4, timeout=10)
    assert again.connect(cid, clean=False).session_present
    out: list[int] = []
    while not out or out[-1] != TOTAL - 1:
        p = again.recv()
        if isinstance(p, mqtt.Publish):
            out.append(int(p.payload[:8]))
    again.close()
    return out


def _leave_unread(client: SlowClient) -> None:
    """Stop reading while the gateway's output for it fills, then leave."""
    time.sleep(2.0)
    client.send(mqtt.Disconnect())
    client.sock.close()
    time.sleep(0.5)


@pytest.mark.timeout(180)
def test_a_replay_resumes_at_what_the_socket_took(tmp_path: Path) -> None:
    srv = Server(tmp_path).start()
    try:
        base = f"q0r{uuid.uuid4().hex[:8]}"
        publish(srv.port, [(f"{base}/{i % 3}", _message(i)) for i in range(TOTAL)], qos=1)
        cid = f"slow-{base}"
        client = SlowClient(srv.port, cid)
        client.send(mqtt.Subscribe(1, [(f"$replay/earliest/{base}/+",
                                        mqtt.SubscriptionOptions(0))]))
        assert client.publishes(READ_FIRST) == list(range(READ_FIRST))
        _leave_unread(client)
        assert srv.wait_log(f"replay of '{base}/+' for '{cid}': the client left with some "
                            "of it unwritten; it goes on from its last snapshot")
        rest = _rest_after(srv.port, cid)
        print(f"read {READ_FIRST}, left; resumed at {rest[0]}")
        assert rest == list(range(rest[0], TOTAL))
        assert rest[0] >= READ_FIRST - SNAPSHOT
    finally:
        srv.stop()


@pytest.mark.timeout(180)
def test_a_live_subscription_resumes_at_what_the_socket_took(tmp_path: Path) -> None:
    srv = Server(tmp_path).start()
    try:
        base = f"q0l{uuid.uuid4().hex[:8]}"
        cid = f"slow-{base}"
        client = SlowClient(srv.port, cid)
        client.send(mqtt.Subscribe(1, [(f"{base}/+", mqtt.SubscriptionOptions(0))]))
        assert isinstance(client.recv(), mqtt.Suback)
        publish(srv.port, [(f"{base}/{i % 3}", _message(i)) for i in range(TOTAL)], qos=1)
        assert client.publishes(READ_FIRST) == list(range(READ_FIRST))
        _leave_unread(client)
        # The wildcard queue is new: a message's offset in it is its number.
        m = re.search(rf"client '{cid}' left with (\d+) QoS 0 messages of '{base}/\+' "
                      r"unwritten: its session resumes at offset (\d+)", srv.logs())
        assert m, "nothing unwritten when it left"
        unwritten, at = int(m[1]), int(m[2])
        rest = _rest_after(srv.port, cid)
        print(f"read {READ_FIRST}, left with {unwritten} unwritten; resumed at {rest[0]}")
        assert rest == list(range(at, TOTAL))  # the unwritten ones first, none skipped
        assert unwritten > 100
    finally:
        srv.stop()
