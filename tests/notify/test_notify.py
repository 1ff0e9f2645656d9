"""The notify bus: merging, broadcast, bounded subscribers, threads, and Redis (a real
redis-server from the `redis_server` fixture in tests/conftest.py, skipped with a reason
when redis-server is not installed) including Redis dying and coming back."""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

import orjson
import pytest
import redis
import trio

from lightqueue.topic import validate_topic_name
from notify import CHANNEL, RESYNC, Grown, LocalBus, RedisBus, Subscription, open_bus

NAMES = {"home/bath/temp", "home/+/temp", "home#2"}


async def collect_until(events: Subscription, want: set[str], timeout: float = 5.0
                        ) -> list[set[str]]:
    """Batches received until their union covers `want` (bounded in time)."""
    batches: list[set[str]] = []
    seen: set[str] = set()
    with trio.fail_after(timeout):
        async for names in events:
            batches.append(names)
            seen |= names
            if want <= seen:
                return batches
    raise AssertionError(f"subscription ended before {want - seen} arrived")


async def nothing_more(events: Subscription, wait: float = 0.05) -> bool:
    with trio.move_on_after(wait):
        await events.receive()
        return False
    return True


async def wait_for(predicate: Any, timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.02)


def notify_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("notify-redis")]


# -- in-process bus -----------------------------------------------------------------------

async def test_publishes_within_one_window_merge_into_one_batch() -> None:
    async with LocalBus() as bus, bus.subscribe() as events:
        for _ in range(100):
            bus.publish(NAMES)
        assert await collect_until(events, NAMES) == [NAMES]
        assert await nothing_more(events)
        assert bus.published == 300 and bus.merged == 297 and bus.delivered == 3


async def test_interleaved_publishes_still_give_few_batches() -> None:
    async with LocalBus(window=0.02) as bus, bus.subscribe() as events:
        for i in range(100):
            bus.publish(NAMES)
            if i % 10 == 0:
                await trio.sleep(0)  # let the pump run in between
        batches = await collect_until(events, NAMES)
        assert len(batches) <= 3
        assert set().union(*batches) == NAMES


async def test_windows_apart_are_separate_batches() -> None:
    async with LocalBus(window=0.002) as bus, bus.subscribe() as events:
        bus.publish(["a"])
        assert await collect_until(events, {"a"}) == [{"a"}]
        bus.publish(["b"])
        assert await collect_until(events, {"b"}) == [{"b"}]


async def test_every_subscriber_gets_every_batch() -> None:
    async with LocalBus() as bus, bus.subscribe() as one, bus.subscribe() as two:
        bus.publish(NAMES)
        assert await collect_until(one, NAMES) == [NAMES]
        assert await collect_until(two, NAMES) == [NAMES]
        assert bus.delivered == 6
        assert await nothing_more(one) and await nothing_more(two)


async def test_slow_subscriber_merges_instead_of_growing_or_dropping() -> None:
    async with LocalBus(buffer=2) as bus, bus.subscribe() as slow, bus.subscribe() as fast:
        for i in range(10):
            bus.deliver({f"q{i}", "always"})
            assert (await fast.receive()) == {f"q{i}", "always"}  # not held up by `slow`
        assert slow.pending() == 2  # bounded: the rest merged into the last batch
        first, rest = await slow.receive(), await slow.receive()
        assert first == {"q0", "always"}
        assert rest == {f"q{i}" for i in range(1, 10)} | {"always"}  # nothing dropped
        assert bus.merged == 8  # 'always' nine times into one set: eight vanished
        assert await nothing_more(slow)


async def test_publish_from_a_plain_thread() -> None:
    want = {f"t/{i}" for i in range(1000)}
    async with LocalBus() as bus, bus.subscribe() as events:
        def writer(publish: Any) -> None:
            for i in range(0, 1000, 100):
                publish(f"t/{j}" for j in range(i, i + 100))

        # `publish` from a foreign thread falls back to the thread-safe path
        threads = [threading.Thread(target=writer, args=(p,))
                   for p in (bus.publish_from_thread, bus.publish_from_thread, bus.publish)]
        for t in threads:
            t.start()
        batches = await collect_until(events, want)
        for t in threads:
            t.join()
        assert set().union(*batches) == want
        assert bus.published == 3000


