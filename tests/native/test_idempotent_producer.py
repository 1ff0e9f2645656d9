"""Idempotent producers against a real `lightgate serve`: a send whose answer a TCP proxy
cut is sent again and stored once, in order; duplicates keep their offsets across a
kill -9; and bad input (a gap, a forged id, another user's id, past the budget) is
refused with a clear error and nothing appended."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
import trio

from lightgate import AsyncProducer, DeliveryTimeout, Producer
from store import protocol as p
from store.common import StoreUnavailable
from store.record import Message
from tests.conftest import ROOT, Server
from tests.ha.cluster import read_topic
from tests.native.tcp_proxy import TcpProxy
from tests.security.helpers import ADMIN, add_user, allow, auth_server, native


def uid(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


def send(srv: Server, topic: str, bodies: list[bytes], producer: str | None, seq: int = 0,
         creds: tuple[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    metas, body = p.pack_messages([Message(topic, b, key="k") for b in bodies])
    header: dict[str, Any] = {"topic": topic, "messages": metas, **extra}
    if producer is not None:
        header.update(producer=producer, seq=seq)
    return native(srv, "SEND", header, creds, body)


def stored(srv: Server, topic: str) -> list[bytes]:
    return read_topic(srv.native, topic)


def test_a_send_whose_answer_was_cut_is_stored_once_in_order(shared_server: Server) -> None:
    topic = uid("cut")
    proxy = TcpProxy(("127.0.0.1", shared_server.native_port))
    try:
        with Producer(proxy.addr) as producer:
            for i in range(200):
                if i % 20 == 10:
                    proxy.cut_next_answer()  # stored by the store, never acknowledged
                producer.send(topic, b"%04d" % i, key="one-queue")
            resent = producer._portal.obj.resent
        assert proxy.cuts >= 10 and resent >= 10
    finally:
        proxy.close()
    assert stored(shared_server, topic) == [b"%04d" % i for i in range(200)]


def test_a_send_whose_connection_went_silent_is_sent_again_on_a_new_one(
        shared_server: Server) -> None:
    """The proxy forwards the request, the store appends it, and no answer ever comes
    on that connection: each attempt waits `timeout`, then the producer leaves the
    connection and sends the same sequence on a new one, until the delivery timeout."""
    topic = uid("silent")
    proxy = TcpProxy(("127.0.0.1", shared_server.native_port))
    try:
        with Producer(proxy.addr, timeout=0.5, delivery_timeout=20) as producer:
            for i in range(300):
                if i % 50 == 25:
                    proxy.silence_next_answer()  # appended by the store, never answered
                producer.send(topic, b"%04d" % i, key="one-queue")
            resent = producer._portal.obj.resent
        assert proxy.silenced == 6 and resent >= 6
    finally:
        proxy.close()
    assert stored(shared_server, topic) == [b"%04d" % i for i in range(300)]


def test_the_async_producer_sends_again_on_a_new_connection(shared_server: Server) -> None:
    topic = uid("asilent")
    proxy = TcpProxy(("127.0.0.1", shared_server.native_port))

    async def run() -> int:
        async with AsyncProducer(proxy.addr, timeout=0.5, delivery_timeout=20) as producer:
            for i in range(20):
                if i % 10 == 5:
                    proxy.silence_next_answer()
                await producer.send(topic, b"%02d" % i, key="one-queue")
            return producer.resent

    try:
        assert trio.run(run) >= 2 and proxy.silenced == 2
    finally:
        proxy.close()
    assert stored(shared_server, topic) == [b"%02d" % i for i in range(20)]


def test_a_send_never_answered_fails_after_the_delivery_timeout_as_maybe_stored(
        shared_server: Server) -> None:
    topic = uid("mute")
    proxy = TcpProxy(("127.0.0.1", shared_server.native_port))
    try:
        with Producer(proxy.addr, timeout=0.5, delivery_timeout=2.5) as producer:
            producer.send(topic, b"a")
            for _ in range(100):  # every connection from now on: the answers vanish
                proxy.silence_next_answer()
            began = time.monotonic()
            with pytest.raises(DeliveryTimeout, match="may have been stored") as failed:
                producer.send(topic, b"b")
            took = time.monotonic() - began
            assert failed.value.maybe_stored and isinstance(failed.value, StoreUnavailable)
            assert 2.5 <= took < 10, took
    finally:
        proxy.close()
    assert stored(shared_server, topic) == [b"a", b"b"]  # every attempt the same: once


def test_a_send_that_never_reached_the_store_fails_as_not_stored(
        shared_server: Server) -> None:
    topic = uid("away")
    proxy = TcpProxy(("127.0.0.1", shared_server.native_port))
    try:
        with Producer(proxy.addr, timeout=0.5, delivery_timeout=1.5) as producer:
            producer.send(topic, b"a")
            proxy.close()  # the connection is cut, and new ones are refused
            client = producer._portal.obj.client
            deadline = time.monotonic() + 10
            while client.connected and time.monotonic() < deadline:
                time.sleep(0.01)  # (a send on the cut connection before the client saw
                # the cut would go out, and its answer be lost: "may have been stored")
            with pytest.raises(DeliveryTimeout, match="was not stored") as failed:
                producer.send(topic, b"b")
            assert not failed.value.maybe_stored
    finally:
        proxy.close()
    assert stored(shared_server, topic) == [b"a"]


def test_without_idempotence_the_cut_send_fails_to_the_caller(shared_server: Server) -> None:
    """What `idempotent=False` keeps: at least once, the caller decides to send again."""
    topic = uid("plain")
    proxy = TcpProxy(("127.0.0.1", shared_server.native_port))
    try:
        with Producer(proxy.addr, idempotent=False) as producer:
            producer.send(topic, b"a")
            proxy.cut_next_answer()
            with pytest.raises(Exception, match="lost|unavailable"):
                producer.send(topic, b"b")
    finally:
        proxy.close()
    assert stored(shared_server, topic) == [b"a", b"b"]  # stored, though it "failed"


def test_bad_input_is_refused_and_nothing_is_appended(shared_server: Server) -> None:
    topic = uid("bad")
    pid = native(shared_server, "PRODUCER_INIT", creds=None)["producer"]
    first = send(shared_server, topic, [b"a", b"b"], pid, 0)["results"]
    dup = send(shared_server, topic, [b"a", b"b"], pid, 0)["results"]
    assert [r["msg_id"] for r in dup] == [r["msg_id"] for r in first]
    with pytest.raises(p.RemoteError, match="sequence gap.*stored up to sequence 1") as gap:
        send(shared_server, topic, [b"x"], pid, 5)
    assert gap.value.status == 409
    with pytest.raises(p.RemoteError, match="unknown producer id") as forged:
        send(shared_server, topic, [b"x"], "0123456789abcdef", 0)
    assert forged.value.status == 410
    with pytest.raises(p.RemoteError, match="integers from 0"):
        send(shared_server, topic, [b"x"], pid, -1)
    with pytest.raises(p.RemoteError, match="'lg_producer' is the store's own"):
        metas, body = p.pack_messages([Message(topic, b"x", properties={"lg_producer": 1})])
        native(shared_server, "SEND", {"topic": topic, "messages": metas}, None, body)
    assert stored(shared_server, topic) == [b"a", b"b"]
    assert send(shared_server, topic, [b"c"], pid, 2)["results"][0]["msg_id"]


def test_a_producer_id_is_its_users_alone(tmp_path: Path) -> None:
    srv = auth_server(tmp_path)
    try:
        for user in ("alice", "bob"):
            add_user(srv, user, f"{user}-pw")
            allow(srv, user, "Topic:orders", "PUB,SUB")
        alice, bob = ("alice", "alice-pw"), ("bob", "bob-pw")
        pid = native(srv, "PRODUCER_INIT", creds=alice)["producer"]
        send(srv, "orders", [b"1"], pid, 0, alice)
        with pytest.raises(p.RemoteError, match="belongs to another user") as other:
            send(srv, "orders", [b"2"], pid, 1, bob)
        assert other.value.status == 403
        # A name gives its user the same id again, and another user a different one.
        named = native(srv, "PRODUCER_INIT", {"name": "job-7"}, alice)["producer"]
        assert native(srv, "PRODUCER_INIT", {"name": "job-7"}, alice)["producer"] == named
        assert native(srv, "PRODUCER_INIT", {"name": "job-7"}, bob)["producer"] != named
        assert read_topic_as(srv, "orders", ADMIN) == [b"1"]
    finally:
        srv.stop()


def read_topic_as(srv: Server, topic: str, creds: tuple[str, str]) -> list[bytes]:
    out = []
    for part in range(4):
        reply = _pull(srv, f"{topic}#{part}", creds)
        out += reply
    return out


def _pull(srv: Server, queue: str, creds: tuple[str, str]) -> list[bytes]:
    import trio

    from store.client import NativeClient

    async def run() -> list[bytes]:
        async with NativeClient.open(srv.native, credentials=creds) as c:
            h, body = await c.request(p.PULL, {"queue": queue, "offset": 0, "max": 1000})
            return [m.body for m in p.unpack_messages(h["messages"], body)]

    return trio.run(run)


def test_past_the_budget_new_producers_and_sequences_are_refused(tmp_path: Path) -> None:
    srv = Server(tmp_path / "data", "--max-producers", "2").start()
    try:
        a = native(srv, "PRODUCER_INIT", creds=None)["producer"]
        b = native(srv, "PRODUCER_INIT", creds=None)["producer"]
        with pytest.raises(p.RemoteError, match="--max-producers") as ids:
            native(srv, "PRODUCER_INIT", creds=None)
        assert ids.value.status == 429
        send(srv, "t1", [b"1"], a, 0)
        send(srv, "t2", [b"2"], a, 0)  # two sequences: the budget's worth
        with pytest.raises(p.RemoteError, match="producer sequences.*--max-producers") as seqs:
            send(srv, "t3", [b"3"], b, 0)
        assert seqs.value.status == 429
        send(srv, "t1", [b"4"], a, 1)  # a sequence the store remembers goes on
        assert (stored(srv, "t1"), stored(srv, "t2"), stored(srv, "t3")) == \
            ([b"1", b"4"], [b"2"], [])
        metrics = _metrics(srv)  # what the budget holds, and its refusals, in /metrics
        assert 'lightgate_budget_used{budget="idempotent_producer_sequences"} 2.0' in metrics
        assert 'lightgate_budget_limit{budget="idempotent_producer_ids"} 2.0' in metrics
        assert 'lightgate_budget_refusals_total{budget="idempotent_producers"} 2.0' in metrics
    finally:
        srv.stop()


def _metrics(srv: Server) -> str:
    with urllib.request.urlopen(f"http://{srv.addrs['http']}/metrics", timeout=10) as r:
        return r.read().decode()


def test_sequences_and_ids_survive_kill_9(tmp_path: Path) -> None:
    srv = Server(tmp_path / "data").start()
    try:
        pid = native(srv, "PRODUCER_INIT", creds=None)["producer"]
        for i in range(3):
            last = send(srv, "k9", [b"%d" % i], pid, i)["results"]
        srv.kill()
        srv.start()
        again = send(srv, "k9", [b"2"], pid, 2)["results"]
        assert again[0]["msg_id"] == last[0]["msg_id"]
        send(srv, "k9", [b"3"], pid, 3)
        assert stored(srv, "k9") == [b"0", b"1", b"2", b"3"]
    finally:
        srv.stop()


def publish(srv: Server, topics: list[str], producer: str, seq: int, epoch: int = 0
            ) -> list[dict[str, Any]]:
    """A gateway's PUBLISH of one message per topic, stamped as the native gateway
    stamps it: one sequence for all of the producer's publishes, whatever their topics."""
    metas, body = p.pack_messages([Message(t, t.encode(), 1) for t in topics])
    header = {"messages": metas, "producer": producer, "epoch": epoch, "seq": seq}
    return native(srv, "PUBLISH", header, None, body)["results"]


