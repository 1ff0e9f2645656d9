"""A gateway killed (SIGKILL) while it hands out a persistent session's replay: after the
restart the replay goes on from its last snapshot, nothing missing, and what comes
twice is at most a snapshot's worth (256) plus what was in flight, as after a clean
stop. Its progress used to be written every --offsets-flush-interval (0.5 s): a crash
repeated thousands."""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path

import pytest

from gateway import mqtt
from tests.conftest import Server
from tests.mqtt.test_replay import publish
from tests.mqtt.test_replay_sessions import persistent, take

TOTAL = 20_000
WINDOW = 20  # the client's Receive Maximum: what may be in flight


@pytest.mark.timeout(180)
def test_a_crash_mid_replay_repeats_at_most_a_snapshot_and_the_window(tmp_path: Path
                                                                      ) -> None:
    srv = Server(tmp_path).start()
    try:
        base = f"crash{uuid.uuid4().hex[:8]}"
        publish(srv.port, [(f"{base}/{i % 7}", b"%d" % i) for i in range(TOTAL)], qos=1)
        cid = f"dev-{base}"
        raw = persistent(srv.port, cid, WINDOW)
        raw.subscribe(f"$replay/earliest/{base}/+", 1)
        first = take(raw, TOTAL // 3)  # acknowledged as they come, at full speed
        srv.kill()  # ... while the replay goes on
        raw.close()
        srv.start()
        raw = persistent(srv.port, cid, WINDOW)
        second: list[mqtt.Publish] = []
        while not second or int(second[-1].payload) != TOTAL - 1:
            second += take(raw, 1)
        raw.close()
        seqs = Counter(int(p.payload) for p in first + second)
        twice = sorted(k for k, c in seqs.items() if c > 1)
        print(f"{len(first)} received before the kill, {len(second)} after it; "
              f"{len(twice)} came twice")
        assert set(seqs) == set(range(TOTAL))
        assert len(twice) <= 256 + WINDOW, len(twice)
    finally:
        srv.stop()
