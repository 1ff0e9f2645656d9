"""The generated parts of the docs site's configuration page, as an MkDocs hook.

docs/configuration.md holds the prose; a line of it that carries a marker comment
(`<!-- generated: settings -->`, `<!-- generated: example-toml -->`) is replaced, every
time the site is built, by what the settings tables of lightgate/settings.py and
`lightgate config --example` say now. So the page cannot fall behind the command line,
and no generated copy is kept in git to drift. A marker missing from the page fails the
build.

    python tools/docs_config.py     # print the page as the site renders it
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PAGE = "configuration.md"
SETTINGS_MARKER = "<!-- generated: settings -->"
EXAMPLE_MARKER = "<!-- generated: example-toml -->"
KIB = 1024


def _default(flag: str, default: Any) -> str:
    if default is None:
        return "(none)"
    if isinstance(default, bool):
        return f"`{str(default).lower()}`"
    if isinstance(default, str):
        return f'`"{default}"`'
    text = f"`{default!r}`"
    sized = any(word in flag for word in ("bytes", "size", "packet", "body"))
    if isinstance(default, int) and sized and default >= KIB:
        for unit, size in (("GiB", KIB**3), ("MiB", KIB**2), ("KiB", KIB)):
            if default % size == 0:
                return f"{text} ({default // size} {unit})"
    return text


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def settings_tables() -> str:
    """One table per concern (listeners, security, limits ...), in the order and with
    the titles `lightgate serve --help` uses; each row says which commands read it."""
    from lightgate.config_example import readers
    from lightgate.settings import BOUNDS, GROUP_TITLES, LIVE, all_settings, grouped

    commands = readers()
    out: list[str] = []
    for group, rows in grouped(list(all_settings().values())).items():
        title, about = GROUP_TITLES[group]
        out.append(f"### {title[0].upper()}{title[1:]}\n\n{about[0].upper()}{about[1:]}.\n\n")
        out.append("| flag · environment · file key | type | default | what it does | "
                   "read by |\n")
        out.append("|---|---|---|---|---|\n")
        for flag, typ, default, help_text in rows:
            key = flag.replace("-", "_")
            name = f"`--{flag}`<br>`LIGHTGATE_{key.upper()}`<br>`{key}`"
            takes = BOUNDS[flag].describe() if flag in BOUNDS else ""
            kind = f"{typ.__name__}: {takes}" if takes else typ.__name__
            live = " Re-read on SIGHUP." if flag in LIVE else ""
            out.append(f"| {name} | {kind} | {_default(flag, default)} | "
                       f"{_cell(help_text)}.{live} | {', '.join(commands[key])} |\n")
        out.append("\n")
    return "".join(out)


def example_toml() -> str:
    from lightgate.config_example import example

    return f"```toml\n{example().rstrip()}\n```\n"


def render(markdown: str) -> str:
    """The page with each marker's line replaced by what it stands for."""
    parts = {SETTINGS_MARKER: settings_tables, EXAMPLE_MARKER: example_toml}
    missing = [marker for marker in parts if marker not in markdown]
    if missing:
        raise ValueError(f"docs/{PAGE} lacks the marker line(s) {missing}")
    lines = []
    for line in markdown.splitlines(keepends=True):
        marker = next((m for m in parts if m in line), None)
        lines.append(parts[marker]() if marker else line)
    return "".join(lines)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """MkDocs hook (mkdocs.yml, `hooks:`): fill in the configuration page."""
    if page.file.src_uri != PAGE:
        return markdown
    try:
        return render(markdown)
    except ValueError as exc:
        from mkdocs.exceptions import PluginError

        raise PluginError(str(exc)) from None


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.stdout.write(render((ROOT / "docs" / PAGE).read_text()))
