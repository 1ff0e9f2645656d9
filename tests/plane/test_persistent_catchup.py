"""A persistent session's backlog on the native plane: it is promoted behind its queues'
ends and served from the store there, each QoS 1 send's in-flight record kept (one record
a batch) before the PUBLISH goes out, so that a kill -9 loses nothing acknowledged, resends
what was in flight with DUP under its packet id, and brings nothing acknowledged back as a
new message; and one handed back to Python in the middle of it goes on with no gap and no
duplicate. Each on both planes."""

from __future__ import annotations

import time

import pytest

from gateway import mqtt
from tests.conftest import Server
from tests.faults.hostile import metric, metrics
from tests.mqtt.raw import RawClient


def _publish(port: int, topic: str, first: int, n: int, qos: int = 1,
             odd: tuple[int, int] | None = None) -> None:
    """`n` messages b"%07d" from `first` on one connection, in order, every one
    acknowledged (a window of 500); `odd`: (number, QoS) of one at another QoS."""
    c = RawClient(port, timeout=30)
    c.connect(f"pub-{time.monotonic_ns()}")
    i = first
    while i < first + n:
        m = min(500, first + n - i)
        qoses = [odd[1] if odd and odd[0] == i + k else qos for k in range(m)]
        c.send_raw(b"".join(mqtt.encode(mqtt.Publish(topic, b"%07d" % (i + k), qos=q,
                                                     packet_id=k + 1 if q else None), 4)
                            for k, q in enumerate(qoses)))
        acks = 0
        while acks < sum(1 for q in qoses if q):
            p = c.recv()
            if isinstance(p, mqtt.Pubrec):
                c.send(mqtt.Pubrel(p.packet_id))
            elif isinstance(p, (mqtt.Puback, mqtt.Pubcomp)):
                acks += 1
        i += m
    c.close()


def _subscriber(srv: Server, client_id: str, topic: str, qos: int = 1) -> None:
    """A persistent session subscribed to `topic`, offline (the server saw it go)."""
    c = RawClient(srv.port)
    c.connect(client_id, clean=False)
    c.subscribe(topic, qos)
    _leave(srv, c, client_id)


def _leave(srv: Server, c: RawClient, client_id: str) -> None:
    """DISCONNECT, and wait until the server took it (nothing is sent to it after)."""
    gone = sum(1 for line in srv.log if f"client {client_id!r} (" in line
               and "disconnected" in line)
    c.send(mqtt.Disconnect())
    c.close()
    deadline = time.monotonic() + 10
    while sum(1 for line in srv.log if f"client {client_id!r} (" in line
              and "disconnected" in line) <= gone:
        assert time.monotonic() < deadline, srv.logs()[-3000:]
        time.sleep(0.02)


def _read(c: RawClient, count: int | None, idle_s: float, ack_upto: int | None = None
          ) -> list[mqtt.Publish]:
    """PUBLISHes until `count` came or `idle_s` of quiet; each acknowledged (the first
    `ack_upto` only, if given), a QoS 2 one's exchange completed."""
    got: list[mqtt.Publish] = []
    c.sock.settimeout(idle_s)
    try:
        while count is None or len(got) < count:
            p = c.recv()
            if isinstance(p, mqtt.Publish):
                got.append(p)
                if ack_upto is not None and len(got) > ack_upto:
                    continue
                if p.qos == 1:
                    c.send(mqtt.Puback(p.packet_id))
                elif p.qos == 2:
                    c.send(mqtt.Pubrec(p.packet_id))
            elif isinstance(p, mqtt.Pubrel):
                c.send(mqtt.Pubcomp(p.packet_id))
    except TimeoutError:
        pass
    return got


def _promoted(srv: Server, client_id: str) -> bool:
    return any(f"client {client_id!r} (" in line and "promoted to the native plane" in line
               for line in srv.log)


def _sent(srv: Server) -> tuple[float, float]:
    """(PUBLISHes Python's delivery sent at QoS 1, the native plane's) so far."""
    text = metrics(srv)
    native = metric(text, "lightgate_native_messages_out_qos1_total") \
        if "lightgate_native_messages_out_qos1" in text else 0.0
    return metric(text, "lightgate_messages_sent_total", "1") - native, native


