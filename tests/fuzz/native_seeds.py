"""The native-protocol inputs that found past defects (tests/native/test_defects_native.py
holds their regressions): the corpus that
fuzz_native.py starts from (kept apart from it, which instruments what it imports)."""

from __future__ import annotations

from store import protocol as p


def _frame(code: int, header: bytes, body: bytes = b"") -> bytes:
    rest = p.HEAD.size - 4 + len(header) + len(body)
    return p.HEAD.pack(rest, p.VERSION, p.REQUEST, code, 1, len(header)) + header + body


SEED_INPUTS = [
    b"\x00" + _frame(p.HELLO, b'{"x":{"$b64":5}}'),
    b"\x03" + _frame(p.HELLO, b'{"x":[{"$b64":"@@"}]}'),
    b"\x00" + _frame(p.SEND, b'{"topic":"cmd","messages":[{"topic":"cmd","size":1,'
                             b'"props":{"k":{"\\u0024b64":5}}}]}', b"x"),
    b"\x00" + _frame(p.SEND, b'{"topic":"dev","messages":[{"topic":"dev/1/cmd","size":2,'
                             b'"qos":3}]}', b"on"),
    b"\x01" + _frame(p.PUBLISH, b'{"messages":[{"topic":"a/b","size":1,"qos":1,'
                                b'"props":{"message_expiry_interval":9,'
                                b'"user_property":[["k","v"]]}}]}', b"z"),
]
