"""The alert rules file (TOML), checked before Spark starts: a bad rule stops the job with
the rule and field named, rather than failing on the executors."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COMPARE_OPS = (">", ">=", "<", "<=", "==", "!=")
RATE_OPS = ("rate>", "rate>=", "rate<", "rate<=")


@dataclass(frozen=True)
class Rule:
    name: str
    field: str
    op: str
    threshold: float
    window: str | None = None

    @property
    def is_rate(self) -> bool:
        return self.op.startswith("rate")

    @property
    def compare(self) -> str:
        """The comparison itself (`rate>` compares with `>`)."""
        return self.op.removeprefix("rate")


@dataclass(frozen=True)
class Rules:
    source_topic: str
    device_from: str
    rules: tuple[Rule, ...]


def parse_rules(data: dict[str, Any]) -> Rules:
    source = str(data.get("source_topic", "devices"))
    if not source or any(c in source for c in "/#+"):
        raise ValueError(f"source_topic must be a first-level topic, got {source!r}")
    device_from = str(data.get("device_from", "topic:1"))
    check_device_from(device_from)
    raw = data.get("rule", [])
    if not isinstance(raw, list) or not raw:
        raise ValueError("the rules file needs at least one [[rule]]")
    rules = []
    names = set()
    for i, r in enumerate(raw):
        try:
            rule = Rule(name=str(r["name"]), field=str(r["field"]), op=str(r["op"]),
                        threshold=float(r["threshold"]),
                        window=str(r["window"]) if r.get("window") else None)
        except KeyError as exc:
            raise ValueError(f"rule {i + 1} has no {exc.args[0]!r}") from None
        if rule.op not in COMPARE_OPS + RATE_OPS:
            raise ValueError(f"rule {rule.name!r}: op must be one of "
                             f"{', '.join(COMPARE_OPS + RATE_OPS)}, got {rule.op!r}")
        if rule.is_rate and rule.window:
            raise ValueError(f"rule {rule.name!r}: a rate rule compares consecutive "
                             "readings and takes no window")
        if rule.name in names:
            raise ValueError(f"two rules are named {rule.name!r}")
        names.add(rule.name)
        rules.append(rule)
    return Rules(source, device_from, tuple(rules))


def load_rules(path: str | Path) -> Rules:
    with open(path, "rb") as f:
        try:
            data = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: {exc}") from None
    try:
        return parse_rules(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def check_device_from(spec: str) -> None:
    kind, _, arg = spec.partition(":")
    if spec == "client_id" or (kind == "json" and arg):
        return
    if kind == "topic" and arg.isdigit():
        return
    raise ValueError(f"device_from must be 'topic:N', 'client_id' or 'json:FIELD', got {spec!r}")
