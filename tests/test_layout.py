"""The package's shape: who may import whom inside ``actorllm/``, and how long things grow.

The import graph is read from the source with :mod:`ast`, not by importing: every
``import`` counts, at module level, inside a function, or under ``if TYPE_CHECKING:``
(a cycle there is still a cycle for the reader, and for a type checker).
``from actorllm import codec`` is an edge to ``actorllm.wire.codec``; ``from
actorllm.wire.codec import encode`` is one too. Importing a submodule also runs its
package's ``__init__``, but that is not counted: a package that re-exports its
submodules would otherwise be a cycle with each of them.

The rules:

- no import cycle;
- no module over ``MAX_LINES`` lines, no function over ``MAX_FUNCTION_LINES``;
- an actor's package imports only the shared ground and itself (the Worker also the
  model, its ops and kernels); the shared ground imports no actor's package. The
  wiring and the edges (engine, topology, server, cli, llm, replay, the package's
  ``__init__``) may import anything.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "actorllm"

MAX_LINES = 400
MAX_FUNCTION_LINES = 80

ACTORS = frozenset({"frontend", "tokenizer", "scheduler", "worker", "detokenizer"})
SHARED_GROUND = frozenset({"lifecycle", "wire", "text", "config", "metrics", "clock",
                           "exit_codes", "cpus"})
# What an actor may import beyond the shared ground and its own package.
ACTOR_EXTRAS: dict[str, frozenset[str]] = {"worker": frozenset({"model", "ops", "kernels"})}

# Modules allowed over MAX_LINES, each with the reason it stays long. Remove an
# entry once its module is back under the bound; the test fails on a stale entry.
LONG_MODULES: dict[str, str] = {}  # none today; add one only with a reason

# Functions allowed over MAX_FUNCTION_LINES ("path:Qual.name"), each with its reason.
# Remove an entry once its function is back under the bound; the test fails on a stale one.
LONG_FUNCTIONS: dict[str, str] = {}  # none today; add one only with a reason

# Import cycles known today, each a set of modules, with the file that has to change.
# Remove an entry once the cycle is gone; the test fails on a stale entry.
KNOWN_CYCLES: dict[frozenset[str], str] = {}  # none today; add one only with a reason


def module_name(path: Path, root: Path) -> str:
    """``actorllm/server/app.py`` -> ``actorllm.server.app``; a package is its ``__init__``."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree``, wherever it stands (TYPE_CHECKING included)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


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


def area(module: str) -> str:
    """The top-level part of the package a module belongs to: ``actorllm.wire.codec`` ->
    ``wire``, ``actorllm.config`` -> ``config``, the package itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def ownership_violations(graph: dict[str, set[str]]) -> list[str]:
    """Each import that crosses an owner's line: an actor importing anything but the shared
    ground, itself (and, for the Worker, the model, ops and kernels); the shared ground
    importing an actor."""
    found = []
    for module, targets in sorted(graph.items()):
        mine = area(module)
        if mine in ACTORS:
            allowed = SHARED_GROUND | {mine} | ACTOR_EXTRAS.get(mine, frozenset())
        elif mine in SHARED_GROUND:
            allowed = None  # anything but an actor
        else:
            continue  # wiring and edges import anything
        for target in sorted(targets):
            theirs = area(target)
            if (theirs not in allowed) if allowed is not None else (theirs in ACTORS):
                found.append(f"{module} -> {target}")
    return found


def function_lengths(root: Path) -> dict[str, int]:
    """``"pkg/mod.py:Class.method"`` -> its lines, from ``def`` to its last line, for every
    function and method (nested ones too, and counted in their parent as well)."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str, rel: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qualname = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    assert child.end_lineno is not None
                    lengths[f"{rel}:{qualname}"] = child.end_lineno - child.lineno + 1
                visit(child, qualname + ".", rel)
            else:
                visit(child, prefix, rel)

    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).as_posix()
        visit(ast.parse(path.read_text(), filename=str(path)), "", rel)
    return lengths


def _over(measured: dict[str, int], bound: int, known: dict[str, str],
          what: str) -> None:
    """Fail on anything over ``bound`` not in ``known``, and on a ``known`` entry no longer
    over it."""
    over = {k: n for k, n in measured.items() if n > bound}
    new = {k: n for k, n in over.items() if k not in known}
    assert not new, f"{what} over {bound} lines: {new}"
    stale = sorted(k for k in known if measured.get(k, 0) <= bound)
    assert not stale, f"{what} back under {bound} lines (or gone), remove them: {stale}"


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
    _over(lengths, MAX_LINES, LONG_MODULES, "modules")


