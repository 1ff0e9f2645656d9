"""A Docker build context as Docker makes it, for tests on a machine with no Docker
engine: a Dockerfile's instructions, the files its build stage's COPY lines take from the
context, and .dockerignore's rules (Go's filepath.Match per path element, `**` for any
number of directories, `!` to take a path back, the last matching rule deciding, and a
path excluded with the directory above it)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in text.splitlines():
        if not pending and line.lstrip().startswith("#"):
            continue
        pending += line.rstrip("\\").strip() + " " if line.endswith("\\") else line.strip()
        if line.endswith("\\") or not pending.strip():
            continue
        word, _, rest = pending.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    return out


def build_stage_copies(text: str) -> list[tuple[list[str], str]]:
    """The build stage's COPY lines from the context: (sources, destination in WORKDIR)."""
    copies, workdir, stages = [], "/", 0
    for word, args in dockerfile_instructions(text):
        if word == "FROM":
            stages += 1
            if stages > 1:  # what the wheel is built from is the first stage's
                break
        elif word == "WORKDIR":
            workdir = args
        elif word == "COPY":
            parts = json.loads(args) if args.startswith("[") else shlex.split(args)
            if any(p.startswith("--from") for p in parts):
                continue
            parts = [p for p in parts if not p.startswith("--")]
            dest = parts[-1]
            copies.append((parts[:-1], dest if dest.startswith("/") else f"{workdir}/{dest}"))
    return copies


def pattern(p: str) -> re.Pattern[str]:
    """A .dockerignore pattern (Go's filepath.Match, plus `**` for any directories)."""
    out, i = "", 0
    while i < len(p):
        if p.startswith("**/", i):  # no directory, or any number of them
            out, i = out + "(?:.*/)?", i + 3
        elif p.startswith("**", i):
            out, i = out + ".*", i + 2
        elif p[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif p[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(p[i]), i + 1
    return re.compile(out + "$")


@dataclass
class DockerIgnore:
    rules: list[tuple[bool, re.Pattern[str]]]  # (exclude?, pattern); the last match wins

    @classmethod
    def read(cls, path: Path) -> DockerIgnore:
        rules = []
        lines = path.read_text().splitlines() if path.exists() else []
        for line in lines:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            negate = line.startswith("!")
            pat = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
            rules.append((not negate, pattern(pat)))
        return cls(rules)

    def excluded(self, rel: str) -> bool:
        """Docker's rule: a path is excluded if it or a directory above it matches."""
        parts = rel.split("/")
        candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        verdict = False
        for exclude, pat in self.rules:
            if any(pat.match(c) for c in candidates):
                verdict = exclude
        return verdict


def make_context(root: Path, dockerfile: str, dest: Path) -> list[str]:
    """What the build stage's COPY lines of `dockerfile` (a path in `root`, the context)
    put in its WORKDIR, copied to `dest` (mtimes kept, as COPY keeps them); the files'
    paths relative to `dest`."""
    ignore = DockerIgnore.read(root / ".dockerignore")
    text = (root / dockerfile).read_text()
    copies = build_stage_copies(text)
    workdir = next(args for word, args in dockerfile_instructions(text) if word == "WORKDIR")
    shutil.rmtree(dest, ignore_errors=True)
    placed = []
    for sources, target in copies:
        into = dest / os.path.relpath(target.rstrip("/") or "/", workdir)
        for src in sources:
            assert not ignore.excluded(src), f"COPY {src}: excluded by .dockerignore"
            path = root / src
            assert path.exists(), f"COPY {src}: not in the context"
            files = [path] if path.is_file() else sorted(_walk(path, root, ignore))
            for f in files:
                if path.is_file():
                    out = into / f.name if target.endswith("/") or len(sources) > 1 else into
                else:
                    out = into / f.relative_to(path)
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, out)
                placed.append(str(out.relative_to(dest)))
    return placed


def _walk(top: Path, root: Path, ignore: DockerIgnore) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(top):
        rel = Path(dirpath).relative_to(root)
        dirnames[:] = [d for d in dirnames if not ignore.excluded(str(rel / d))]
        for name in filenames:
            if not ignore.excluded(str(rel / name)):
                yield Path(dirpath) / name
