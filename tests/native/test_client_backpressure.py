"""The native client's send queue is bounded (store.client.SEND_QUEUE): past it, an
append started from the trio thread fails as unavailable at once, a request waits for
room, and requests still waiting when the connection ends fail over. Driven on the
client's own queue, with no writer draining it (a store that stopped reading)."""

from __future__ import annotations

from concurrent.futures import Future

import trio
import trio.testing

from store import protocol as p
from store.client import NativeClient
from store.common import StoreUnavailable


def stalled_client(room: int) -> tuple[NativeClient, trio.MemoryReceiveChannel[bytes]]:
    client = NativeClient("127.0.0.1:1")
    send, recv = trio.open_memory_channel[bytes](room)
    client._send = send
    return client, recv


async def test_a_submission_past_the_queue_fails_at_once() -> None:
    client, _ = stalled_client(2)
    taken = [client.submit(p.PUBLISH, {}) for _ in range(2)]
    refused = client.submit(p.PUBLISH, {})
    assert not any(f.done() for f in taken)  # queued, waiting for an answer
    assert isinstance(refused.exception(), StoreUnavailable)
    assert len(client._waiting) == 2  # the refused one expects no answer


async def test_a_request_waits_for_room_and_fails_over_when_the_connection_ends() -> None:
    client, recv = stalled_client(1)
    client.submit(p.PUBLISH, {})
    sent = trio.Event()

    async def send_one() -> None:
        await client._send_waiting(p.PULL, {}, b"", Future())
        sent.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_one)
        await trio.testing.wait_all_tasks_blocked()
        assert not sent.is_set()  # no room: it waits
        await recv.receive()  # the writer takes one frame
        await sent.wait()
    assert len(client._waiting) == 2

    waiting, failed = len(client._waiting), []

    async def send_late() -> None:
        try:
            await client._send_waiting(p.PULL, {}, b"", Future())
        except StoreUnavailable as exc:  # RETRY_SAFE requests go to the next master
            failed.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_late)
        await trio.testing.wait_all_tasks_blocked()
        recv.close()  # the connection ended
    assert failed and len(client._waiting) == waiting  # the unsent one expects no answer
