"""The distributions as users get them. No Docker engine runs here, so the image's build
context is made as Docker makes it (the files the build stage's COPY lines name, less
what .dockerignore excludes), and its wheel built as the image's RUN line builds it
(tools/wheel.py, what `make wheel` runs). That wheel must be abi3, tagged manylinux,
hold the extension, and run `plane=native` from a fresh virtual environment on a PATH
with no Rust toolchain. The sdist it was built from, built again without Rust, must give
a pure-Python wheel, say so in one line, and run `plane=python` saying why.

The fresh environments get the dependencies (trio, rocksdict, ...) from this one's
site-packages by a .pth line instead of from PyPI: the test needs no network. Cargo
builds into this checkout's native/target (the editable install warmed its host-side
crates) and the context sits at a fixed path (build/image-context), so a second run
recompiles nothing."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.ops.dockerfile import DockerIgnore, build_stage_copies, make_context, pattern

ROOT = Path(__file__).resolve().parents[2]
CONTEXT = ROOT / "build" / "image-context"
NO_RUST_PATH = os.pathsep.join(["/usr/local/bin", "/usr/bin", "/bin"])
MANYLINUX = re.compile(r"^lightgate-[\d.]+-cp311-abi3-(manylinux\w*\.)*manylinux\w*\.whl$")


def test_the_context_emulation_follows_dockers_rules(tmp_path: Path) -> None:
    """The few rules the emulation relies on, on a small tree of its own."""
    ignore = DockerIgnore([(True, pattern("native/target")), (True, pattern("**/*.so")),
                           (True, pattern("*.md")), (False, pattern("README.md")),
                           (True, pattern("*.pyc"))])
    assert ignore.excluded("native/target/release/x.rlib")
    assert ignore.excluded("serving/lightgate_native.abi3.so")
    assert ignore.excluded("x.so") and ignore.excluded("NOTES.md")
    assert not ignore.excluded("README.md") and not ignore.excluded("docs/a.md")
    assert not ignore.excluded("native/src/lib.rs")
    assert not ignore.excluded("serving/x.pyc")  # `*` stays in its directory (not fnmatch's)
    text = ("FROM a AS build\nWORKDIR /src\n# a comment\nCOPY x.toml y.py ./\n"
            "COPY --chown=1 tools/w.py tools/\nCOPY [\"native\", \"native\"]\n"
            "RUN make \\\n  this\nFROM b\nCOPY --from=build /dist/ /tmp/\n")
    assert build_stage_copies(text) == [(["x.toml", "y.py"], "/src/./"),
                                        (["tools/w.py"], "/src/tools/"),
                                        (["native"], "/src/native")]


# -- the builds -----------------------------------------------------------------------------
@dataclass
class Built:
    context: Path
    files: list[str]
    wheel: Path
    sdist: Path
    seconds: float


@pytest.fixture(scope="module")
def image_build(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """The image's build stage: its context, then its RUN line (tools/wheel.py)."""
    if not (shutil.which("cargo") and shutil.which("rustc")):
        pytest.skip("no Rust toolchain: the image's build stage has one")
    import time

    files = make_context(ROOT, "deploy/docker/Dockerfile", CONTEXT)
    # The image once had no native/ (nor cargo): it built, and ran the Python plane.
    assert "native/Cargo.toml" in files and "native/src/lib.rs" in files, files
    assert not any(f.startswith("native/target/") or f.endswith(".so") for f in files)
    out = tmp_path_factory.mktemp("dist")
    env = {**os.environ, "CARGO_TARGET_DIR": str(ROOT / "native" / "target")}
    env.pop("CARGO", None)
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "tools/wheel.py", "--out", str(out),
                          "--require-native"], cwd=CONTEXT, env=env, capture_output=True,
                         text=True, timeout=900)
    seconds = time.monotonic() - t0
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return Built(CONTEXT, files, next(out.glob("*.whl")), next(out.glob("*.tar.gz")),
                 seconds)


