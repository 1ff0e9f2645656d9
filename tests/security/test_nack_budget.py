"""NACK against a real `lightgate serve` with --auth, from a reader that may not publish:
one delivery enters the retry queue once however often it is NACKed, a dead letter is
not retried, and the retry and dead-letter queues of a group stay within their budget.
Before, 200 NACKs of one 512 KiB message wrote 100 MiB."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import trio

from store import protocol as p
from store.client import NativeClient
from store.common import StoreFullError
from store.sdk import Producer
from tests.conftest import Server
from tests.security.helpers import ADMIN, add_user, allow, auth_server, native

READER = ("reader", "reader-pw")
BODY = b"x" * (512 * 1024)
BUDGET = 5


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = auth_server(tmp_path_factory.mktemp("nack"), "--max-retry-messages", str(BUDGET))
    add_user(s, *READER)
    allow(s, "reader", "Topic:orders", "SUB")
    allow(s, "reader", "Group:billing", "SUB")
    with Producer(s.native, username=ADMIN[0], password=ADMIN[1]) as producer:
        for i in range(8):
            producer.send("orders", BODY[:-1] + b"%d" % i, key="same-partition")
    yield s
    assert s.stop() == 0, s.logs()[-3000:]


def _queue(srv: Server) -> str:
    """The partition of `orders` that holds the eight messages."""
    for q in range(4):
        header = native(srv, "QUEUE_RANGE", {"queue": f"orders#{q}"}, READER)
        if header["max_offset"] == 8:
            return f"orders#{q}"
    raise AssertionError("no partition holds the messages")


def _log_end(srv: Server) -> int:
    return int(native(srv, "STATS")["commitlog"]["max_offset"])


def _nack_many(srv: Server, header: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """`n` NACKs of the same delivery at once, on one connection."""

    async def run() -> list[dict[str, Any]]:
        answers: list[dict[str, Any]] = []
        async with NativeClient.open(srv.native, credentials=READER) as client:

            async def one() -> None:
                reply, _ = await client.request(p.NACK, header)
                answers.append(reply)

            async with trio.open_nursery() as nursery:
                for _ in range(n):
                    nursery.start_soon(one)
        return answers

    return trio.run(run)


def _refusal(srv: Server, header: dict[str, Any]) -> Exception | None:
    async def run() -> Exception | None:
        async with NativeClient.open(srv.native, credentials=READER) as client:
            try:  # returned, not raised: the client's nursery would wrap it in a group
                await client.request(p.NACK, header)
            except Exception as exc:  # noqa: BLE001 - what the test looks at
                return exc
        return None

    return trio.run(run)


def test_a_delivery_enters_the_retry_queue_once(srv: Server) -> None:
    queue = _queue(srv)
    with pytest.raises(p.RemoteError) as err:  # the reader may not write
        native(srv, "SEND", {"topic": "orders", "messages": []}, READER)
    assert err.value.status == 403
    before = _log_end(srv)
    answers = _nack_many(srv, {"group": "billing", "queue": queue, "offset": 0}, 200)
    grown = _log_end(srv) - before
    assert len(answers) == 200
    assert len({a["msg_id"] for a in answers}) == 1
    assert sorted(a["repeated"] for a in answers) == [False] + [True] * 199
    assert grown < 2 * len(BODY), f"the log grew {grown} bytes for one copy"
    retry = native(srv, "QUEUE_RANGE", {"queue": "billing#retry"}, READER)
    assert retry["max_offset"] - retry["min_offset"] == 1


def test_a_dead_letter_is_not_retried_and_the_budget_holds(srv: Server) -> None:
    queue = _queue(srv)
    dead = native(srv, "NACK", {"group": "billing", "queue": queue, "offset": 1,
                                "max_attempts": 1}, READER)
    assert dead["dead"] and dead["queue"] == "billing#dlq"
    with pytest.raises(p.RemoteError) as err:
        native(srv, "NACK", {"group": "billing", "queue": "billing#dlq", "offset": 0},
               READER)
    assert err.value.status == 400 and "dead letter is not retried" in err.value.message
    # One copy in the retry queue (the test above), one dead letter: three more fit.
    for offset in (2, 3, 4):
        assert not native(srv, "NACK", {"group": "billing", "queue": queue,
                                        "offset": offset}, READER)["repeated"]
    before = _log_end(srv)
    refused = _refusal(srv, {"group": "billing", "queue": queue, "offset": 5})
    assert isinstance(refused, StoreFullError)  # the client's name for a 507
    assert "--max-retry-messages 5" in str(refused)
    assert _log_end(srv) == before
    # What was NACKed before is still answered, without a copy.
    assert native(srv, "NACK", {"group": "billing", "queue": queue, "offset": 2},
                  READER)["repeated"]
