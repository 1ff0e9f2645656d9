"""The dispatch of native publishes against a real `lightgate serve` with
LIGHTGATE_NATIVE=1: it may take its lazy pause only while nobody in the process waits.
A long-polling PULL (the Spark source's trigger waiting for the next reading) is woken
as its record lands, even right after publishes nobody heard of."""

from __future__ import annotations

import statistics
import threading
import time

import pytest

from serving import plane
from spark_streaming.native import StoreClient
from store.engine_tail import DISPATCH_LAZY_S
from tests.conftest import Server
from tests.mqtt.paho_client import Client
from tests.plane.test_handover import wait_native

pytestmark = pytest.mark.skipif(plane.NATIVE is None or not hasattr(plane.NATIVE, "Engine"),
                                reason="the native data plane is not built")


def _ends(c: StoreClient, topic: str) -> dict[str, int]:
    return {q["queue"]: int(q["max_offset"]) for q in c.describe(topic)}


def test_a_long_polling_pull_wakes_as_its_record_lands(srv: Server) -> None:
    pub = Client(srv.port, "native-pub")
    pub.publish("wanted/t", b"first", qos=1)
    pub.publish("unheard/t", b"first", qos=1)
    wait_native(srv, "native-pub")
    lags = []
    with StoreClient(srv.native) as c:
        for i in range(5):
            ends = _ends(c, "wanted")
            woke: list[float] = []

            def poll(ends: dict[str, int] = ends, woke: list[float] = woke) -> None:
                assert c.wait_for_records(ends, 5_000)
                woke.append(time.monotonic())

            poller = threading.Thread(target=poll, daemon=True)
            poller.start()
            time.sleep(0.1)  # the pull waits in the store
            # Publishes nobody hears: before, the dispatch then paused lazily for the
            # next one too (the pull's own hurry spent on the second of these).
            for _ in range(2):
                pub.publish("unheard/t", b"x", qos=1)
                time.sleep(0.02)
            sent = time.monotonic()
            pub.publish("wanted/t", b"y%d" % i, qos=1)
            poller.join(10)
            assert woke, "the pull did not wake"
            lags.append(woke[0] - sent)
    pub.disconnect()
    print(f"publish -> long-poll woken: {[round(x * 1000, 1) for x in lags]} ms")
    assert statistics.median(lags) < DISPATCH_LAZY_S / 2, lags
