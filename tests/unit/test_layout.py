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
# Every tree of the house's Python the size rules hold in.
TREES = [ROOT / "src", BENCHMARKS, ROOT / "matrix", ROOT / "tests"]
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
    assert {"specshim", "specshim.job.extract.command", "specshim.cli"} <= names
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


def test_the_job_reaches_the_shim_through_its_public_seam():
    """No job module imports a patch file (or ``specshim.patches`` at all): a
    patch is removed when its "Remove when" comes true, and the job must not
    break at run time then. What the job needs of the shim lives in modules
    outside ``patches/`` (``specshim.close``, ``specshim._environ``)."""
    offenders = {
        _name(p): sorted(i for i in _imports(p) if i.startswith("specshim.patches"))
        for p in _modules()
        if _wing(_name(p)) in ("job", "cli")
    }
    assert not {k: v for k, v in offenders.items() if v}


def _house() -> list[Path]:
    return sorted(p for tree in TREES for p in tree.rglob("*.py"))


def test_no_module_is_over_the_limit():
    long = {
        str(p.relative_to(ROOT)): n
        for p in _house()
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_is_over_the_limit():
    long = {}
    for path in _house():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.name}"] = lines
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_size_rules_read_the_whole_house():
    read = {p.relative_to(ROOT).parts[0] for p in _house()}
    assert read == {"src", "benchmarks", "matrix", "tests"}
    assert SRC / "job" / "extract" / "command.py" in _house()


def test_the_job_has_few_rooms_at_its_root():
    """The job's root holds its rooms by role (packages) and a few modules:
    at most 10 rooms, ``__init__`` aside."""
    rooms = [
        p.name
        for p in (SRC / "job").iterdir()
        if (p.is_dir() and (p / "__init__.py").exists())
        or (p.suffix == ".py" and p.name != "__init__.py")
    ]
    assert 0 < len(rooms) <= 10, sorted(rooms)


def test_every_package_of_rooms_opens_with_its_map():
    """Each job package and the patch set say what each of their rooms holds,
    first thing: a docstring that names every module (or folder) inside."""
    packages = [p for p in (SRC / "job").iterdir() if (p / "__init__.py").exists()]
    packages += [SRC / "job", SRC / "patches", SRC / "patches" / "_transport"]
    for package in packages:
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
        assert doc and "Rooms:" in doc, package
        inside = {
            p.stem if p.suffix == ".py" else p.name
            for p in package.iterdir()
            if (p.suffix == ".py" and p.name != "__init__.py")
            or (p.is_dir() and (p / "__init__.py").exists())
        }
        missing = [name for name in inside if f"``{name}" not in doc]
        assert not missing, f"{package.relative_to(SRC)} map lacks {missing}"


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
