"""Which data plane this process runs: the compiled one (`serving.lightgate_native`, built from
native/ with the package when a Rust toolchain is there) or pure Python.

`LIGHTGATE_NATIVE=0` runs pure Python even where the extension is installed (the
reference behaviour, and the fallback); `LIGHTGATE_NATIVE=1` requires the extension
(`require_native` says why it cannot start without it); unset, the extension is used
when it is there. The Python code stays the specification of every rule: the native
module implements parts of the per-message path to the same bytes, and tests hold the
two to one behaviour."""

from __future__ import annotations

import os
from types import ModuleType

ENV = "LIGHTGATE_NATIVE"


def _load() -> ModuleType | None:
    if os.environ.get(ENV, "").strip() == "0":
        return None
    try:
        from serving import lightgate_native
    except ImportError:
        return None
    return lightgate_native


NATIVE: ModuleType | None = _load()


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
