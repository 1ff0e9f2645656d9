"""The `<since>` forms of a replay: every form, its edges, and clear refusals."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from lightqueue.since import (
    EARLIEST,
    LAST,
    TIME,
    Since,
    SinceError,
    format_ms,
    parse_since,
    parse_time,
    split_replay,
)

NOW = 1_764_057_600_000  # 2025-11-25T08:00:00Z


def ms(*args: int) -> int:
    return int(datetime(*args, tzinfo=UTC).timestamp() * 1000)


def test_named_starts() -> None:
    assert parse_since("earliest", NOW) == Since(EARLIEST)
    assert parse_since(" last ", NOW) == Since(LAST)
    assert str(Since(EARLIEST)) == "earliest"


@pytest.mark.parametrize(("text", "back"), [
    ("-90s", 90_000), ("-15m", 900_000), ("-1h", 3_600_000), ("-7d", 7 * 86_400_000),
    ("-0s", 0),
])
def test_durations_count_back_from_now(text: str, back: int) -> None:
    assert parse_since(text, NOW) == Since(TIME, NOW - back)


@pytest.mark.parametrize(("text", "want"), [
    ("2025-11-25T07:00:00Z", ms(2025, 11, 25, 7)),
    ("2025-11-25t07:00:00z", ms(2025, 11, 25, 7)),
    ("2025-11-25 07:00:00Z", ms(2025, 11, 25, 7)),
    ("2025-11-25T07:00:00.5Z", ms(2025, 11, 25, 7) + 500),
    ("2025-11-25T07:00:00.123456789Z", ms(2025, 11, 25, 7) + 123),
    ("2025-11-25T09:00:00+02:00", ms(2025, 11, 25, 7)),
    ("2025-11-25T02:30:00-04:30", ms(2025, 11, 25, 7)),
    ("1970-01-01T00:00:00Z", 0),
    ("2016-12-31T23:59:60Z", ms(2016, 12, 31, 23, 59, 59) + 999),
])
def test_rfc3339(text: str, want: int) -> None:
    assert parse_since(text, NOW) == Since(TIME, want)


def test_milliseconds_since_the_epoch() -> None:
    assert parse_since("1764057000000", NOW) == Since(TIME, 1_764_057_000_000)
    assert parse_time("0", NOW) == 0


@pytest.mark.parametrize("text", [
    "", "yesterday", "-1y", "-1.5h", "1h", "- 1h", "-h", "2025-11-25", "2025-11-25T07:00Z",
    "2025-11-25T07:00:00", "20251125T070000Z", "2025-13-01T00:00:00Z",
    "2025-02-30T00:00:00Z", "2025-11-25T07:00:00+24:00", "-9999999999999d",
    "١٧٦٤٠٥٧٠٠٠٠٠٠", "9" * 20, "EARLIEST",
    # Out of what a store time or a date can be: refused, not a crash formatting them.
    "999999999999999", "9999-12-31T23:59:59-23:59", "0001-01-01T00:00:00+23:59",
    "1969-12-31T23:59:59.999Z", "0000-01-01T00:00:00Z",
])
def test_refusals_name_the_forms(text: str) -> None:
    with pytest.raises(SinceError) as err:
        parse_since(text, NOW)
    assert isinstance(err.value, ValueError)  # callers answer 400 to a ValueError
    assert (repr(text) if text else "a time is needed") in str(err.value)


def test_a_start_in_the_future_is_refused_an_end_is_not() -> None:
    with pytest.raises(SinceError, match="in the future"):
        parse_since("2025-11-25T08:00:01Z", NOW)
    with pytest.raises(SinceError, match="in the future"):
        parse_since(str(NOW + 1), NOW)
    assert parse_since(str(NOW), NOW) == Since(TIME, NOW)
    assert parse_time("2099-01-01T00:00:00Z", NOW) == ms(2099, 1, 1)


def test_an_end_past_year_9999_is_refused() -> None:
    assert parse_time("9999-12-31T23:59:59.999Z", NOW) == 253_402_300_799_999
    with pytest.raises(SinceError, match="past year 9999"):
        parse_time("9999-12-31T23:59:59-00:01", NOW)


def test_format_ms_round_trips() -> None:
    assert format_ms(ms(2025, 11, 25, 7) + 42) == "2025-11-25T07:00:00.042Z"
    for value in (0, 1, NOW, NOW + 999):
        assert parse_time(format_ms(value), NOW) == value
    assert format_ms(10**18) == f"{10**18} ms since the epoch"  # no date: no error


def test_split_replay() -> None:
    assert split_replay("$replay/-1h/home/+/temp") == ("-1h", "home/+/temp")
    assert split_replay("$replay/2025-11-25T07:00:00Z/#") == ("2025-11-25T07:00:00Z", "#")
    assert split_replay("home/#") is None
    assert split_replay("$replayed/x") is None
    for bad in ("$replay/", "$replay/-1h", "$replay/-1h/", "$replay//a"):
        with pytest.raises(SinceError, match=r"\$replay/<since>/<filter>"):
            split_replay(bad)
