"""The installed Lightgate's version, said the one way everywhere it is said
(`lightgate --version`, `$SYS/broker/version`)."""

from __future__ import annotations

from functools import cache
from importlib.metadata import PackageNotFoundError, version


@cache
def lightgate_version() -> str:
    """The installed package's version."""
    try:
        return version("lightgate")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def version_line() -> str:
    """"lightgate version 0.1.0", as Mosquitto says its own."""
    return f"lightgate version {lightgate_version()}"
