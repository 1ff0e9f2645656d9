"""`lightgate simulate`'s devices: paho clients publishing JSON temperatures over MQTT,
the first --hot of them hot. No Spark needed."""

from __future__ import annotations

import json
from collections import defaultdict

from spark_streaming.native import StoreClient
from spark_streaming.simulate import SimConfig, run
from tests.conftest import Server
from tests.spark.conftest import wait_until


def test_simulated_devices(server: Server) -> None:
    sent = run(SimConfig(mqtt=f"127.0.0.1:{server.port}", devices=3, rate=10, seconds=1.0,
                         hot=1, seed=7), progress=False)
    assert sent >= 3

    def stored() -> dict[str, list[float]]:
        temps: dict[str, list[float]] = defaultdict(list)
        with StoreClient(server.native) as c:
            for q in c.describe("devices"):
                for _, m in c.read_range(q["queue"], int(q["min_offset"]),
                                         int(q["max_offset"])):
                    body = json.loads(m.body)
                    assert set(body) == {"temperature", "ts"}
                    assert m.client_id.startswith("sim-dev-")
                    prefix, dev, leaf = m.topic.split("/")
                    assert (prefix, leaf) == ("devices", "temp")
                    temps[dev].append(body["temperature"])
        return temps

    # The last QoS 1 appends may land a moment after the clients disconnected.
    def all_in() -> dict[str, list[float]] | None:
        temps = stored()
        return temps if sum(map(len, temps.values())) >= sent else None

    temps = wait_until(all_in, 10, f"{sent} simulated readings in the store",
                       lambda: str({d: len(v) for d, v in stored().items()}))
    # QoS 1: everything published was stored, once.
    assert sum(len(v) for v in temps.values()) == sent
    assert set(temps) == {"dev-1", "dev-2", "dev-3"}
    assert min(temps["dev-1"]) > 80 and max(temps["dev-2"] + temps["dev-3"]) < 40
