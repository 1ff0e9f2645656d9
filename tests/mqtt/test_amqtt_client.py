"""The amqtt client (asyncio, an independent implementation) against our broker."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from amqtt.client import MQTTClient


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


@pytest.mark.parametrize("qos", [0, 1, 2])
def test_amqtt_round_trip(shared_server, qos: int) -> None:
    topic = f"am-{uuid.uuid4().hex[:8]}/t"
    url = f"mqtt://127.0.0.1:{shared_server.port}/"

    async def scenario() -> list[tuple[str, bytes, int]]:
        sub = MQTTClient(client_id=f"amsub-{qos}-{uuid.uuid4().hex[:6]}")
        pub = MQTTClient(client_id=f"ampub-{qos}-{uuid.uuid4().hex[:6]}")
        await sub.connect(url)
        await pub.connect(url)
        assert await sub.subscribe([(topic, qos)]) == [qos]
        for i in range(10):
            await pub.publish(topic, b"am%d" % i, qos=qos)
        got = []
        for _ in range(10):
            m = await sub.deliver_message(timeout_duration=5)
            got.append((m.topic, bytes(m.data), m.qos))
        await pub.disconnect()
        await sub.disconnect()
        return got

    got = run(scenario())
    assert got == [(topic, b"am%d" % i, qos) for i in range(10)]


def test_amqtt_retained_and_wildcard(shared_server) -> None:
    base = f"amr-{uuid.uuid4().hex[:8]}"
    url = f"mqtt://127.0.0.1:{shared_server.port}/"

    async def scenario():
        pub = MQTTClient(client_id=f"p-{base}")
        await pub.connect(url)
        await pub.publish(f"{base}/lamp", b"on", qos=1, retain=True)
        sub = MQTTClient(client_id=f"s-{base}")
        await sub.connect(url)
        await sub.subscribe([(f"{base}/+", 1)])
        m = await sub.deliver_message(timeout_duration=5)
        await pub.disconnect()
        await sub.disconnect()
        return m.topic, bytes(m.data), m.publish_packet.retain_flag

    assert run(scenario()) == (f"{base}/lamp", b"on", True)
