"""The package's shape: no import cycles inside ``actorllm/``, and no module too long.

The import graph is read from the source with :mod:`ast`, not by importing: every
``import`` counts, at module level or inside a function, except those under
``if TYPE_CHECKING:`` (they never run). ``from actorllm import codec`` is an edge
to ``actorllm.wire.codec``; ``from actorllm.wire.codec import encode`` is one too. Importing a
submodule also runs its package's ``__init__``, but that is not counted: a package
that re-exports its submodules would otherwise be a cycle with each of them.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "actorllm"

MAX_LINES = 450

# Modules allowed over MAX_LINES, each with the reason it stays long. Remove an
# entry once its module is back under the bound; the test fails on a stale entry.
LONG_MODULES: dict[str, str] = {}  # none today; add one only with a reason

# Import cycles known today, each a set of modules, with the file that has to change.
# Remove an entry once the cycle is gone; the test fails on a stale entry.
KNOWN_CYCLES: dict[frozenset[str], str] = {}  # none today; add one only with a reason


def module_name(path: Path, root: Path) -> str:
    """``actorllm/server/app.py`` -> ``actorllm.server.app``; a package is its ``__init__``."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree``, skipping the bodies of ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for other in node.orelse:  # the else branch does run
                yield from _imports(ast.Module(body=[other], type_ignores=[]))
        else:
            yield from _imports(node)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    modules = set(files)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    package = name.split(".")
                    if not is_package:
                        package.pop()
                    package = package[:len(package) - (node.level - 1)]
                    base = ".".join([*package, base] if base else package)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules
                           else base for alias in node.names]
            for target in targets:
                # ``import a.b.c`` where c is not a module of ours: its longest known prefix.
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _describe(component: frozenset[str], graph: dict[str, set[str]]) -> str:
    edges = sorted(f"{a} -> {b}" for a in component for b in graph[a] if b in component)
    return "{" + ", ".join(sorted(component)) + "}: " + "; ".join(edges)


# --- the checks on actorllm/ -----------------------------------------------------------------


def test_no_import_cycles() -> None:
    graph = import_graph(PACKAGE)
    assert graph.get("actorllm.engine.async_engine"), "the graph is empty"
    found = cycles(graph)
    new = [c for c in found if c not in KNOWN_CYCLES]
    assert not new, "import cycles:\n" + "\n".join(_describe(c, graph) for c in new)
    stale = [sorted(c) for c in KNOWN_CYCLES if c not in found]
    assert not stale, f"cycles gone, remove them from KNOWN_CYCLES: {stale}"


def test_no_module_over_the_line_bound() -> None:
    lengths = {p.relative_to(PACKAGE.parent).as_posix(): len(p.read_text().splitlines())
               for p in PACKAGE.rglob("*.py")}
    long = {p: n for p, n in lengths.items() if n > MAX_LINES}
    new = {p: n for p, n in long.items() if p not in LONG_MODULES}
    assert not new, f"modules over {MAX_LINES} lines: {new}"
    stale = sorted(p for p in LONG_MODULES if lengths.get(p, 0) <= MAX_LINES)
    assert not stale, f"back under {MAX_LINES} lines, remove them from LONG_MODULES: {stale}"


# --- the checker itself, on made-up packages ---------------------------------------------------


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_finds_a_cycle_through_a_function_level_import(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "from pkg.b import x\n",
        "b.py": "def f():\n    from pkg import a\n",
        "c.py": "import pkg.a\n",
    })
    graph = import_graph(root)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.a"}
    assert cycles(graph) == [frozenset({"pkg.a", "pkg.b"})]


def test_type_checking_imports_do_not_count(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "from pkg.b import x\n",
        "b.py": ("import typing\nif typing.TYPE_CHECKING:\n    from pkg.a import y\n"
                 "else:\n    from pkg import c\n"),
        "c.py": "",
    })
    graph = import_graph(root)
    assert graph["pkg.b"] == {"pkg.c"}
    assert cycles(graph) == []


@pytest.mark.parametrize(("source", "target"), [
    ("from . import b", "pkg.sub.b"),
    ("from .b import x", "pkg.sub.b"),
    ("from .. import c", "pkg.c"),
    ("from ..c import x", "pkg.c"),
    ("import pkg.sub.b.x", "pkg.sub.b"),
])
def test_resolves_relative_and_dotted_imports(tmp_path: Path, source: str,
                                              target: str) -> None:
    root = _package(tmp_path, {
        "__init__.py": "", "c.py": "", "sub/__init__.py": "", "sub/b.py": "",
        "sub/a.py": source + "\n",
    })
    assert import_graph(root)["pkg.sub.a"] == {target}
