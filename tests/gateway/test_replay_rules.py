"""The replay subscription's rules that need no server: which filters are replays, where
a session keeps them, and the snapshot a persistent session saves."""

from __future__ import annotations

import pytest

from gateway import replay
from gateway.mqtt import SubscriptionOptions
from gateway.replay_state import Replay
from gateway.session import Session, Subscription, parse_shared, subscription_key
from lightqueue.since import TIME, Since


@pytest.mark.parametrize(("topic_filter", "expected"), [
    ("$replay/-1h/plant/#", ("-1h", "plant/#")),
    ("$replay/earliest/a", ("earliest", "a")),
    ("plant/#", None),
    ("$share/g/plant/#", None),
])
def test_which_filters_replay(topic_filter: str, expected: tuple[str, str] | None) -> None:
    assert replay.parse(topic_filter, parse_shared(topic_filter)) == expected


@pytest.mark.parametrize(("topic_filter", "why"), [
    ("$share/g/$replay/-1h/a", "shared subscription cannot replay"),
    ("$replay/-1h/$share/g/a", "plain topic filter"),
    ("$replay/-1h/$replay/-2h/a", "plain topic filter"),
    ("$replay/-1h", "$replay/<since>/<filter>"),
])
def test_what_cannot_replay_says_why(topic_filter: str, why: str) -> None:
    with pytest.raises(ValueError, match=why.replace("$", r"\$")):
        replay.parse(topic_filter, parse_shared(topic_filter))


def test_a_session_keeps_one_subscription_per_filter() -> None:
    s = Session("c", False)
    opts = SubscriptionOptions(1)
    plain = Subscription("plant/#", opts)
    s.add_subscription(plain)
    rep = Subscription("$replay/-1h/plant/#", opts, replay=("-1h", "plant/#"))
    assert subscription_key(rep.topic_filter) == "plant/#" == rep.key == rep.queue
    assert s.subscription("$replay/-1h/plant/#") is None  # not made with that filter
    assert s.subscription("plant/#") is plain
    s.remove_subscription("plant/#")
    s.add_subscription(rep)
    assert s.matching("plant/1/temp") == [rep] and s.reading() == ["plant/#"]
    assert not s.remove_subscription("$replay/-2h/plant/#")
    s.replays["plant/#"] = Replay(Since("earliest"))
    assert s.remove_subscription("$replay/-1h/plant/#") and not s.replays


@pytest.mark.parametrize("since", [Since("earliest"), Since("last"), Since(TIME, 17)])
def test_a_snapshot_comes_back_as_it_was_saved(since: Since) -> None:
    r = Replay(since)
    r.cursor, r.ends, r.w2, r.overlap, r.done = "c1", {"a/1": 4}, 9, {"a/2": 3}, False
    back = Replay.from_meta(r.to_meta())
    assert (back.since, back.cursor, back.ends, back.w2, back.overlap, back.done) == (
        since, "c1", {"a/1": 4}, 9, {"a/2": 3}, False)


def test_restore_resumes_starts_over_or_leaves_a_finished_replay_alone() -> None:
    sub = Subscription("$replay/-1h/a/#", SubscriptionOptions(0), replay=("-1h", "a/#"))
    s = Session("c", True)
    replay.restore(s, sub, {"acked": 3, "next": 3})  # finished: live only
    assert not s.replays
    replay.restore(s, sub, None)  # never got its offsets: from its since again
    assert s.replays["a/#"].cursor is None and s.replays["a/#"].since.kind == TIME
    saved = Replay(Since("earliest"))
    saved.cursor = "c9"
    replay.restore(s, sub, {"acked": 3, "next": 3, "replay": saved.to_meta()})
    assert s.replays["a/#"].cursor == "c9"