def test_no_function_over_the_line_bound() -> None:
    lengths = function_lengths(PACKAGE)
    assert "actorllm/engine/async_engine.py:open_engine" in lengths, "no functions found"
    _over(lengths, MAX_FUNCTION_LINES, LONG_FUNCTIONS, "functions")


def test_each_actor_imports_only_the_shared_ground_and_itself() -> None:
    graph = import_graph(PACKAGE)
    assert {area(m) for m in graph} >= ACTORS | SHARED_GROUND, "an area has gone or moved"
    violations = ownership_violations(graph)
    assert not violations, "imports across an owner's line:\n" + "\n".join(violations)


# --- the checkers themselves, on made-up packages ----------------------------------------------


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


def test_finds_a_cycle_through_a_type_checking_import(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "from pkg.b import x\n",
        "b.py": ("import typing\nif typing.TYPE_CHECKING:\n    from pkg.a import y\n"
                 "else:\n    from pkg import c\n"),
        "c.py": "",
    })
    graph = import_graph(root)
    assert graph["pkg.b"] == {"pkg.a", "pkg.c"}
    assert cycles(graph) == [frozenset({"pkg.a", "pkg.b"})]


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


def test_finds_imports_across_an_owners_line(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "__init__.py": "from pkg.engine import run\n",
        "config.py": "",
        "clock.py": "from pkg import config\n",  # ground -> ground: fine
        "wire/__init__.py": "", "wire/codec.py": "import pkg.tokenizer.actor\n",
        "model/__init__.py": "",
        "engine/__init__.py": "from pkg.scheduler import actor\nfrom pkg import model\n",
        "frontend/__init__.py": "",
        "frontend/actor.py": ("from pkg import config\nfrom pkg.wire import codec\n"
                              "from pkg.frontend import outputs\n"
                              "def f():\n    from pkg.scheduler.actor import x\n"),
        "frontend/outputs.py": "import typing\nif typing.TYPE_CHECKING:\n    import pkg\n",
        "scheduler/__init__.py": "", "scheduler/actor.py": "from pkg.model import llama\n",
        "tokenizer/__init__.py": "", "tokenizer/actor.py": "",
        "worker/__init__.py": "", "worker/actor.py": "from pkg.model import x\n",
    })
    assert ownership_violations(import_graph(root)) == [
        "pkg.frontend.actor -> pkg.scheduler.actor",  # an actor imports another actor
        "pkg.frontend.outputs -> pkg",  # ... or the wiring
        "pkg.scheduler.actor -> pkg.model",  # the model is the Worker's alone
        "pkg.wire.codec -> pkg.tokenizer.actor",  # the ground imports an actor
    ]


def test_measures_every_function_from_def_to_its_last_line(tmp_path: Path) -> None:
    def lines(n: int, indent: int) -> str:
        return (" " * indent + "x = 1\n") * n

    root = _package(tmp_path, {
        "__init__.py": "",
        "m.py": ("def short():\n" + lines(79, 4) + "\n"
                 "class C:\n"
                 "    async def long(self):\n" + lines(80, 8) +
                 "        def inner():\n" + lines(2, 12)),
    })
    lengths = function_lengths(root)
    assert lengths == {"pkg/m.py:short": 80, "pkg/m.py:C.long": 84,
                       "pkg/m.py:C.long.inner": 3}
    over = {k for k, n in lengths.items() if n > MAX_FUNCTION_LINES}
    assert over == {"pkg/m.py:C.long"}


# Property tests whose bare max_examples is meant to stay the same under every profile.
FIXED_BUDGETS: dict[str, str] = {
    "test_planted_bugs.py": "a ceiling on the search for each planted bug, not a budget",
    "sim/profiles.py": "the profiles themselves",
}


def test_every_property_test_spells_its_budget_through_examples() -> None:
    """A bare ``max_examples=N`` overrides every hypothesis profile, so ``--hypothesis-
    profile=long`` (``CI_LONG=1``) would not reach that test (tests/sim/profiles.py)."""
    tests = Path(__file__).resolve().parent
    bare = re.compile(r"max_examples\s*=\s*\d")
    found = [f"{path.relative_to(tests)}:{n}"
             for path in sorted(tests.rglob("*.py"))
             if str(path.relative_to(tests)) not in FIXED_BUDGETS
             for n, line in enumerate(path.read_text().splitlines(), 1) if bare.search(line)]
    assert found == [], "use max_examples=examples(N) (sim.profiles): " + ", ".join(found)
