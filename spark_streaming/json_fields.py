"""Top-level fields of JSON payloads, parsed where the source decodes each record (a
Python worker) rather than in the JVM: a source column `json_KEY` of type double or long
is what Spark computes as

    try_cast(json_tuple(cast(payload as string), 'KEY') as double | long)

and these functions compute the same, value for value (tests/spark/test_json_fields.py
holds them to Spark, casting under ANSI mode as Spark 4 does, on payloads of every
shape). In the JVM that expression was the largest part of a job's CPU time: json_tuple
opens a Jackson parser per row through a new character decoder (an 8 KiB buffer each),
and copies each value it finds as text for the cast to parse again.

What json_tuple sees: the payload as UTF-8 (bad bytes replaced), parsed as one JSON
value (what follows it is not looked at); not an object, or not JSON up to the end of
that value: null for every key. A key's value is the text of the value: a string
unquoted, a number as Jackson writes it again (a double as Java's Double.toString), true
and false as such, null as null, an object or array as JSON text. The cast then parses
that text as Spark casts a string (try_cast: null where it fails).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import orjson

LONG_MIN, LONG_MAX = -(1 << 63), (1 << 63) - 1
_DECODER = json.JSONDecoder(strict=False, parse_constant=lambda name: _not_json(name))
# Java's Double.parseDouble after String.trim(): decimal forms and hexadecimal ones, with
# an optional f/d suffix (ASCII digits only).
_JAVA_DOUBLE = re.compile(
    r"[+-]?(?:NaN|Infinity|(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?[fFdD]?)")
_JAVA_HEX = re.compile(
    r"[+-]?0[xX](?:[0-9a-fA-F]+\.?|[0-9a-fA-F]*\.[0-9a-fA-F]+)[pP][+-]?[0-9]+[fFdD]?")
# Spark's cast of a string to long (ANSI, as try_cast runs it): a sign and digits.
_SPARK_LONG = re.compile(r"[+-]?[0-9]+")
TYPES = ("double", "long")
PREFIX = "json_"  # a source column json_KEY: the payload's top-level KEY


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def top_level(payload: bytes) -> dict[str, Any] | None:
    """The payload's JSON object, as json_tuple reads it; None if it is not one."""
    try:
        value = orjson.loads(payload)
    except orjson.JSONDecodeError:  # what orjson refuses and Jackson may take
        text = payload.decode("utf-8", "replace").lstrip(" \t\r\n")
        try:
            value, _ = _DECODER.raw_decode(text)  # one value; the rest is not read
        except (ValueError, RecursionError):
            return None
    return value if isinstance(value, dict) else None


def as_double(v: Any) -> float | None:
    """try_cast(<the value's json_tuple text> as double)."""
    if v is None or isinstance(v, bool):
        return None
    if isinstance(v, int):
        try:
            return float(v)
        except OverflowError:
            return math.inf if v > 0 else -math.inf
    if isinstance(v, float):
        # A number past a double's range: Jackson writes "Infinity" quoted, no number.
        return v if math.isfinite(v) else None
    if isinstance(v, str):
        return string_to_double(v)
    return None  # an object or array: its text is no number


def as_long(v: Any) -> int | None:
    """try_cast(<the value's json_tuple text> as long)."""
    if v is None or isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v if LONG_MIN <= v <= LONG_MAX else None
    if isinstance(v, str):
        return string_to_long(v)
    return None  # a double's text has a point or an exponent: not a long


def string_to_double(s: str) -> float | None:
    """Spark's cast of a string to double: Java's Double.parseDouble of the trimmed
    string, then the special words Spark adds (inf, infinity, nan, any case)."""
    t = _java_trim(s)
    decimal = _JAVA_DOUBLE.fullmatch(t)
    if decimal or _JAVA_HEX.fullmatch(t):
        if t[-1] in "fFdD":  # a Java type suffix (1.5d)
            t = t[:-1]
        return float(t.replace("Infinity", "inf")) if decimal else float.fromhex(t)
    special = t.lower()
    if special in ("inf", "+inf", "infinity", "+infinity"):
        return math.inf
    if special in ("-inf", "-infinity"):
        return -math.inf
    if special == "nan":
        return math.nan
    return None


def string_to_long(s: str) -> int | None:
    """Spark's cast of a string to long: digits with a sign between blanks, within a
    long; nothing else (no point, no exponent)."""
    t = _java_trim(s)
    if not _SPARK_LONG.fullmatch(t):
        return None
    value = int(t)
    return value if LONG_MIN <= value <= LONG_MAX else None


_BLANKS = "".join(chr(c) for c in range(0x21))


def _java_trim(s: str) -> str:
    """String.trim(): every character up to U+0020 off both ends."""
    return s.strip(_BLANKS)


def columns(payloads: list[bytes], fields: list[tuple[str, str]]) -> list[list[Any]]:
    """For each (key, type): the column of `payloads`' values (see the module). The
    usual values (a JSON number, of a payload orjson parses) take a short way."""
    out: list[list[Any]] = [[None] * len(payloads) for _ in fields]
    doubles = [(col, key) for col, (key, typ) in zip(out, fields, strict=True)
               if typ == "double"]
    longs = [(col, key) for col, (key, typ) in zip(out, fields, strict=True)
             if typ == "long"]
    loads, decode_error = orjson.loads, orjson.JSONDecodeError
    for i, payload in enumerate(payloads):
        try:
            obj = loads(payload)
        except decode_error:
            obj = top_level(payload)
        if type(obj) is not dict:
            continue
        for col, key in doubles:
            v = obj.get(key)
            t = type(v)
            col[i] = (v if v - v == 0 else None) if t is float else \
                float(v) if t is int and -_EXACT <= v <= _EXACT else as_double(v)
        for col, key in longs:
            v = obj.get(key)
            col[i] = v if type(v) is int and LONG_MIN <= v <= LONG_MAX else as_long(v)
    return out


_EXACT = 1 << 1000  # an int this small converts to a float without overflow
