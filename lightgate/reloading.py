"""The config file on SIGHUP (serving.reload): read again with the flags and the
environment the server started with, so that what the file says is what a restart would
take. A setting that is read where it is used each time (LIVE) takes its new value at
once; any other change is said to wait for the next start. A file that does not read
(bad TOML, an unknown key, a value a setting does not take) changes nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightgate.settings import LIVE
from serving.settings import fields_by_flag
from serving.startup import StartupError

# A config object the running server reads its settings from, its dataclass, and the
# prefix of its flags: where a new value goes.
Target = tuple[object, type, str]


class ConfigFile:
    """`--config FILE` of a running server, and the values in effect. `read`: every
    setting's value as the command line resolves it (flag, environment, file, default),
    a StartupError if the file does not do."""

    def __init__(self, read: Callable[[], dict[str, Any]], values: dict[str, Any],
                 targets: list[Target]) -> None:
        self.read = read
        self.values = dict(values)
        self.targets = targets

    async def __call__(self) -> list[str]:
        try:
            new = self.read()
        except StartupError as exc:  # one line; what is in effect stays
            raise ValueError(str(exc)) from None
        said = []
        for key, value in new.items():
            old = self.values[key]
            if value == old:
                continue
            flag = key.replace("_", "-")
            if flag in LIVE and self._apply(flag, value):
                self.values[key] = value
                said.append(f"--{flag} is now {value!r} (was {old!r})")
            else:
                said.append(f"--{flag} is {value!r} in the file, {old!r} in effect: it takes "
                            "effect at the next start")
        return said

    def _apply(self, flag: str, value: Any) -> bool:
        """Set `flag` to `value` where the server reads it; whether anything took it."""
        took = False
        for obj, cls, prefix in self.targets:
            field = fields_by_flag(cls, prefix).get(flag)
            if field is not None:
                setattr(obj, field, value)
                took = True
        return took
