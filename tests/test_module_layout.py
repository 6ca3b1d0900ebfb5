"""The packages' modules depend on each other one way: no module imports, even for type checking only, a
module that imports it back (a cycle holds modules together that the layout says are apart, and ends in a
lazy import that breaks when the order of imports changes). Imports inside functions are left out: they are
how a path imports what it alone needs."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("runtime", "snapshots", "handlers")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_level_imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Modules of ours imported at module level, under `if TYPE_CHECKING:` and `try:` included."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names)
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))

    visit(ast.parse(path.read_text()).body)
    return {m for m in found if m in known and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in graph:
        if v not in index:
            connect(v)
    return found


def test_no_module_imports_one_that_imports_it_back():
    paths = {module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}
    graph = {name: top_level_imports(path, name, set(paths)) for name, path in paths.items()}
    assert graph["runtime.server.state"] >= {"runtime.server.metrics", "runtime.server.engine_view"}
    assert cycles(graph) == []
