"""Settings declared where their values are used: a config dataclass's field says its
command-line flag, help and default once (`setting`), and the command line's tables
are read from the fields (`settings_of`), so a default cannot drift between the two."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

# (flag without "--", type, default, help): a row of lightgate.settings' tables.
Setting = tuple[str, Any, Any, str]

_KEY = "setting"
_TYPES: dict[str, type] = {"int": int, "float": float, "str": str, "bool": bool, "Path": str}


@dataclasses.dataclass(frozen=True)
class _Flag:
    help: str
    flag: str | None  # None: the field's name with "-" for "_"
    type: type | None  # None: the field's annotation (Optional's inner type)


def setting(default: Any = None, help: str = "", *, flag: str | None = None,
            type: type | None = None, default_factory: Callable[[], Any] | None = None
            ) -> Any:
    """A dataclass field that is also a setting of the command line. A field made with
    `default_factory` (a list from a comma list) is a setting without a default."""
    meta = {_KEY: _Flag(help, flag, type)}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def settings_of(cls: type, *names: str, prefix: str = "") -> list[Setting]:
    """The settings of `cls`'s fields, in field order (`names`: only those, in that
    order); `prefix` goes before each flag (`auth-` for the auth backends')."""
    fields = _flagged(cls)
    chosen = [fields[n] for n in names] if names else list(fields.values())
    return [_row(f, prefix) for f in chosen]


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
