"""The source's json_KEY columns equal what Spark computes in the JVM,
try_cast(json_tuple(cast(payload as string), KEY) as double | long), on payloads of
every shape: hand-picked edge cases and thousands of random ones."""

from __future__ import annotations

import json
import math
import random
from typing import Any

from tests.spark.conftest import require_spark

require_spark()

from spark_streaming.json_fields import columns  # noqa: E402

KEYS = ["t", "ts", "n"]
EDGE = [
    b'{"t": 21.5, "ts": 1700000000000}', b'{"t": "22", "ts": "1700000000001"}', b"23.5",
    b'{"t": null}', b'{"t": {"c": 1}, "ts": 5}', b"not json", b"", b"[1, 2]", b"null",
    b'{"t": 1e2, "ts": 1.7e12}', b'{"ts": 1.5, "t": -0}', b'{"ts": 123456.7}',
    b'{"ts": 9999999.5}', b'{"ts": 10000000.0}', b'{"ts": 0.0005}', b'{"ts": -0.0}',
    b'{"ts": 99999999999999999999}', b'{"t": 1e400, "ts": -1e400}',
    b'{"t": " 42 ", "ts": " 17 "}', b'{"t": "1.5d", "ts": "1.5"}', b'{"t": "1_0"}',
    b'{"t": "NaN", "ts": "5."}', b'{"t": "Infinity"}', b'{"t": "-inf"}', b'{"t": "iNf"}',
    b'{"t": "nan"}', b'{"t": "0x1p3"}', b'{"t": "1e", "ts": "1e3"}', b'{"t": ".5"}',
    b'{"t": "+.5e-3f", "ts": "+12"}', b'{"t": true, "ts": false}', b'{"t": [1]}',
    b'{"t": 1, "t": 2}', b'{"t": 1} trailing', b'{"t": 1,}', b'{"t": "a\nb"}',
    b'{"t": "\\u0032\\u0032"}', b'  {"t": 3}', b'{"t": 3', b'\xff\xfe{"t": 1}',
    b'{"t": "\xff"}', b'{"ts": "9223372036854775807"}', b'{"ts": "9223372036854775808"}',
    b'{"ts": "-9223372036854775808"}', b'{"ts": 9223372036854775807}', b'{"t": "\\t7\\n"}',
    b'{"t": NaN}', b'{"t": Infinity}', b'{"t": 5}\n{"t": 6}', b'{"n": {"t": 1}}',
    b'{"t": "1e308", "ts": "00012"}', b'{"t": "1.7976931348623159e308"}', b'"str"',
    b'{"ts": 1e7}', b'{"ts": 1e-3}', b'{"ts": 0.001}', b'{"ts": 9.999999e6}',
]


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 2 else 7)
    if kind == 0:
        return rng.randrange(-10**rng.randrange(1, 22), 10**rng.randrange(1, 22))
    if kind == 1:
        return rng.uniform(-1e9, 1e9) * 10 ** rng.randrange(-12, 12)
    if kind == 2:
        return rng.choice([True, False, None])
    if kind in (3, 4):
        forms = [str(rng.randrange(-10**6, 10**6)), f"{rng.uniform(-1e4, 1e4):.3f}",
                 f" {rng.randrange(100)} ", f"{rng.randrange(1, 99)}e{rng.randrange(-5, 5)}",
                 rng.choice(["inf", "-Infinity", "NaN", "nan", "1d", "2.5F", "x", "", "1.",
                             "+7", "--1", "1e+2", "12.5.1", "٣"])]
        return rng.choice(forms)
    if kind == 5:
        return rng.randrange(10**6) / 8
    if kind == 6:
        return float(rng.randrange(-10**8, 10**8))
    if kind == 7:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {k: _random_value(rng, depth + 1) for k in rng.sample(KEYS, rng.randrange(3))}


def _payloads(n: int) -> list[bytes]:
    rng = random.Random(38)
    out = list(EDGE)
    for _ in range(n):
        obj = {k: _random_value(rng) for k in rng.sample(KEYS, rng.randrange(4))}
        text = json.dumps(obj) if rng.random() < 0.9 else json.dumps(_random_value(rng))
        out.append(text.encode())
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b and type(a) is type(b)


def test_json_columns_equal_json_tuple_and_try_cast(spark: Any) -> None:
    from pyspark.sql import functions as F  # noqa: N812

    payloads = _payloads(3000)
    df = spark.createDataFrame([(i, p) for i, p in enumerate(payloads)],
                               "i long, payload binary")
    text = F.col("payload").cast("string")
    tupled = df.select("i", F.json_tuple(text, *KEYS).alias(*KEYS))
    rows = tupled.select("i", *[F.col(k).try_cast(t).alias(f"{k}_{t}") for k in KEYS
                                for t in ("double", "long")]).collect()
    fields = [(k, t) for k in KEYS for t in ("double", "long")]
    ours = columns(payloads, fields)
    wrong = []
    for r in rows:
        for j, (k, t) in enumerate(fields):
            want, got = r[f"{k}_{t}"], ours[j][r.i]
            if not _same(want, got):
                wrong.append((payloads[r.i], k, t, want, got))
    assert not wrong, f"{len(wrong)} differ, e.g. {wrong[:8]}"