@pytest.mark.parametrize("plane", ["native", "python"])
@pytest.mark.parametrize("resubscribes", [False, True])
def test_a_persistent_session_catches_up_on_the_native_plane(tmp_path, monkeypatch,
                                                            plane: str,
                                                            resubscribes: bool) -> None:
    """10,000 messages stored for an offline persistent session come, in order, once
    each, when it reconnects (and subscribes again at once, as many clients do); on the
    native plane all of them from there (Python's delivery sends none). Where it
    resumes is kept: reconnected, it gets only what came since."""
    monkeypatch.setenv("LIGHTGATE_NATIVE", "1" if plane == "native" else "0")
    n = 10_000
    srv = Server(tmp_path / "d", "--max-offline-messages", "1000000").start()
    try:
        _subscriber(srv, "keeper", "pc/t")
        _publish(srv.port, "pc/t", 0, n)
        before = _sent(srv)
        c = RawClient(srv.port, timeout=30)
        assert c.connect("keeper", clean=False).session_present
        if resubscribes:
            c.send(mqtt.Subscribe(7, [("pc/t", mqtt.SubscriptionOptions(1))]))
        got = _read(c, n, 20)
        assert [p.payload for p in got] == [b"%07d" % i for i in range(n)]
        assert not any(p.dup for p in got)
        assert _read(c, None, 0.5) == []  # nothing more
        after = _sent(srv)
        if plane == "native":
            assert _promoted(srv, "keeper"), srv.logs()[-3000:]
            assert after[1] - before[1] >= n
            assert after[0] - before[0] == 0
        _leave(srv, c, "keeper")
        _publish(srv.port, "pc/t", n, 5)
        c = RawClient(srv.port, timeout=30)
        assert c.connect("keeper", clean=False).session_present
        got = _read(c, None, 1.5)
        assert [p.payload for p in got] == [b"%07d" % i for i in range(n, n + 5)]
        c.close()
    finally:
        assert srv.stop() == 0, srv.logs()[-3000:]


@pytest.mark.parametrize("plane", ["native", "python", "native-then-python"])
def test_kill_9_in_a_native_catch_up_keeps_every_promise(tmp_path, monkeypatch,
                                                         plane: str) -> None:
    """kill -9 while a persistent session catches up, with some of what it was sent
    unacknowledged: after the restart nothing is missing, every message sent and not
    acknowledged comes again with DUP under its packet id, and whatever was received
    before comes again only with DUP. (native-then-python: the native plane's batch
    records, read by a restart on the Python plane.)"""
    monkeypatch.setenv("LIGHTGATE_NATIVE", "0" if plane == "python" else "1")
    n, acked_n = 8_000, 2_500
    srv = Server(tmp_path / "d", "--flush", "sync", "--max-offline-messages",
                 "1000000").start()
    _subscriber(srv, "crashy", "pk/t")
    _publish(srv.port, "pk/t", 0, n)
    c = RawClient(srv.port, timeout=30)
    assert c.connect("crashy", clean=False).session_present
    first = _read(c, None, 1.5, ack_upto=acked_n)  # the window's worth past it, unacked
    assert len(first) > acked_n
    if plane != "python":
        assert _promoted(srv, "crashy"), srv.logs()[-3000:]
    time.sleep(0.3)  # (the acks read or not: either is allowed for)
    srv.kill()
    c.close()
    if plane == "native-then-python":
        monkeypatch.setenv("LIGHTGATE_NATIVE", "0")
    srv.start()
    try:
        assert srv.wait_log("commitlog recovered after a crash")
        c = RawClient(srv.port, timeout=30)
        assert c.connect("crashy", clean=False).session_present
        second = _read(c, None, 1.5)
        c.close()
        seen = {p.payload for p in first}
        assert {p.payload for p in first} | {p.payload for p in second} \
            == {b"%07d" % i for i in range(n)}  # none lost
        again = [p for p in second if p.payload in seen]
        assert all(p.dup for p in again), [p.payload for p in again if not p.dup][:5]
        resent = {p.payload: p.packet_id for p in second if p.dup}
        unacked = first[acked_n:]
        for p in unacked:  # sent, not acknowledged: again, with DUP, under its id
            assert resent.get(p.payload) == p.packet_id, (p.payload, p.packet_id)
        news = [int(p.payload) for p in second if not p.dup]
        assert news == sorted(news)
        print(f"{plane}: {len(first)} before the kill ({acked_n} acked), {len(second)} "
              f"after ({len(again)} again with DUP)")
    finally:
        assert srv.stop() == 0, srv.logs()[-3000:]