async def test_window_zero_delivers_at_once_to_listeners_and_subscriptions() -> None:
    """What `lightgate serve` uses: the store appends inline in the trio thread, and the
    sessions it wakes hear of it synchronously, with no pump or timer in between."""
    heard: list[set[str]] = []
    async with LocalBus(window=0) as bus, bus.subscribe() as events:
        with bus.listen(heard.append):
            bus.publish_from_thread({"a/b"})  # called in the trio thread: no hop
            assert heard == [{"a/b"}]
            bus.publish(["c/d", "c/d"])
            assert heard == [{"a/b"}, {"c/d"}]
            assert events.pending() == 2
            # From another thread it still arrives, through the loop.
            t = threading.Thread(target=bus.publish_from_thread, args=({"x/y"},))
            t.start()
            t.join()
            with trio.fail_after(5):
                while len(heard) < 3:
                    await trio.sleep(0.001)
            assert heard[2] == {"x/y"}
        bus.publish({"after"})  # the listener is gone
        assert len(heard) == 3
        # Listeners count on delivery; a subscription when its batches are received.
        assert bus.published == 4 and bus.delivered == 3


async def test_names_no_listener_wants_do_not_wake_the_loop() -> None:
    """A batch that only the native plane's subscribers read: the writer thread asks each
    listener whether it wants the names, and those nobody wants never cross threads."""
    heard: list[set[str]] = []
    wanted = {"py/reader"}
    woken = 0
    async with LocalBus(window=0) as bus:
        real_wake = bus._wake_pump

        def counting_wake() -> None:
            nonlocal woken
            woken += 1
            real_wake()

        bus._wake_pump = counting_wake  # type: ignore[method-assign]

        def from_thread(names: set[str]) -> None:
            t = threading.Thread(target=bus.publish_from_thread, args=(names,))
            t.start()
            t.join()

        with bus.listen(heard.append, wanted.__contains__):
            from_thread({"native/only"})
            await trio.sleep(0.05)
            assert heard == [] and woken == 0
            from_thread({"native/only", "py/reader"})
            with trio.fail_after(5):
                while not heard:
                    await trio.sleep(0.001)
            assert heard == [{"py/reader"}] and woken == 1
            bus.publish({"native/only"})  # in the loop's own thread: no hop to save
            assert heard[-1] == {"native/only"}
            # A subscription (or a listener that does not say) hears of everything.
            async with bus.subscribe() as events:
                from_thread({"native/only"})
                with trio.fail_after(5):
                    while not events.pending():
                        await trio.sleep(0.001)
                assert woken == 2


async def test_a_failing_listener_does_not_stop_delivery(caplog) -> None:
    async with LocalBus(window=0) as bus, bus.subscribe() as events:
        def bad(names: set[str]) -> None:
            raise RuntimeError("listener bug")

        with caplog.at_level(logging.ERROR), bus.listen(bad):
            bus.publish({"q"})
        assert events.pending() == 1
        assert "notify listener failed" in caplog.text


async def test_closing_the_bus_flushes_and_ends_subscriptions() -> None:
    got: list[set[str]] = []
    # The bus closes first (a window that never elapses here), then the nursery waits
    # for the reader, whose loop must end by itself.
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery, LocalBus(window=10) as bus:
            async def reader(task_status: trio.TaskStatus[None]) -> None:
                async with bus.subscribe() as events:
                    task_status.started()
                    async for names in events:
                        got.append(names)

            await nursery.start(reader)
            bus.publish(["last"])
    assert got == [{"last"}]


async def test_subscribe_needs_a_running_bus() -> None:
    bus = LocalBus()
    with pytest.raises(RuntimeError):
        async with bus.subscribe():
            pass