def test_a_gateways_publishes_are_one_sequence_kept_once_across_kill_9(
        tmp_path: Path) -> None:
    """PUBLISH carries the SEND's stamp: a frame sent again (its answer lost) is
    answered with where it was stored and appended nothing, one sequence running
    across first-level topics; the sequence is rebuilt from the log after a kill -9."""
    srv = Server(tmp_path / "data").start()
    try:
        a, b = uid("pa"), uid("pb")
        pid = native(srv, "PRODUCER_INIT", creds=None)["producer"]
        first = publish(srv, [f"{a}/1", f"{b}/1"], pid, 0)
        assert publish(srv, [f"{a}/1", f"{b}/1"], pid, 0) == first  # a duplicate
        second = publish(srv, [f"{b}/2"], pid, 2)
        with pytest.raises(p.RemoteError, match="sequence gap") as gap:
            publish(srv, [f"{a}/9"], pid, 5)
        assert gap.value.status == 409
        srv.kill()
        srv.start()
        again = publish(srv, [f"{b}/1", f"{b}/2", f"{a}/3"], pid, 1)  # two of it stored
        assert again[:2] == first[1:] + second
        # (each topic's partition is its own: read in partition order, sorted here)
        assert sorted(stored(srv, a)) == [f"{a}/1".encode(), f"{a}/3".encode()]
        assert sorted(stored(srv, b)) == [f"{b}/1".encode(), f"{b}/2".encode()]
    finally:
        srv.stop()


def test_lightgate_produce_is_idempotent(shared_server: Server) -> None:
    topic = uid("cli")
    out = subprocess.run([sys.executable, "-m", "lightgate", "produce", topic, "--server",
                          shared_server.native, "--key", "k"], input="a\nb\n", cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    stats = native(shared_server, "STATS", creds=None)
    assert stats["producers"]["ids"] >= 1
    assert stored(shared_server, topic) == [b"a", b"b"]