@pytest.mark.parametrize("plane", ["native", "python"])
@pytest.mark.parametrize("odd", [2, 0])
def test_a_persistent_session_handed_back_mid_catch_up_has_no_gap(tmp_path, monkeypatch,
                                                                  plane: str,
                                                                  odd: int) -> None:
    """A QoS 2 message (for a QoS 2 subscription) or a QoS 0 one in the middle of a
    persistent session's backlog, both Python's to deliver: the session goes back to
    Python there and on, with every message once, the QoS 1 ones in order."""
    monkeypatch.setenv("LIGHTGATE_NATIVE", "1" if plane == "native" else "0")
    srv = Server(tmp_path / "d", "--max-offline-messages", "1000000").start()
    try:
        _subscriber(srv, "mixed", "pm/t", qos=max(odd, 1))
        _publish(srv.port, "pm/t", 0, 6001, odd=(3000, odd))
        c = RawClient(srv.port, timeout=30)
        assert c.connect("mixed", clean=False).session_present
        got = _read(c, 6001, 20)
        # (Each once; in order at QoS 1, where a QoS 0 message may pass the QoS 1 ones
        # waiting for their records and the window, on either plane.)
        assert sorted(p.payload for p in got) == [b"%07d" % i for i in range(6001)]
        assert [p.payload for p in got if p.qos == 1] \
            == [b"%07d" % i for i in range(6001) if i != 3000]
        assert [p.qos for p in got].count(odd) == 1
        assert not any(p.dup for p in got)
        assert _read(c, None, 0.5) == []
        if plane == "native":
            assert _promoted(srv, "mixed"), srv.logs()[-3000:]
            assert any("'mixed'" in line and "back from the native plane" in line
                       for line in srv.log), srv.logs()[-3000:]
        c.close()
    finally:
        assert srv.stop() == 0, srv.logs()[-3000:]


@pytest.mark.parametrize("plane", ["native", "python"])
def test_a_client_that_leaves_mid_catch_up_gets_its_sends_again_then_the_rest(
        tmp_path, monkeypatch, plane: str) -> None:
    """A persistent session's client leaves in the middle of its catch-up with sends
    unacknowledged: back, it gets each of them again with DUP under its packet id, then
    the rest, each once, with no gap (the native plane hands the sends in flight back
    with their queues and offsets)."""
    monkeypatch.setenv("LIGHTGATE_NATIVE", "1" if plane == "native" else "0")
    n, acked_n = 8_000, 2_000
    srv = Server(tmp_path / "d", "--max-offline-messages", "1000000").start()
    try:
        _subscriber(srv, "leaver", "pl/t")
        _publish(srv.port, "pl/t", 0, n)
        c = RawClient(srv.port, timeout=30)
        assert c.connect("leaver", clean=False).session_present
        first = _read(c, None, 1.0, ack_upto=acked_n)
        unacked = first[acked_n:]
        assert unacked
        if plane == "native":
            assert _promoted(srv, "leaver"), srv.logs()[-3000:]
        gone = sum(1 for line in srv.log if "client 'leaver' (" in line
                   and "disconnected" in line)
        c.sock.close()  # no DISCONNECT
        deadline = time.monotonic() + 10
        while sum(1 for line in srv.log if "client 'leaver' (" in line
                  and "disconnected" in line) <= gone:
            assert time.monotonic() < deadline, srv.logs()[-3000:]
            time.sleep(0.02)
        c = RawClient(srv.port, timeout=30)
        assert c.connect("leaver", clean=False).session_present
        second = _read(c, None, 1.5)
        c.close()
        again = [(p.payload, p.packet_id) for p in second[:len(unacked)]]
        assert again == [(p.payload, p.packet_id) for p in unacked]
        assert all(p.dup for p in second[:len(unacked)])
        rest = [p.payload for p in second[len(unacked):]]
        assert not any(p.dup for p in second[len(unacked):])
        assert rest == [b"%07d" % i for i in range(len(first), n)]
    finally:
        assert srv.stop() == 0, srv.logs()[-3000:]


