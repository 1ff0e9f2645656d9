"""Clients that send requests and read the answers only a little, or PINGREQs and none,
against a real `lightgate serve` (the floods of test_unread_answers.py): what waits for
such a connection stays bounded, and one that takes less than --min-drain-bytes per
--write-timeout is disconnected as one that reads nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import Server
from tests.faults.hostile import MiB, metric, metrics
from tests.faults.test_unread_answers import BOUND, PINGREQ, SUBSCRIBE, _attack, _server


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["tcp", "ws"])
def test_a_subscribe_flood_that_reads_a_little_stays_bounded(tmp_path: Path,
                                                             transport: str) -> None:
    srv = _server(tmp_path, transport)
    try:
        # 256 KiB a second: enough to pass the drain rule, far less than it is sent.
        grown, seen = _attack(srv, SUBSCRIBE, read_every=2.0, read_bytes=512 * 1024,
                              transport=transport)
        assert seen["read"] > 0
        assert grown < BOUND
    finally:
        srv.stop()


@pytest.mark.timeout(120)
def test_a_pingreq_flood_that_reads_nothing_is_not_read(tmp_path: Path) -> None:
    srv = Server(tmp_path).start()
    try:
        grown, _ = _attack(srv, PINGREQ)
        assert grown < BOUND
    finally:
        srv.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["tcp", "tls"])
def test_a_client_that_drains_too_slowly_is_disconnected(tmp_path: Path,
                                                         transport: str) -> None:
    """It takes 512 KiB every 2 s, progress enough to pass a rule of "took something
    within --write-timeout", but less than --min-drain-bytes (4 MiB: all that waits, as
    less does) per --write-timeout (3 s): it is disconnected as one that reads nothing."""
    srv = _server(tmp_path, transport, "--write-timeout", "3", "--min-drain-bytes",
                  str(4 * MiB))
    try:
        _, seen = _attack(srv, SUBSCRIBE, read_every=2.0, read_bytes=512 * 1024,
                          transport=transport)
        assert seen["closed_after"] is not None and seen["closed_after"] < 10, seen
        assert srv.wait_log("took less than 4194304 bytes of what waits for it in 3s")
        text = metrics(srv)  # and what waited for it is given back
        assert metric(text, "lightgate_budget_refusals_total", "slow_drain_closed") == 1
        assert metric(text, "lightgate_budget_used", "unsent_bytes") == 0
    finally:
        srv.stop()
