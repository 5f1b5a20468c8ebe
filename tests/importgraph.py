"""The product's import graph, read from the source (ast): which module imports which, and which
private names cross a module's boundary. Every import counts, at module level or inside a
function, under `TYPE_CHECKING` or not: a cycle broken by a lazy import is still a cycle."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"tracer": "warninglight.tracer", "forensics": "warninglight.forensics", "cli": "warninglight.cli",
            "lab": "warninglight.lab", "integrations": "warninglight.integrations",
            "recovery": "warninglight.recovery"}


def modules() -> dict[str, Path]:
    """Every product module's dotted name and its file."""
    out = {}
    for folder, name in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([name, *parts])] = path
    return out


def _absolute(module: str, is_package: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, *([target] if target else [])])


@dataclass(frozen=True)
class Private:
    module: str
    line: int
    name: str  # dotted: the module it came from and the private name


def _imports(module: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[str, int, str | None]]:
    """(imported module, line, the name taken from it when that name is not a module)."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, None
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, is_package, node.level, node.module)
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in known:
                    yield sub, node.lineno, None
                else:
                    yield source, node.lineno, alias.name


def graph() -> dict[str, set[str]]:
    """Each product module's imports of other product modules."""
    known = modules()
    return {m: {t for t, _, _ in _imports(m, p, known) if t in known and t != m} for m, p in known.items()}


def private_crossings() -> list[Private]:
    """Private names (`_x`) one product module takes from another: imported by name, or read as an
    attribute of a module it imported."""
    known = modules()
    found = []
    for m, path in known.items():
        aliases: dict[str, str] = {}
        for target, line, name in _imports(m, path, known):
            if target in known and name is not None and name.startswith("_") and not name.startswith("__"):
                found.append(Private(m, line, f"{target}.{name}"))
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _absolute(m, path.name == "__init__.py", node.level, node.module)
                for alias in node.names:
                    if f"{source}.{alias.name}" in known:
                        aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in known and alias.asname:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__") and aliases[node.value.id] != m):
                found.append(Private(m, node.lineno, f"{aliases[node.value.id]}.{node.attr}"))
    return found


def cycles() -> list[list[str]]:
    """Each strongly connected set of more than one module (Tarjan), as sorted names."""
    g = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


if __name__ == "__main__":
    for c in cycles():
        print("cycle:", " ".join(c))
    for p in private_crossings():
        print(f"private: {p.module}:{p.line} takes {p.name}")
