"""Where a replay starts (and ends): the `<since>` forms, parsed without I/O.

    earliest                    the oldest message the store still keeps
    last                        the newest message of each topic
    2026-11-25T08:00:00Z        an RFC 3339 time (fraction and offset allowed; kept as UTC)
    -90s  -15m  -1h  -7d        that long before now
    1764057600000               milliseconds since the epoch

Times are store times: when the store appended the message. A start in the future is
an error (nothing could be there yet). The same module serves the store's history
reader, its HTTP API and the gateway's `$replay/<since>/<filter>` subscriptions, so
every door says the same thing about the same text.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone

EARLIEST = "earliest"
LAST = "last"
TIME = "time"

REPLAY_PREFIX = "$replay/"
_UNITS_MS = {"s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_MAX_BACK_MS = 100 * 366 * 86_400_000  # a century: beyond that a typo, not a wish
# Anchored and without nested repetition: linear in the input, whatever it holds.
_RFC3339 = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})[Tt ]([0-9]{2}):([0-9]{2}):([0-9]{2})"
    r"(?:\.([0-9]{1,9}))?(?:([Zz])|([+-])([0-9]{2}):([0-9]{2}))")
_DURATION = re.compile(r"-([0-9]{1,12})([smhd])")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_TIME_FORMS = ("an RFC 3339 time (2026-11-25T08:00:00Z), a duration back (-90s, -15m, "
               "-1h, -7d) or milliseconds since the epoch")
_FORMS = f"earliest, last, {_TIME_FORMS}"
# The times a store can hold and a date can show: from the epoch (store times are
# unsigned) to the last millisecond of year 9999 (datetime's last year).
_LATEST_MS = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z


class SinceError(ValueError):
    """Text that is none of the forms, or a start in the future."""


@dataclass(frozen=True, slots=True)
class Since:
    """A parsed start: `kind` is EARLIEST, LAST or TIME (then `ms`, since the epoch)."""

    kind: str
    ms: int | None = None

    def __str__(self) -> str:
        return self.kind if self.ms is None else format_ms(self.ms)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def parse_since(text: str, now: int | None = None) -> Since:
    """`text` as a start; `now` (ms) is the clock the duration counts back from and the
    future is judged by (the store's, where it can be)."""
    text = text.strip()
    if text == EARLIEST:
        return Since(EARLIEST)
    if text == LAST:
        return Since(LAST)
    now = now_ms() if now is None else now
    ms = _time(text, _FORMS, now)
    if ms > now:
        raise SinceError(f"since {text!r} is in the future ({format_ms(ms)}, now "
                         f"{format_ms(now)}): nothing is stored there yet")
    return Since(TIME, ms)


def parse_time(text: str, now: int | None = None) -> int:
    """An end (or start) time in ms: the forms above but earliest and last. A time in
    the future is allowed here (an `until` may be)."""
    text = text.strip()
    if text in (EARLIEST, LAST):
        raise SinceError(f"{text!r} is a start, not an end: an end is {_TIME_FORMS}")
    return _time(text, _TIME_FORMS, now)


def _time(text: str, forms: str, now: int | None) -> int:
    """`text` (stripped) as ms since the epoch; `forms`: what to offer when it is none."""
    if not text:
        raise SinceError(f"a time is needed: {forms}")
    now = now_ms() if now is None else now
    if text.isdigit() and text.isascii():
        if len(text) > 15:
            raise SinceError(f"{text!r} is too large for milliseconds since the epoch")
        return _in_range(text, int(text))
    if (m := _DURATION.fullmatch(text)) is not None:
        back = int(m[1]) * _UNITS_MS[m[2]]
        if back > _MAX_BACK_MS:
            raise SinceError(f"{text!r} reaches back more than a century")
        return _in_range(text, now - back)
    if (m := _RFC3339.fullmatch(text)) is not None:
        return _in_range(text, _rfc3339_ms(text, m))
    raise SinceError(f"{text!r} is not a time: use {forms}")


def _in_range(text: str, ms: int) -> int:
    if ms < 0:
        raise SinceError(f"{text!r} lies before 1970-01-01T00:00:00Z, the first time a "
                         "store can hold")
    if ms > _LATEST_MS:
        raise SinceError(f"{text!r} lies past year 9999 (the last time is "
                         f"{format_ms(_LATEST_MS)})")
    return ms


def _rfc3339_ms(text: str, m: re.Match[str]) -> int:
    year, month, day, hour, minute, second = (int(m[i]) for i in range(1, 7))
    micros = int((m[7] or "0")[:6].ljust(6, "0"))
    if m[8]:
        tz: timezone = UTC
    else:
        offset = timedelta(hours=int(m[10]), minutes=int(m[11]))
        if offset >= timedelta(hours=24):
            raise SinceError(f"{text!r} has an offset of a day or more")
        tz = timezone(-offset if m[9] == "-" else offset)
    if second == 60:  # a leap second (RFC 3339 allows it): the next second, as POSIX
        second = 59
        micros = 999_999
    try:
        when = datetime(year, month, day, hour, minute, second, micros, tzinfo=tz)
    except ValueError as exc:
        raise SinceError(f"{text!r} is not a valid date and time: {exc}") from None
    delta = when - _EPOCH  # exact: no float on the way
    return (delta.days * 86_400 + delta.seconds) * 1000 + delta.microseconds // 1000


def format_ms(ms: int) -> str:
    """ms since the epoch as RFC 3339 UTC with milliseconds (what the API shows); one
    no date can show (before year 1, past year 9999) as a number of ms."""
    try:
        when = _EPOCH + timedelta(milliseconds=ms)
    except OverflowError:
        return f"{ms} ms since the epoch"
    return when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms % 1000:03d}Z"


def split_replay(topic_filter: str) -> tuple[str, str] | None:
    """`$replay/<since>/<filter>` -> (since text, filter); None for any other filter.
    Raises SinceError when it starts so but lacks a filter. The since is not parsed
    here: the caller decides against which clock."""
    if not topic_filter.startswith(REPLAY_PREFIX):
        return None
    since, sep, rest = topic_filter[len(REPLAY_PREFIX):].partition("/")
    if not since or not sep or not rest:
        raise SinceError(f"{topic_filter!r}: a replay is $replay/<since>/<filter>")
    return since, rest
