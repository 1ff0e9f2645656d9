"""The per-connection ACL decision cache is bounded: keyed by client-chosen topic names,
it once grew with every topic a client used."""

from __future__ import annotations

from store.auth.manager import AuthManager, DecisionCache, Subject


def test_decision_cache_stays_bounded_and_correct() -> None:
    auth = AuthManager(None, enabled=True)
    subject = Subject("dev-1", "127.0.0.1", "mqtt")  # no such user: every decision is deny
    cache = DecisionCache()
    for i in range(20_000):
        assert auth.authorize(subject, "Topic", f"t/{i}", "PUB", cache=cache) is False
    assert len(cache.entries) <= DecisionCache.MAX_ENTRIES
    denials = auth.denials
    assert auth.authorize(subject, "Topic", "t/19999", "PUB", cache=cache) is False
    assert auth.denials == denials  # the newest decisions are still cached