async def test_open_bus_picks_the_transport() -> None:
    for url in (None, "", "local"):
        async with open_bus(url) as bus:
            assert isinstance(bus, LocalBus) and bus.healthy
    with pytest.raises(ValueError, match="unknown notify transport"):
        async with open_bus("amqp://somewhere"):
            pass


# -- Redis ----------------------------------------------------------------------------------

async def test_open_bus_with_a_redis_url(redis_server) -> None:
    async with open_bus(redis_server.url) as bus:
        assert isinstance(bus, RedisBus) and bus.healthy


async def test_one_node_reaches_another_through_redis(redis_server) -> None:
    async with (
        RedisBus(redis_server.url) as a,
        RedisBus(redis_server.url) as b,
        a.subscribe() as on_a,
        b.subscribe() as on_b,
    ):
        assert a.healthy and b.healthy
        a.publish(NAMES)
        assert set().union(*await collect_until(on_b, NAMES)) == NAMES
        # a node hears its own events through Redis too
        assert set().union(*await collect_until(on_a, NAMES)) == NAMES
        await wait_for(lambda: a.sent == 3)  # counted by a's thread just after sending
        assert b.received == 3 and b.delivered == 3


async def test_a_bus_that_only_publishes_reads_nothing(redis_server) -> None:
    """A store node tells gateways what grew and hears nothing back: no subscriber thread,
    no subscription at Redis, its publishes still reach the others."""
    async with RedisBus(redis_server.url, receive=False) as store, \
            RedisBus(redis_server.url) as gateway, gateway.subscribe() as events:
        assert [t.name for t in notify_threads() if t in store._threads] == \
            ["notify-redis-publisher"]
        raw = redis.Redis.from_url(redis_server.url)
        assert raw.pubsub_numsub(store.channel) == [(store.channel.encode(), 1)]
        raw.close()
        assert store.healthy
        store.publish(NAMES)
        assert set().union(*await collect_until(events, NAMES)) == NAMES
        with pytest.raises(RuntimeError, match="only publishes"):
            async with store.subscribe():
                pass


async def test_redis_merges_a_burst(redis_server) -> None:
    async with RedisBus(redis_server.url) as a, RedisBus(redis_server.url) as b, \
            b.subscribe() as events:
        for _ in range(100):
            a.publish(NAMES)
        batches = await collect_until(events, NAMES)
        assert len(batches) <= 2 and set().union(*batches) == NAMES
        await wait_for(lambda: a.sent >= 3)
        assert a.merged >= 290 and a.sent <= 6


async def test_redis_publish_from_a_plain_thread(redis_server) -> None:
    want = {f"dev/{i}/up" for i in range(500)}
    async with RedisBus(redis_server.url) as a, RedisBus(redis_server.url) as b, \
            b.subscribe() as events:
        t = threading.Thread(target=lambda: [a.publish_from_thread([n]) for n in want])
        t.start()
        batches = await collect_until(events, want)
        t.join()
        assert set().union(*batches) == want


async def test_malformed_messages_are_counted_and_ignored(redis_server) -> None:
    async with RedisBus(redis_server.url) as bus, bus.subscribe() as events:
        raw = redis.Redis.from_url(redis_server.url)
        for junk in (b"not json", b'{"a": 1}', b"[1, 2]"):
            raw.publish(bus.channel, junk)
        raw.close()
        bus.publish(["ok"])
        assert await collect_until(events, {"ok"}) == [{"ok"}]
        assert bus.errors == 3 and bus.healthy


