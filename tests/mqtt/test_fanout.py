"""1 publisher -> 500 subscribers of a wildcard: each receives every message, in order.

The subscribers are amqtt clients in one asyncio loop (paho's select() loop cannot go
past ~340 clients in one process: FD_SETSIZE)."""

from __future__ import annotations

import asyncio
import uuid

from amqtt.client import MQTTClient

from tests.mqtt.paho_client import Client


def test_one_publisher_to_500_wildcard_subscribers(shared_server) -> None:
    base = f"fan-{uuid.uuid4().hex[:8]}"
    url = f"mqtt://127.0.0.1:{shared_server.port}/"
    n_subs, n_msgs = 500, 20

    async def scenario() -> list[list[bytes]]:
        subs = [MQTTClient(client_id=f"{base}-s{i}") for i in range(n_subs)]
        await asyncio.gather(*(s.connect(url) for s in subs))
        await asyncio.gather(
            *(s.subscribe([(f"{base}/+/telemetry", i % 3)]) for i, s in enumerate(subs))
        )
        pub = Client(shared_server.port, f"{base}-pub")
        await asyncio.to_thread(
            lambda: [pub.publish(f"{base}/dev{i % 3}/telemetry", b"%03d" % i, 1)
                     for i in range(n_msgs)]
        )

        async def collect(s: MQTTClient) -> list[bytes]:
            return [bytes((await s.deliver_message(timeout_duration=30)).data)
                    for _ in range(n_msgs)]

        got = await asyncio.gather(*(collect(s) for s in subs))
        pub.disconnect()
        await asyncio.gather(*(s.disconnect() for s in subs))
        return got

    got = asyncio.run(asyncio.wait_for(scenario(), 120))
    expected = [b"%03d" % i for i in range(n_msgs)]
    assert len(got) == n_subs
    assert all(g == expected for g in got)
