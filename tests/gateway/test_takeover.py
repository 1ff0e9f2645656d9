"""The release asks gateways send each other over the notify bus (gateway.takeover)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.takeover import RELEASE, asks_among, parse_release, release_ask

ids = st.text(st.characters(blacklist_characters="\x00"), min_size=1, max_size=20)


@given(ids, ids, st.text(max_size=40))
def test_an_ask_reads_back_as_made(holder: str, claim: str, client_id: str) -> None:
    name = release_ask(holder, claim, client_id)
    assert parse_release(name) == (holder, claim, client_id)
    assert asks_among({name, "a/topic", "\x00auth"}) == [name]


@given(st.text(max_size=60))
def test_any_other_name_is_no_ask(name: str) -> None:
    """A topic, another event or a mangled ask: never an ask, never an error."""
    got = parse_release(name)
    assert got is None or name.startswith(RELEASE)


def test_a_mangled_ask_is_none() -> None:
    assert parse_release(RELEASE) is None
    assert parse_release(RELEASE + "gw-1\x00claim") is None
    assert parse_release("release\x00gw\x00c\x00id") is None