async def test_redis_death_and_return(redis_server, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="lightgate.notify.redis")
    async with (
        RedisBus(redis_server.url) as a,
        RedisBus(redis_server.url) as b,
        b.subscribe() as events,
    ):
        a.publish(["before"])
        await collect_until(events, {"before"})

        redis_server.stop()  # kill -9
        await wait_for(lambda: not a.healthy and not b.healthy)
        a.publish(["during"])  # must not raise; kept pending
        await trio.sleep(0.5)  # a few retries with backoff
        assert a.errors >= 1 and b.errors >= 1

        await trio.to_thread.run_sync(redis_server.start)  # same port
        await wait_for(lambda: a.healthy and b.healthy, timeout=15)
        # b may have missed events while down: it is told to look everywhere
        await collect_until(events, {RESYNC})
        assert b.resyncs == 1

        a.publish(["after"])
        await collect_until(events, {"after"})

    assert not notify_threads(), "the bus joins its threads on exit"
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("unreachable" in m for m in warnings) == 2, warnings  # once per bus
    assert sum("reachable again" in m for m in warnings) == 2, warnings


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_redis_down_at_start_then_up(redis_server) -> None:
    redis_server.stop()
    with trio.fail_after(10):
        async with RedisBus(redis_server.url) as bus, bus.subscribe() as events:
            assert not bus.healthy
            bus.publish(["early"])  # kept until Redis is there
            await trio.to_thread.run_sync(redis_server.start)
            await wait_for(lambda: bus.healthy)
            # "early" is sent on reconnect, maybe before this node resubscribed: RESYNC
            # is what covers it
            await collect_until(events, {RESYNC})
            bus.publish(["later"])
            await collect_until(events, {"later"})
            assert bus.sent >= 1  # "early" went out once Redis was up


async def test_no_redis_at_all_never_crashes() -> None:
    url = f"redis://127.0.0.1:{_free_port()}"
    with trio.fail_after(10):
        async with RedisBus(url, connect_timeout=0.5) as bus, bus.subscribe() as events:
            assert not bus.healthy
            bus.publish(["x"])
            bus.publish_from_thread(["y"])
            await trio.sleep(0.3)
            assert not bus.healthy and bus.errors >= 2
            assert events.pending() == 0
    assert not notify_threads()


async def test_errors_in_the_body_are_not_wrapped() -> None:
    with pytest.raises(KeyError):
        async with LocalBus():
            raise KeyError("mine")


async def test_unencodable_names_turn_into_resync(redis_server) -> None:
    async with RedisBus(redis_server.url) as bus, bus.subscribe() as events:
        bus.publish(["fine", "bad\udc80"])
        batches = await collect_until(events, {"fine", RESYNC})
        assert all("bad\udc80" not in b for b in batches) and bus.healthy


# -- queue ends in the payload ------------------------------------------------------------

ENDS = {"home/bath/temp": 7, "home/+/temp": 12}


def old_decode(data: bytes) -> set[str] | None:
    """What a node that knows nothing of ends made of a message: its names, or None
    (malformed)."""
    names = orjson.loads(data)
    if isinstance(names, list) and all(isinstance(n, str) for n in names):
        return set(names)
    return None


async def test_the_store_says_each_grown_queues_end_and_a_gateway_reads_it(
        redis_server) -> None:
    """A store's mapping of queue to end reaches a gateway as a batch of the names with
    those ends; a name published again without one has none (it may be past it), and
    of two ends the larger counts."""
    async with RedisBus(redis_server.url, receive=False) as store, \
            RedisBus(redis_server.url) as gateway, gateway.subscribe() as events:
        store.publish(ENDS)
        [batch] = await collect_until(events, set(ENDS))
        assert batch == set(ENDS) and batch.ends == ENDS
        store.publish({"home#2"})  # no end said: none read
        assert (await events.receive()).ends == {}
    merged = Grown(ENDS, dict(ENDS))
    merged.merge({"home/bath/temp": 9, "home/+/temp": 3})
    merged.merge({"home#2"})
    assert merged.ends == {"home/bath/temp": 9, "home/+/temp": 12}
    merged.merge(["home/bath/temp"])
    assert merged.ends == {"home/+/temp": 12} and merged == NAMES


