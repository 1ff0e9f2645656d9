"""Settings declared where their values are used: a config dataclass's field says its
command-line flag, help, default and the values it may take once (`setting`), and the
command line's tables are read from the fields (`settings_of`, `bounds_of`), so that
neither a default nor a check can drift between the two."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

# (flag without "--", type, default, help): a row of lightgate.settings' tables.
Setting = tuple[str, Any, Any, str]

_KEY = "setting"
_TYPES: dict[str, type] = {"int": int, "float": float, "str": str, "bool": bool, "Path": str}


@dataclasses.dataclass(frozen=True)
class Bounds:
    """The values a setting may take: a number at least `least`, more than `above`, at
    most `most`; a string one of `choices`. None (a setting not given) always may."""

    least: float | None = None
    above: float | None = None
    most: float | None = None
    choices: tuple[str, ...] = ()

    def refusal(self, value: Any) -> str | None:
        """Why `value` may not be ("must be at least 1, not 0"), or None."""
        if value is None:
            return None
        if self.choices:
            return None if value in self.choices else \
                f"must be {_or(self.choices)}, not {value!r}"
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number, not {value}"
        if self.least is not None and value < self.least:
            return f"must be at least {_num(self.least)}, not {_num(value)}"
        if self.above is not None and value <= self.above:
            return f"must be more than {_num(self.above)}, not {_num(value)}"
        if self.most is not None and value > self.most:
            return f"must be at most {_num(self.most)}, not {_num(value)}"
        return None

    def describe(self) -> str:
        """What it takes, for help texts: "at least 1", "more than 0, at most 10", "sync
        or async"; "" when nothing is said."""
        if self.choices:
            return _or(self.choices)
        said = [f"{word} {_num(x)}" for word, x in (("at least", self.least),
                ("more than", self.above), ("at most", self.most)) if x is not None]
        return ", ".join(said)

    @property
    def bounded(self) -> bool:
        """Whether it says anything: a least value, or choices."""
        return self.least is not None or self.above is not None or bool(self.choices)


def _or(choices: tuple[str, ...]) -> str:
    return choices[0] if len(choices) == 1 else f"{', '.join(choices[:-1])} or {choices[-1]}"


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


@dataclasses.dataclass(frozen=True)
class _Flag:
    help: str
    flag: str | None  # None: the field's name with "-" for "_"
    type: type | None  # None: the field's annotation (Optional's inner type)
    bounds: Bounds
    group: str | None  # None: its dataclass's (groups_of)
    live: bool


def setting(default: Any = None, help: str = "", *, flag: str | None = None,
            type: type | None = None, default_factory: Callable[[], Any] | None = None,
            least: float | None = None, above: float | None = None,
            most: float | None = None, choices: tuple[str, ...] = (),
            group: str | None = None, live: bool = False) -> Any:
    """A dataclass field that is also a setting of the command line, and the values it
    may take (Bounds: checked at start-up, before anything opens). A field made with
    `default_factory` (a list from a comma list) is a setting without a default.
    `group`: the concern `--help` and the docs list it under, when not its dataclass's;
    `live`: read where it is used each time, so that a new value from the config file
    takes effect on SIGHUP (lightgate.reloading), not only at the next start."""
    meta = {_KEY: _Flag(help, flag, type, Bounds(least, above, most, choices), group, live)}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def settings_of(cls: type, *names: str, prefix: str = "") -> list[Setting]:
    """The settings of `cls`'s fields, in field order (`names`: only those, in that
    order); `prefix` goes before each flag (`auth-` for the auth backends')."""
    fields = _flagged(cls)
    chosen = [fields[n] for n in names] if names else list(fields.values())
    return [_row(f, prefix) for f in chosen]


def bounds_of(cls: type, prefix: str = "") -> dict[str, Bounds]:
    """Flag (without "--") -> the values it may take, for each of `cls`'s settings."""
    return {_row(f, prefix)[0]: f.metadata[_KEY].bounds for f in _flagged(cls).values()}


def groups_of(cls: type, default: str, prefix: str = "") -> dict[str, str]:
    """Flag -> the concern it is listed under, for each of `cls`'s settings: its own
    group, else `default`."""
    return {_row(f, prefix)[0]: f.metadata[_KEY].group or default
            for f in _flagged(cls).values()}


def live_of(cls: type, prefix: str = "") -> set[str]:
    """The flags of `cls`'s settings that take a new value at run time (`live`)."""
    return {_row(f, prefix)[0] for f in _flagged(cls).values() if f.metadata[_KEY].live}


def fields_by_flag(cls: type, prefix: str = "") -> dict[str, str]:
    """Flag (without "--") -> the name of `cls`'s field it sets."""
    return {_row(f, prefix)[0]: name for name, f in _flagged(cls).items()}


def setting_of(cls: type, name: str) -> Setting:
    [row] = settings_of(cls, name)
    return row


def flag_values(cls: type, values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Field name -> value, from resolved settings keyed like the flags (with "_")."""
    return {name: values[_row(f, prefix)[0].replace("-", "_")]
            for name, f in _flagged(cls).items()}


def _flagged(cls: type) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(cls) if _KEY in f.metadata}


def _row(f: dataclasses.Field[Any], prefix: str = "") -> Setting:
    meta: _Flag = f.metadata[_KEY]
    typ = meta.type or _annotated_type(f)
    default = None if f.default is dataclasses.MISSING else f.default
    if default is not None and typ is str:
        default = str(default)  # a Path's default, as the flag takes it
    return (prefix + (meta.flag or f.name.replace("_", "-")), typ, default, meta.help)


def _annotated_type(f: dataclasses.Field[Any]) -> type:
    """int for `int` and `int | None` (annotations are strings here)."""
    text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
    inner = text.removesuffix(" | None")
    if inner not in _TYPES:
        raise TypeError(f"setting {f.name}: say its type (setting(type=...)) for {text!r}")
    return _TYPES[inner]