@pytest.mark.parametrize("plane", ["native", "python"])
def test_a_takeover_mid_catch_up_resends_then_goes_on(tmp_path, monkeypatch,
                                                       plane: str) -> None:
    """The same client id connects again while its first connection is in the middle
    of a catch-up with sends unacknowledged (the engine hands the first back for the
    takeover): the new one gets those sends again with DUP under their packet ids,
    then the rest, each once."""
    monkeypatch.setenv("LIGHTGATE_NATIVE", "1" if plane == "native" else "0")
    n, acked_n = 8_000, 2_000
    srv = Server(tmp_path / "d", "--max-offline-messages", "1000000").start()
    try:
        _subscriber(srv, "twin", "pt/t")
        _publish(srv.port, "pt/t", 0, n)
        first_conn = RawClient(srv.port, timeout=30)
        assert first_conn.connect("twin", clean=False).session_present
        first = _read(first_conn, None, 1.0, ack_upto=acked_n)
        unacked = first[acked_n:]
        if plane == "native":
            assert _promoted(srv, "twin"), srv.logs()[-3000:]
        c = RawClient(srv.port, timeout=30)
        assert c.connect("twin", clean=False).session_present
        second = _read(c, None, 1.5)
        c.close()
        first_conn.close()
        again = [(p.payload, p.packet_id, p.dup) for p in second[:len(unacked)]]
        assert again == [(p.payload, p.packet_id, True) for p in unacked]
        rest = second[len(unacked):]
        assert not any(p.dup for p in rest)
        assert [p.payload for p in rest] == [b"%07d" % i for i in range(len(first), n)]
    finally:
        assert srv.stop() == 0, srv.logs()[-3000:]


@pytest.mark.parametrize("plane", ["native", "python"])
def test_a_persistent_session_over_tls_catches_up_as_one_over_tcp(tmp_path, monkeypatch,
                                                                 plane: str) -> None:
    """On the engine's TLS listener a persistent session is carried as a plain one is:
    5,000 messages stored while it was away come, in order, once each, on the native
    plane all of them from there (Python's delivery sends none); reconnected, it gets
    only what came since."""
    from tests.plane.test_tls_handover import TlsRaw
    from tests.security.test_tls import make_pki, port_of, tls_args

    monkeypatch.setenv("LIGHTGATE_NATIVE", "1" if plane == "native" else "0")
    pki = make_pki(tmp_path / "pki")
    n = 5_000
    srv = Server(tmp_path / "d", "--max-offline-messages", "1000000", *tls_args(pki)).start()
    try:
        port = port_of(srv, "mqtt_tls")
        c = TlsRaw(port, pki.client_context())
        c.connect("tls-keeper", clean=False)
        c.subscribe("ptls/t", 1)
        _leave(srv, c, "tls-keeper")
        _publish(srv.port, "ptls/t", 0, n)
        before = _sent(srv)
        c = TlsRaw(port, pki.client_context(), timeout=30)
        assert c.connect("tls-keeper", clean=False).session_present
        got = _read(c, n, 20)
        assert [p.payload for p in got] == [b"%07d" % i for i in range(n)]
        assert not any(p.dup for p in got)
        after = _sent(srv)
        if plane == "native":
            assert _promoted(srv, "tls-keeper"), srv.logs()[-3000:]
            assert after[1] - before[1] >= n
            assert after[0] - before[0] == 0
        _leave(srv, c, "tls-keeper")
        _publish(srv.port, "ptls/t", n, 5)
        c = TlsRaw(port, pki.client_context(), timeout=30)
        assert c.connect("tls-keeper", clean=False).session_present
        got = _read(c, None, 1.5)
        assert [p.payload for p in got] == [b"%07d" % i for i in range(n, n + 5)]
        c.close()
    finally:
        assert srv.stop() == 0, srv.logs()[-3000:]
