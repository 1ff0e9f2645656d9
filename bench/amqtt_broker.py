"""Runs the amqtt broker on 127.0.0.1:PORT (a peer for bench/mqtt_bench.py); with
CERT KEY CA after the port, on TLS with that certificate (a client certificate, when one
comes, is verified against CA: amqtt asks for one but does not require it)."""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

from amqtt.broker import Broker


async def main(port: int, tls: list[str]) -> None:
    listener: dict[str, Any] = {"type": "tcp", "bind": f"127.0.0.1:{port}"}
    if tls:
        listener.update(ssl=True, certfile=tls[0], keyfile=tls[1], cafile=tls[2])
    config = {
        "listeners": {"default": listener},
        "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
    }
    broker = Broker(config)
    await broker.start()
    print(f"ready mqtt=127.0.0.1:{port}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(main(int(sys.argv[1]), sys.argv[2:5]))
