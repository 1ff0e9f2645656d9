"""What a drain of the native engine's appends costs the interpreter: the same few calls
whether it takes ten messages or a thousand, on one topic or each on a topic of its own
(a fleet of devices: a queue, an index run and a name per message), from the engine's
batch to the gateway's notify listener, even where Python reads the messages (they are
made natively). Counted with sys.settrace (the Python calls and lines a drain runs), which does
not depend on the machine's load."""

from __future__ import annotations

import dataclasses
import gc
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import trio

from gateway import mqtt
from gateway.broker import Broker
from lightqueue.index import ConsumeQueueIndex
from notify import LocalBus
from serving import plane
from store.app import store_node
from store.commitlog import CommitLog
from store.config import StoreConfig
from store.record import Message
from tests.plane.test_engine_native import SETTINGS, pair, recv_exact

if plane.NATIVE is None:
    if os.environ.get("LIGHTGATE_NATIVE") == "1":
        pytest.fail("LIGHTGATE_NATIVE=1 but the native extension is not installed")
    pytest.skip("the native extension is not installed", allow_module_level=True)


def _python_events(fn: Callable[[], Any]) -> int:
    """The Python calls and lines that `fn()` runs in this thread (sys.settrace), the
    cyclic collector held off: a collection runs whatever `gc.callbacks` hold (a test
    library registers some), whenever allocations happen to reach its threshold."""
    count = 0

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        count += 1
        return tracer

    collecting = gc.isenabled()
    gc.disable()
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
        if collecting:
            gc.enable()
    return count


class _Publisher:
    """A native connection of `log`'s engine that publishes QoS 1 to t/<n> (distinct) or
    t/0, each acknowledged (in the log) before `drained` counts the drain of them."""

    def __init__(self, log: CommitLog, distinct: bool) -> None:
        listener = socket.create_server(("127.0.0.1", 0))
        self.sock, fd = pair(listener)
        listener.close()
        log.engine.adopt(1, fd, **SETTINGS)
        self.log, self.distinct, self.sent = log, distinct, 0

    def drained(self, n: int) -> int:
        """Publish `n`, then count the Python of one drain of them."""
        with self.log._dispatch_lock:  # the dispatcher takes none of them meanwhile
            for first in range(self.sent, self.sent + n, 50):  # within the connection's window
                ids = range(first, min(first + 50, self.sent + n))
                self.sock.sendall(b"".join(
                    mqtt.encode_publish(f"t/{i if self.distinct else 0}", b"m", 1, False,
                                        False, i % 60_000 + 1, 4) for i in ids))
                recv_exact(self.sock, 4 * len(ids))
            self.sent += n
            return _python_events(self.log._drain_locked)


@pytest.mark.parametrize("distinct", [False, True], ids=["one-topic", "distinct-topics"])
def test_a_drain_costs_python_the_same_however_many_messages_it_takes(
        tmp_path: Path, distinct: bool) -> None:
    """Native publishes that nobody in Python reads: the drain that takes 1,000 of them
    into the index and tells who waits runs as much Python as the one that takes 10. Once
    a Python reader reads their queue, it grows with them: it decodes each (so the count
    does see per-message work where there is some)."""
    log = CommitLog(tmp_path / "log", ConsumeQueueIndex(tmp_path / "index"))
    log.open()
    told: list[tuple[list[Message], dict[str, int]]] = []
    log.on_batch = lambda msgs, grown: bool(told.append((msgs, grown)))
    engine = log.start_engine(1, 1)
    engine.register_wildcard("t/+")
    publisher = _Publisher(log, distinct)
    try:
        few = publisher.drained(10)
        assert [len(grown) for _, grown in told] == [12 if distinct else 3]
        told.clear()
        many = publisher.drained(1000)
        assert [len(grown) for _, grown in told] == [1002 if distinct else 3]
        assert few < 200, f"{few} Python events for a drain of 10"
        assert many <= few + 20, f"{few} Python events for 10 messages, {many} for 1,000"
        entries = log.index.read("t/+", 0, 2000)
        assert [e.offset for e in entries] == list(range(1010))
        assert told[-1][0] == [] and told[-1][1]["t/+"] == 1010
        engine.want_queues(["t/+"], 60.0)  # a reader in Python: its messages come whole
        read = publisher.drained(1000)
        assert read <= few + 20, f"{few} Python events for 10 messages, {read} for 1,000 read"
        got = told[-1][0]
        assert [m.body for m in got] == [b"m"] * 1000
        # Each as the log's reader decodes it, field for field.
        assert [dataclasses.astuple(m) for m in got] == [
            dataclasses.astuple(log.read(m.phys_offset, m.size)) for m in got]
    finally:
        publisher.sock.close()
        log.close()
        log.index.close()


async def test_notify_of_a_fleet_s_queues_costs_python_no_call_per_queue(
        tmp_path: Path) -> None:
    """The whole path `lightgate serve` runs for a drain: the store's batch, its pulls'
    waiters, the in-process bus and the gateway's notify listener, which asks of a name
    only when a session or group reads its queue. A drain of 1,000 devices' publishes,
    each on its own topic, runs as much Python as one of 10; the name a Python session
    reads still reaches it."""
    cfg = StoreConfig(data_dir=str(tmp_path), engine_threads=1)
    async with LocalBus(window=0) as bus, \
            store_node(cfg, "127.0.0.1:0", bus.publish_from_thread) as node, \
            trio.open_nursery() as nursery:
        broker = Broker(node.store, None)
        heard: list[set[str]] = []
        broker.on_queues_changed = heard.append  # type: ignore[method-assign]
        nursery.start_soon(broker.run_notify, bus)
        await trio.sleep(0.05)  # listening
        log = node.store.commitlog
        publisher = _Publisher(log, True)
        try:
            few = await trio.to_thread.run_sync(publisher.drained, 10)
            many = await trio.to_thread.run_sync(publisher.drained, 1000)
            assert few < 400, f"{few} Python events for a drain of 10"
            assert many <= few + 20, f"{few} Python events for 10 devices, {many} for 1,000"
            await trio.sleep(0.05)
            assert heard == []  # nobody in Python reads any of them
            # A session Python carries reads one of the next ten devices' topics: its
            # queue's name reaches it, alone.
            read = f"t/{publisher.sent + 5}"
            broker.registry.by_queue[read] = {_PythonSession()}  # type: ignore[arg-type]
            await trio.to_thread.run_sync(publisher.drained, 10)
            with trio.fail_after(5):
                while not heard:
                    await trio.sleep(0.005)
            assert heard == [{read}]
        finally:
            publisher.sock.close()
            nursery.cancel_scope.cancel()


class _PythonSession:
    connection = None  # offline, or carried by Python: either wants news