async def test_a_node_that_knows_no_ends_reads_the_new_payload(redis_server) -> None:
    """Every name comes through to a reader of plain name lists; the ends ride in one
    more element, which names no queue an MQTT client can read (U+0000 is in no topic)."""
    raw = redis.Redis.from_url(redis_server.url)
    sub = raw.pubsub(ignore_subscribe_messages=True)
    sub.subscribe(CHANNEL)
    async with RedisBus(redis_server.url, receive=False) as store:
        store.publish(ENDS)
        msg = None
        with trio.fail_after(5):
            while msg is None:
                msg = await trio.to_thread.run_sync(lambda: sub.get_message(timeout=0.1))
    names = old_decode(msg["data"])
    assert names is not None and set(ENDS) < names
    [extra] = names - set(ENDS)
    assert "\x00" in extra
    with pytest.raises(ValueError):
        validate_topic_name(extra)
    sub.close()
    raw.close()


async def test_a_node_that_says_no_ends_is_read_as_before(redis_server) -> None:
    """A plain list of names (a store that says no ends) is a batch without ends: every
    reader of those queues pulls, as before."""
    async with RedisBus(redis_server.url) as gateway, gateway.subscribe() as events:
        raw = redis.Redis.from_url(redis_server.url)
        raw.publish(gateway.channel, orjson.dumps(sorted(NAMES)))
        raw.publish(gateway.channel, orjson.dumps(["x", "\x00ends:1,2"]))  # ends unfit
        raw.close()
        batches = await collect_until(events, NAMES | {"x"})
        assert set().union(*batches) == NAMES | {"x"}
        assert all(not b.ends for b in batches) and gateway.errors == 0


async def test_a_batch_taken_early_never_reaches_trio(redis_server) -> None:
    """`early` sees each batch in the subscriber thread, with its ends; one it takes
    (a gateway whose engine alone reads those queues) is not handed to the event loop,
    and a RESYNC always is."""
    seen: list[tuple[set[str], dict[str, int], bool]] = []

    def early(names: Grown) -> bool:
        seen.append((set(names), dict(names.ends), threading.current_thread().name))
        return "home#2" in names

    async with RedisBus(redis_server.url, receive=False) as store, \
            RedisBus(redis_server.url) as gateway, gateway.subscribe() as events:
        gateway.early = early
        store.publish(ENDS)
        await wait_for(lambda: gateway.taken_early == 1)
        assert seen == [(set(ENDS), ENDS, "notify-redis-subscriber")]
        store.publish({"home#2"})
        assert await collect_until(events, {"home#2"}) == [{"home#2"}]
        await trio.to_thread.run_sync(gateway._hand_over, {RESYNC})
        assert await collect_until(events, {RESYNC}) == [{RESYNC}]
        assert gateway.counters()["taken_early"] == 1


async def test_under_load_sends_to_redis_are_an_interval_apart(redis_server) -> None:
    """A name a millisecond for 0.4 s: every name arrives, in few messages (at most one
    per `interval`, 10 ms: a send per `window`, 2 ms, made ~175 of them); a name after
    a quiet spell goes after `window` alone."""
    async with RedisBus(redis_server.url, receive=False) as store, \
            RedisBus(redis_server.url) as gateway, gateway.subscribe() as events:
        want = {f"dev/{i}/up" for i in range(400)}

        def load() -> None:
            for name in sorted(want):
                store.publish_from_thread([name])
                time.sleep(0.001)

        t = threading.Thread(target=load)
        began = time.monotonic()
        t.start()
        batches = await collect_until(events, want, timeout=10)
        t.join()
        took = time.monotonic() - began  # longer on a loaded machine: more sends
        assert set().union(*batches) == want and gateway.received == 400
        assert len(batches) <= took / store.interval * 1.2 + 5, (len(batches), took)
        await trio.sleep(0.1)  # quiet
        start = trio.current_time()
        store.publish({"late"})
        assert await collect_until(events, {"late"}) == [{"late"}]
        assert trio.current_time() - start < 0.5
