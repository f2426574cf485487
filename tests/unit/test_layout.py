"""The shape of the source tree: two wings (the shim, the job), small rooms.

Read from the source with ``ast``, every import counted (also those inside
functions, which are how both wings defer heavy modules)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "specshim"
BENCHMARKS = ROOT / "benchmarks"
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 400


def _modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def _name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, as absolute dotted names."""
    found: set[str] = set()
    package = (
        _name(path)
        if path.name == "__init__.py"
        else _name(path)[: _name(path).rfind(".")]
    )
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _wing(module: str) -> str:
    if module.startswith("specshim.testing"):
        return "testing"
    if module.startswith("specshim.job"):
        return "job"
    if module in ("specshim.cli", "specshim.__main__"):
        return "cli"
    return "shim"


def test_the_tree_is_read():
    names = {_name(p) for p in _modules()}
    assert {"specshim", "specshim.job.extract", "specshim.cli"} <= names
    assert "specshim.job" in _imports(SRC / "cli.py") or any(
        name.startswith("specshim.job") for name in _imports(SRC / "cli.py")
    )


@pytest.mark.parametrize("wing", ["shim", "job", "cli"])
def test_production_never_imports_the_test_fixtures(wing):
    offenders = {
        _name(p): sorted(i for i in _imports(p) if i.startswith("specshim.testing"))
        for p in _modules()
        if _wing(_name(p)) == wing
    }
    assert not {k: v for k, v in offenders.items() if v}


def test_the_shim_imports_nothing_of_the_job():
    offenders = {
        _name(p): sorted(
            i for i in _imports(p) if _wing(i) in ("job", "cli") and i != "specshim"
        )
        for p in _modules()
        if _wing(_name(p)) == "shim"
    }
    assert not {k: v for k, v in offenders.items() if v}


def test_no_module_is_over_the_limit():
    long = {
        str(p.relative_to(SRC)): n
        for p in _modules()
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_is_over_the_limit():
    long = {}
    for path in _modules() + sorted(BENCHMARKS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.name}"] = lines
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def _module_edges() -> dict[str, set[str]]:
    """Which of specshim's modules each module imports (``if TYPE_CHECKING:``
    blocks and function bodies included). A name imported from a module
    (``from a.b import C``) counts as an import of ``a.b``; a module's own
    parent packages are left out, since importing any submodule runs them."""
    modules = {_name(p): p for p in _modules()}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in _imports(path):
            parts = imported.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()
            target = ".".join(parts)
            if target and target != name and not name.startswith(target + "."):
                targets.add(target)
        edges[name] = targets
    return edges


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every group of modules that reach each other through imports (Tarjan's
    strongly connected components, those of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_circles_are_found():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(edges) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_one_that_imports_it():
    circles = _circles(_module_edges())
    assert not circles, f"modules that import each other: {circles}"
