"""Which data plane this process runs: the compiled one (`serving.lightgate_native`, built from
native/ with the package when a Rust toolchain is there) or pure Python.

`LIGHTGATE_NATIVE=0` runs pure Python even where the extension is installed (the
reference behaviour, and the fallback); `LIGHTGATE_NATIVE=1` requires the extension
(`require_native` says why it cannot start without it); unset, the extension is used
when it is there. Where it is not there (not built, not importable, or off), the servers
say so in one WARNING line at start-up (`warn_if_python`), and their ready lines end
with `plane=python`. The Python code stays the specification of every rule: the native
module implements parts of the per-message path to the same bytes, and tests hold the
two to one behaviour."""

from __future__ import annotations

import importlib.machinery
import logging
import os
from types import ModuleType

ENV = "LIGHTGATE_NATIVE"
DOCS = "docs/deployment.md#platforms-and-the-native-plane"


def _load() -> tuple[ModuleType | None, str | None]:
    """The extension, or None and why not (for the start-up warning)."""
    if os.environ.get(ENV, "").strip() == "0":
        return None, "off (LIGHTGATE_NATIVE=0)"
    try:
        from serving import lightgate_native
    except ImportError as exc:
        import serving

        found = importlib.machinery.PathFinder.find_spec("serving.lightgate_native",
                                                         list(serving.__path__))
        if found is None:  # no file: an install without a Rust toolchain, a pure wheel
            return None, ("not built (this install has none: a wheel for Linux has it, "
                          "or install from source with cargo on PATH)")
        return None, f"not importable ({found.origin}: {exc})"
    return lightgate_native, None


NATIVE, WHY_NOT = _load()


def name() -> str:
    """`native` or `python`: what the start-up log says."""
    return "native" if NATIVE is not None else "python"


def require_native() -> str | None:
    """Why this process may not start (LIGHTGATE_NATIVE=1 without the extension), or
    None."""
    if os.environ.get(ENV, "").strip() == "1" and NATIVE is None:
        return ("LIGHTGATE_NATIVE=1 but the native data plane is not installed (reinstall "
                "with a Rust toolchain: cargo on PATH, then `pip install .`); unset "
                "LIGHTGATE_NATIVE to run the Python plane")
    return None


def writer() -> str:
    """`native` when the native engine writes the CommitLog of `lightgate serve` and
    carries its plain-TCP connections: whenever the extension is there, unless
    LIGHTGATE_NATIVE=0 asks for the Python reference; else `python`."""
    return "native" if NATIVE is not None else "python"


def warn_if_python(log: logging.Logger, cost: str) -> None:
    """One WARNING line at start-up where the native plane is not there: why, and what
    this command gives up (`cost`) without it."""
    if WHY_NOT is not None:
        log.warning("the native data plane is %s: %s (%s)", WHY_NOT, cost, DOCS)
