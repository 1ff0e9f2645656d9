"""What a user gets is the repository: nothing in it may send them elsewhere.

- No tracked file (its path or its text) points at files outside the repository (the
  shared design notes kept beside it while it was built) or at numbered entries of
  the tracker it was built from: a reader has neither. Say what the note or the entry
  said, in the project's own words.
- The README is a front door, not the manual: short, and every file it links exists.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 260

# Written so that this file does not match them itself.
OUTSIDE = {
    "a path beside the repository": re.compile(r"(?:\.\./|/work/)shared\b"),
    "a design note kept outside the repository":
        re.compile(r"\b(?:DESIGN|INTERFACES|SEEDS|STYLE|CALIBRATION)\.md\b"),
    "a numbered tracker entry": re.compile(r"(?<![a-z])issues?[\s_#-]*\d+", re.I),
}


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                         check=True, timeout=60).stdout
    return [p for p in out.decode().split("\0") if p]


def test_nothing_tracked_points_outside_the_repository() -> None:
    found = []
    for path in tracked():
        for what, pattern in OUTSIDE.items():
            if pattern.search(path):
                found.append(f"{path} (its name): {what}")
        file = ROOT / path
        if not file.is_file():  # deleted in the work tree, not yet in the index
            continue
        data = file.read_bytes()
        if b"\0" in data:  # binary: pictures
            continue
        for number, line in enumerate(data.decode(errors="replace").splitlines(), 1):
            for what, pattern in OUTSIDE.items():
                match = pattern.search(line)
                if match:
                    found.append(f"{path}:{number}: {what}: {match.group(0)!r}")
    assert not found, ("these point a reader at what they do not have; say it in the "
                       "repository's own words instead:\n  " + "\n  ".join(found))


def test_the_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move the detail to "
        "a page under docs/ and link it")


def test_the_readme_links_only_to_files_that_exist() -> None:
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [t.split("#", 1)[0] for t in targets if not re.match(r"[a-z]+:", t)]
    assert local, "README.md links no page of docs/"
    missing = [t for t in local if t and not (ROOT / t).exists()]
    assert not missing, f"README.md links files that do not exist: {missing}"


def _names_left_undefined(code: str) -> set[str]:
    """Names a Python snippet reads that it neither imports nor assigns (nor builtins)."""
    import ast
    import builtins

    tree = ast.parse(code)
    defined = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
    return {n.id for n in ast.walk(tree)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - defined


def test_every_python_example_defines_what_it_uses() -> None:
    """A reader copies an example whole: one that uses `spark` or a DataFrame it never
    made fails at its first line."""
    pages = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md",
             *sorted(ROOT.glob("*/README.md"))]
    found = []
    for page in pages:
        for block in re.finditer(r"```python\n(.*?)```", page.read_text(), re.S):
            missing = _names_left_undefined(block.group(1))
            if missing:
                found.append(f"{page.relative_to(ROOT)}: {sorted(missing)}")
    assert not found, "examples that use names they never define:\n  " + "\n  ".join(found)