def _fresh_venv(where: Path, wheel: Path) -> Path:
    """A new virtual environment with `wheel` installed, the rest of what it needs
    reached through this environment's site-packages (no network); its bin."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    py = where / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                    "--no-deps", str(wheel)], check=True, timeout=300)
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig."
                                "get_paths()['purelib'])"], capture_output=True, text=True,
                               check=True).stdout.strip())
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return where / "bin"


def _run_server(bin_dir: Path, cwd: Path, command: str, *args: str) -> tuple[str, str]:
    """Start `lightgate COMMAND` from `bin_dir` with no Rust toolchain on PATH and nothing
    of this checkout on sys.path; its ready line and what it logged before it."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "LIGHTGATE_NATIVE", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join([str(bin_dir), NO_RUST_PATH])
    assert shutil.which("cargo", path=env["PATH"]) is None
    assert shutil.which("rustc", path=env["PATH"]) is None
    proc = subprocess.Popen([str(bin_dir / "lightgate"), command, *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        proc.terminate()
        assert proc.wait(30) == 0
        log = proc.stderr.read()
        assert line.startswith("ready "), (line, log)
        return line.strip(), log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _serve(bin_dir: Path, tmp: Path) -> tuple[str, str]:
    return _run_server(bin_dir, tmp, "serve", "--data-dir", str(tmp / "d"), "--mqtt",
                       "127.0.0.1:0", "--ws", "off", "--native", "127.0.0.1:0", "--http",
                       "127.0.0.1:0")


def _plane_warnings(log: str) -> list[str]:
    return [ln for ln in log.splitlines() if " WARNING " in ln and "native data plane" in ln]


def test_the_image_builds_an_abi3_manylinux_wheel_that_runs_native(
        image_build: Built, tmp_path: Path) -> None:
    wheel = image_build.wheel
    assert MANYLINUX.match(wheel.name), wheel.name
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        tags = zf.read(next(n for n in names if n.endswith(".dist-info/WHEEL"))).decode()
    assert "serving/lightgate_native.abi3.so" in names, names
    assert "Root-Is-Purelib: false" in tags and "Tag: cp311-abi3-manylinux2014_" in tags
    assert "gateway/dashboard/index.html" in names  # package data comes too
    with tarfile.open(image_build.sdist) as tar:
        members = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
    assert {"setup.py", "native/Cargo.toml", "native/Cargo.lock", "native/src/lib.rs",
            "native/src/py.rs"} <= members

    bin_dir = _fresh_venv(tmp_path / "venv", wheel)
    where = subprocess.run([str(bin_dir / "python"), "-c", "import serving.lightgate_native as"
                            " m; print(m.__file__)"], cwd=tmp_path, capture_output=True,
                           text=True, check=True).stdout
    assert where.startswith(str(tmp_path / "venv")), where  # the wheel's, not the checkout's
    began = time.monotonic()
    line, log = _serve(bin_dir, tmp_path)
    ready_s = time.monotonic() - began
    assert line.endswith("plane=native"), line
    assert not _plane_warnings(log), log
    size = wheel.stat().st_size
    assert size < 3 * 1024 * 1024, f"the wheel is {size:,} bytes"
    print(f"the image's wheel built in {image_build.seconds:.1f} s, {size:,} bytes; "
          f"serve from it ready in {ready_s:.2f} s")


def test_without_rust_the_sdist_gives_a_pure_wheel_that_says_why(
        image_build: Built, tmp_path: Path) -> None:
    """The sdist the image built its wheel from (unpacked where tools/wheel.py left it,
    with that build's extension still in its build/lib), built again with no cargo."""
    src = image_build.context / "build" / "sdist" / image_build.sdist.name[:-len(".tar.gz")]
    assert list((src / "build").glob("lib*/serving/lightgate_native*.so"))  # left there
    env = {k: v for k, v in os.environ.items() if k != "CARGO"}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), NO_RUST_PATH])
    res = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation",
                          "--outdir", str(tmp_path / "w")], cwd=src, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    said = [ln for ln in (res.stdout + res.stderr).splitlines()
            if "without the native data plane" in ln]
    assert len(said) == 1 and said[0].startswith("lightgate: building without the native "
                                                 "data plane (no Rust toolchain"), said
    wheel = next((tmp_path / "w").glob("*.whl"))
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    with zipfile.ZipFile(wheel) as zf:
        assert not [n for n in zf.namelist() if n.endswith((".so", ".pyd"))]
        assert "Root-Is-Purelib: true" in zf.read(
            next(n for n in zf.namelist() if n.endswith(".dist-info/WHEEL"))).decode()

    bin_dir = _fresh_venv(tmp_path / "venv", wheel)
    line, log = _serve(bin_dir, tmp_path)
    assert line.endswith("plane=python"), line
    warned = _plane_warnings(log)
    assert len(warned) == 1 and "native data plane is not built" in warned[0], log
    assert "docs/deployment.md#platforms-and-the-native-plane" in warned[0]

    # An extension that is there but does not load (another platform's, say): said too.
    site = next((tmp_path / "venv" / "lib").glob("python3*/site-packages"))
    (site / "serving" / "lightgate_native.abi3.so").write_bytes(b"not an ELF file")
    line, log = _run_server(bin_dir, tmp_path, "store", "--data-dir", str(tmp_path / "s"),
                            "--native", "127.0.0.1:0", "--http", "127.0.0.1:0")
    assert line.endswith("plane=python"), line
    warned = _plane_warnings(log)
    assert len(warned) == 1 and "native data plane is not importable" in warned[0], log
    assert "lightgate_native.abi3.so" in warned[0] and "encoded in Python" in warned[0]

