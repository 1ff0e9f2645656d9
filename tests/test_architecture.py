"""The house rules of the code's layout (its rooms, and who may import whom), read from
the source:

- no import circle among the project's own modules, counting every import in a file
  (function-level and TYPE_CHECKING ones too: a circle hidden in a function is still a
  circle, and still a surprise at run time);
- the gateway reaches the store only through its public face, store/api.py;
- rooms import downwards only.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "lightgate", "lightqueue", "notify", "serving", "spark_streaming",
            "store")
STORE_FACE = {"store", "store.api"}


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the project's packages."""
    out: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imported(module: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """(project module, line) for every import in `path`. `from pkg import name` means
    `pkg.name` when that is a module, else `pkg` (so `from store.auth import audit` in a
    module of store.auth depends on store.auth.audit, not on the package's __init__)."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = module.split(".") if is_package else module.split(".")[:-1]
                keep = len(package) - (node.level - 1)
                base = ".".join([*package[:keep], *([base] if base else [])])
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                     for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:  # `import a.b.c` of a non-module: its owner
                name = name.rpartition(".")[0]
            if name and name != module:
                yield name, node.lineno


def _graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], int]]:
    known = _modules()
    graph: dict[str, set[str]] = {m: set() for m in known}
    lines: dict[tuple[str, str], int] = {}
    for module, path in known.items():
        for target, line in _imported(module, path, known):
            graph[module].add(target)
            lines.setdefault((module, target), line)
    return graph, lines


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _describe(component: list[str], graph: dict[str, set[str]],
              lines: dict[tuple[str, str], int]) -> str:
    members = set(component)
    edges = [f"    {a} -> {b} (line {lines[a, b]})"
             for a in component for b in sorted(graph[a] & members)]
    return " <-> ".join(component) + "\n" + "\n".join(edges)


def test_no_import_cycles() -> None:
    graph, lines = _graph()
    cycles = _cycles(graph)
    assert not cycles, "import circles among the project's modules:\n" + "\n".join(
        _describe(c, graph, lines) for c in cycles)


def test_the_checker_sees_a_cycle() -> None:
    """The cycle finder itself: a circle of three, a self-contained pair, a tree."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}}
    assert sorted(_cycles(graph)) == [["a", "b", "c"], ["e", "f"]]


def test_gateway_uses_the_store_only_through_its_face() -> None:
    graph, lines = _graph()
    known = _modules()
    wrong = sorted(
        f"{module} imports {target} (line {lines[module, target]})"
        for module in known if module == "gateway" or module.startswith("gateway.")
        for target in graph[module]
        if (target == "store" or target.startswith("store.")) and target not in STORE_FACE)
    assert not wrong, ("the gateway must import the store from store.api only "
                       "(one interface, whichever store is behind it):\n  " + "\n  ".join(wrong))


# Who may import whom, room by room (downwards: the gateway on the store, never back);
# serving/ is shared plumbing any server room may use. lightgate/ is the wiring and may
# import every room.
MAY_IMPORT = {
    "gateway": {"store", "notify", "lightqueue", "serving"},
    "store": {"lightqueue", "serving"},
    "spark_streaming": {"store", "serving"},  # serving.values: pure, as the workers need
    "notify": set(),
    "lightqueue": set(),
    "serving": set(),
}


def test_rooms_import_downwards() -> None:
    graph, lines = _graph()
    wrong = sorted(
        f"{module} imports {target} (line {lines[module, target]})"
        for module, targets in graph.items()
        for target in targets
        if (room := module.split(".")[0]) in MAY_IMPORT
        and (other := target.split(".")[0]) != room and other not in MAY_IMPORT[room])
    assert not wrong, "imports against the rooms' direction:\n  " + "\n  ".join(wrong)


def test_the_mqtt_rules_are_sans_io() -> None:
    """gateway/mqtt/ (the codec and the connection's rules) takes bytes and values and
    returns bytes and events: no trio, no sockets, no store, no clock of its own."""
    banned = {"trio", "socket", "select", "asyncio", "store", "time"}
    wrong = []
    for path in sorted((ROOT / "gateway" / "mqtt").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            wrong += [f"{path.name} imports {n}" for n in names if n.split(".")[0] in banned]
    assert not wrong, wrong


def test_the_connection_is_a_thin_driver() -> None:
    """gateway/connection.py drives the rules over a socket; the rules themselves, and
    each part of what a connection does, live in modules of their own."""
    lines = len((ROOT / "gateway" / "connection.py").read_text().splitlines())
    assert lines <= 430, f"gateway/connection.py has {lines} lines"


def test_every_gateway_room_is_small() -> None:
    """A concern per file, each readable at a sitting: no module of the gateway is past
    ~500 lines but the codec, which is the wire format's tables and cases."""
    big = [f"{p.relative_to(ROOT)}: {n}" for p in sorted((ROOT / "gateway").rglob("*.py"))
           if p.name != "codec.py" and (n := len(p.read_text().splitlines())) > 525]
    assert not big, big


def test_a_gateway_loads_no_storage_engine() -> None:
    """A gateway of the separated mode talks to the store over the network: importing
    the gateway loads neither RocksDB nor the Raft controller."""
    import subprocess
    import sys

    code = ("import sys, gateway.app, gateway.connection, gateway.listener, gateway.admin; "
            "print(sorted(m for m in ('rocksdict', 'pysyncobj', 'store.service', "
            "'store.commitlog') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_mqtt_authentication_lives_with_mqtt() -> None:
    """JWTs, the HTTP auth hook and enhanced authentication are how MQTT clients prove who
    they are (gateway/auth): the store keeps users, policies and its own clients' auth,
    and needs neither PyJWT nor an HTTP client for it."""
    banned = {"jwt", "httpx"}
    wrong = []
    for path in sorted((ROOT / "store").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            wrong += [f"{path.relative_to(ROOT)} imports {n}" for n in names
                      if n.split(".")[0] in banned]
    assert not wrong, wrong
