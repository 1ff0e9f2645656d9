"""The distributions: an sdist, and from it a wheel with the native data plane.

    python tools/wheel.py [--out dist] [--require-native]
    python tools/wheel.py --requirements     # the tools it needs (the `build` extra)

`make wheel` runs it, and so does the image's build stage (deploy/docker/Dockerfile).
The wheel is built from the sdist, so a wheel that works says the sdist builds too. On
Linux the extension is linked by zig against glibc 2.17 (cargo-zigbuild: no Docker, no
old distribution needed), and auditwheel checks the wheel against manylinux2014 and tags
it so: `lightgate-<version>-cp311-abi3-manylinux_2_17_<arch>.manylinux2014_<arch>.whl`,
one wheel for CPython 3.11 and later. Without a Rust toolchain the wheel is pure Python
(`py3-none-any`, setup.py says why); --require-native makes that an error (the image),
and so is a Rust build that failed where there is a toolchain.

Cargo builds into native/target of the source tree (CARGO_TARGET_DIR overrides), and the
sdist is unpacked at a fixed place (build/sdist/), so a second build recompiles nothing
that did not change."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GLIBC = "2.17"  # manylinux2014's
EXTENSION = "serving/lightgate_native"


def requirements(root: Path) -> list[str]:
    """The `build` extra of pyproject.toml: the one list of these tools."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    return list(project["optional-dependencies"]["build"])


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=cwd, env=env, check=True)


def _host_triple() -> str:
    out = subprocess.run(["rustc", "-vV"], capture_output=True, text=True, check=True).stdout
    return next(ln.split(": ", 1)[1] for ln in out.splitlines() if ln.startswith("host: "))


def _zig_env(env: dict[str, str], work: Path) -> dict[str, str]:
    """setuptools-rust runs `$CARGO metadata` and `$CARGO rustc --target T`: a cargo
    that hands the build to cargo-zigbuild, which links with zig for the glibc named in
    T's suffix (and strips it for cargo), and leaves the rest to cargo."""
    shim = work / "cargo"
    shim.write_text('#!/bin/sh\n'
                    'if [ "$1" = rustc ]; then exec env -u CARGO cargo-zigbuild "$@"; fi\n'
                    'exec cargo "$@"\n')
    shim.chmod(0o755)
    return {**env, "CARGO": str(shim),
            "CARGO_BUILD_TARGET": f"{_host_triple()}.{GLIBC}"}


def _has_rust() -> bool:
    return bool(shutil.which("cargo") and shutil.which("rustc"))


def build(root: Path, out: Path, require_native: bool) -> Path:
    """The sdist and the wheel into `out`; the wheel's path."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("lightgate-*"):
        old.unlink()
    py = sys.executable
    # The tools (the venv's bin: cargo-zigbuild, auditwheel, python3 for `-m ziglang`)
    # first on PATH, and the crate's target directory the source tree's.
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(py).parent),
                                                  os.environ.get("PATH", "")])}
    env.setdefault("CARGO_TARGET_DIR", str(root / "native" / "target"))
    _run([py, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(out)], root, env)
    sdist = next(out.glob("lightgate-*.tar.gz"))
    unpacked = root / "build" / "sdist"
    shutil.rmtree(unpacked, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(unpacked, filter="data")
    src = unpacked / sdist.name.removesuffix(".tar.gz")
    rust = _has_rust()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        zig = sys.platform.startswith("linux") and rust
        if zig:
            if not shutil.which("cargo-zigbuild", path=env["PATH"]):
                raise SystemExit("cargo-zigbuild is not installed: pip install -r "
                                 "<(python tools/wheel.py --requirements), or make wheel")
            env = _zig_env(env, work)
        _run([py, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(work / "w")],
             src, env)
        wheel = next((work / "w").glob("*.whl"))
        if wheel.name.endswith("-py3-none-any.whl"):
            if require_native or rust:
                why = "though cargo is on PATH" if rust else "and --require-native"
                raise SystemExit(f"{wheel.name}: no native data plane in the wheel (the "
                                 f"line above says why), {why}")
            shutil.copy(wheel, out)
        elif zig:  # checked against manylinux2014 and tagged so
            arch = env["CARGO_BUILD_TARGET"].split("-", 1)[0]
            _run([py, "-m", "auditwheel", "repair", "--plat", f"manylinux2014_{arch}",
                  "--wheel-dir", str(out), str(wheel)], root, env)
        else:
            shutil.copy(wheel, out)
    return next(out.glob("lightgate-*.whl"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "dist"), help="where (default: dist/)")
    parser.add_argument("--require-native", action="store_true",
                        help="fail if the wheel holds no native data plane")
    parser.add_argument("--requirements", action="store_true",
                        help="print the tools this needs, one a line, and exit")
    args = parser.parse_args()
    if args.requirements:
        print("\n".join(requirements(ROOT)))
        return 0
    wheel = build(ROOT, Path(args.out).resolve(), args.require_native)
    print(f"built {wheel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
