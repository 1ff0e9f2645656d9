"""Runs the amqtt broker on 127.0.0.1:PORT (a peer for bench/mqtt_bench.py)."""

from __future__ import annotations

import asyncio
import logging
import sys

from amqtt.broker import Broker


async def main(port: int) -> None:
    config = {
        "listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{port}"}},
        "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
    }
    broker = Broker(config)
    await broker.start()
    print(f"ready mqtt=127.0.0.1:{port}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(main(int(sys.argv[1])))
