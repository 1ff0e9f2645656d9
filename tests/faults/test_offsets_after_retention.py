"""End to end with paho clients: a queue's offsets keep rising after
retention removed every record of it and the server restarted, so a persistent
subscriber that was past the old offsets gets the new messages. Also when the index (it
is derived data) was lost meanwhile and is rebuilt from the trimmed log."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import Server
from tests.mqtt.paho_client import Client


@pytest.mark.parametrize("index_lost", [False, True], ids=["restart", "index-lost"])
def test_a_persistent_subscriber_gets_new_messages_after_retention_and_restart(
        tmp_path: Path, index_lost: bool) -> None:
    data = tmp_path / "data"
    srv = Server(data, "--segment-size", "65536", "--retention-bytes", "131072",
                 "--retention-check-s", "0.2").start()
    try:
        sub = Client(srv.port, "idle-sub", clean=False)
        sub.subscribe("idle/t", 1)
        pub = Client(srv.port, "idle-pub")
        for i in range(3):
            pub.publish("idle/t", b"old%d" % i, qos=1)
        assert [m.payload for m in sub.expect(3)] == [b"old0", b"old1", b"old2"]  # acked
        sub.disconnect()
        for _ in range(400):  # ~400 kB on another topic: idle/t's segment goes
            pub.publish("filler/t", b"f" * 1000, qos=1)
        assert srv.wait_log("retention: segment 00000000000000000000 removed"), \
            srv.logs()[-3000:]
        pub.disconnect()
        assert srv.stop() == 0
        if index_lost:
            shutil.rmtree(data / "index")
        srv.start()
        pub = Client(srv.port, "idle-pub-2")
        for i in range(2):
            pub.publish("idle/t", b"new%d" % i, qos=1)
        back = Client(srv.port, "idle-sub", clean=False)
        assert back.connack[0]  # session present
        assert [m.payload for m in back.expect(2)] == [b"new0", b"new1"]
        back.expect_none(0.3)
        back.disconnect()
        pub.disconnect()
    finally:
        if srv.proc is not None:
            assert srv.stop() == 0, srv.logs()[-3000:]
