"""What pyproject.toml cannot say about the build: the native extension is optional, and a
wheel says truthfully whether it holds one.

- Built (a Rust toolchain on PATH): `serving/lightgate_native.abi3.so`, on CPython's
  stable ABI from 3.11 (native/Cargo.toml), in a `cp311-abi3-<platform>` wheel.
- Not built (no cargo, or its build failed): one line says so, and the wheel is pure
  Python, `py3-none-any`; without this it was tagged for this interpreter and platform
  while holding no compiled code.

An editable install (`make`) builds the extension in place, as `serving/` holds it, and
removes what an earlier build left there under another name (an extension named for one
interpreter, `.cpython-311-...so`, is imported before an `.abi3.so` beside it)."""

from __future__ import annotations

import importlib.machinery
import os
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel
from setuptools_rust import build_rust as _build_rust

PACKAGE, MODULE = "serving", "lightgate_native"
DOCS = "docs/deployment.md#platforms-and-the-native-plane"


def _extensions_in(folder: Path) -> list[Path]:
    """Every file in `folder` that Python would import as the extension module."""
    return [p for suffix in importlib.machinery.EXTENSION_SUFFIXES
            for p in folder.glob(MODULE + suffix)]


_said: set[str] = set()


def _without_native(why: str) -> None:
    if why in _said:  # once, however many times the build steps ask for the extension
        return
    _said.add(why)
    print(f"lightgate: building without the native data plane ({why}): this install runs "
          f"the pure-Python plane, in a py3-none-any wheel ({DOCS})", file=sys.stderr)


class build_rust(_build_rust):
    def run(self) -> None:
        build_lib = Path(self.get_finalized_command("build_ext").build_lib, PACKAGE)
        for stale in _extensions_in(build_lib):  # a build before this one's, not this one's
            stale.unlink()
        cargo = os.environ.get("CARGO", "cargo")
        if not (shutil.which(cargo) and shutil.which("rustc")):
            _without_native(f"no Rust toolchain: {cargo} and rustc are not on PATH")
            return
        super().run()  # the extension is optional: a failed build is printed, not raised
        built = _extensions_in(Path(PACKAGE) if self.inplace else build_lib)
        if not built:
            _without_native("the Rust build failed, above")

    def run_for_extension(self, ext: object) -> None:
        super().run_for_extension(ext)
        if self.inplace:
            target = Path(self.get_dylib_ext_path(ext, ext.name))  # type: ignore[attr-defined]
            for other in _extensions_in(target.parent):
                if other.name != target.name:
                    other.unlink()


class bdist_wheel(_bdist_wheel):
    def run(self) -> None:
        self.run_command("build")  # before the tag is chosen: it depends on what was built
        build_lib = Path(self.get_finalized_command("build_ext").build_lib, PACKAGE)
        if not _extensions_in(build_lib):
            self.root_is_pure = True  # py3-none-any
            self.py_limited_api = False
        super().run()


setup(
    cmdclass={"build_rust": build_rust, "bdist_wheel": bdist_wheel},
    # abi3: named `.abi3.so` and tagged `cp311-abi3`, as native/Cargo.toml builds it.
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
