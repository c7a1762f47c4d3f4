"""Imports in envfleet flow one way.

Every module of the package is read with :mod:`ast` (nothing is imported), and every import in
it counts: at module level, inside functions and methods, and under ``if TYPE_CHECKING:`` (those
never run, but a circle through them is a circle in the design all the same, so they are not
left out). ``from package import name`` counts as an import of ``package.name`` when that is a
module, else of ``package``. Importing ``a.b.c`` also runs the ``__init__`` of ``a`` and
``a.b``; those implicit imports are not edges here (``envfleet/__init__.py`` imports the face
lazily, so every module would be in a circle with it), and each ``__init__`` is a module of its
own with its own imports.

The rules:

(a) no circles, function-level imports included;
(b) the backends depend one way, by family: ``contract`` ← ``local`` ← ``ray`` ← ``nodes``
    (a family imports only itself and those before it; ``envfleet.backends`` itself is the
    contract's re-exports), and the ``ray`` backend's chooser (``backends/ray_backend.py``) sits
    above ``ray`` and ``nodes``;
(c) no backend imports the face (the pool and what drives it, ``make()``, the command line,
    the benchmark engine): outside ``envfleet.backends`` a backend imports only the worker side
    and the plain figures of :data:`SHARED` (so a new module of the face is covered too);
(d) the worker side (what runs in a worker: ``envfleet.worker`` and everything it imports, and
    the other modules named in :data:`WORKER_SIDE`) imports neither the face nor a backend;
(e) only the node sub-pools themselves and the chooser import ``envfleet.backends.nodes``;
(f) the benchmark engine imports nothing of the command line, which sits on it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "envfleet"

FAMILIES = ("contract", "local", "ray", "nodes")
"""The backends' families, in the order they may depend on: each imports only those before it."""

CHOOSER = "envfleet.backends.ray_backend"
"""The ``ray`` backend's module, which picks one actor per worker or node sub-pools: above both."""

FACE = frozenset(
    {
        "envfleet",
        "envfleet._make",
        "envfleet.actions",
        "envfleet.caller_build",
        "envfleet.dispatch",
        "envfleet.episodes",
        "envfleet.exchange",
        "envfleet.gymnasium_async",
        "envfleet.ledger",
        "envfleet.lifecycle",
        "envfleet.make_checks",
        "envfleet.pool",
        "envfleet.pool_rollouts",
        "envfleet.recovery",
        "envfleet.registration",
        "envfleet.report",
        "envfleet.results",
        "envfleet.rollouts",
        "envfleet.sb3",
        "envfleet.tune",
    }
)
"""The pool and what builds and drives it; with every module under :data:`FACE_PACKAGES`."""

FACE_PACKAGES = ("envfleet.adapters", "envfleet.benchmark", "envfleet.cli")

SHARED = frozenset({"envfleet.stats"})
"""Modules of neither side that a backend may import: plain data the contract returns."""

WORKER_SIDE = (
    "envfleet.worker",
    "envfleet.group",
    "envfleet.threads",
    "envfleet.spec",
    "envfleet.legacy",
    "envfleet.protocol",
    "envfleet.rollout_loop",
    "envfleet.buffers",
    "envfleet.batch_rows",
    "envfleet.infos",
    "envfleet.errors",
    "envfleet.guards",
    "envfleet.validation",
    "envfleet.affinity",
)
"""What runs inside a worker, whatever the backend; with all they import, transitively."""


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` at ``line``."""

    source: str
    target: str
    line: int
    where: str  # "module level", "in a function", "TYPE_CHECKING"

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} (line {self.line}, {self.where})"


def module_names(package: Path) -> dict[str, Path]:
    """Every module of ``package`` by its dotted name (a package by its own name)."""
    root = package.parent
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Each import statement of ``tree`` with where it is."""

    def visit(node: ast.AST, where: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child, where
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from visit(ast.Module(body=[stmt], type_ignores=[]), "TYPE_CHECKING")
                for stmt in child.orelse:
                    yield from visit(ast.Module(body=[stmt], type_ignores=[]), where)
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                yield from visit(child, "in a function" if where == "module level" else where)
            else:
                yield from visit(child, where)

    yield from visit(tree, "module level")


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    if not is_package:
        parts.pop()
    parts = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
    return ".".join([*parts, node.module] if node.module else parts)


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """``name`` or its longest prefix that is a module of the package."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def import_graph(package: Path) -> dict[str, list[Edge]]:
    """The modules of ``package`` and, for each, its imports of the package's modules."""
    modules = module_names(package)
    graph: dict[str, list[Edge]] = {name: [] for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        for node, where in _imports(tree):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [_known(alias.name, modules) for alias in node.names]
            else:
                base = _base(name, path.name == "__init__.py", node)
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.append(full if full in modules else _known(base, modules))
            for target in dict.fromkeys(targets):
                if target is not None and target != name:
                    graph[name].append(Edge(name, target, node.lineno, where))
    return graph


def cycles(graph: dict[str, list[Edge]]) -> list[list[Edge]]:
    """One circle (as its edges) through each strongly connected set of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's, iteratively (no recursion limit to meet)
        work = [(v, iter(graph[v]))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, edges = work[-1]
            for edge in edges:
                w = edge.target
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(graph[w])))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == node:
                            break
                    components.append(component)

    for v in graph:
        if v not in index:
            connect(v)
    found = []
    for component in components:
        members = set(component)
        if len(members) < 2:
            continue
        start = min(members)
        # The shortest way from start back to itself within the component.
        paths: dict[str, list[Edge]] = {start: []}
        frontier = [start]
        circle: list[Edge] | None = None
        while frontier and circle is None:
            nxt = []
            for v in frontier:
                for edge in graph[v]:
                    if edge.target == start:
                        circle = [*paths[v], edge]
                        break
                    if edge.target in members and edge.target not in paths:
                        paths[edge.target] = [*paths[v], edge]
                        nxt.append(edge.target)
                if circle is not None:
                    break
            frontier = nxt
        assert circle is not None
        found.append(circle)
    return found


def family(module: str) -> int | None:
    """The rank of a backends module in the family order (``None``: not a backend)."""
    if module == "envfleet.backends":
        return 0  # the contract's re-exports
    if module == CHOOSER:
        return len(FAMILIES)
    for rank, name in enumerate(FAMILIES):
        prefix = f"envfleet.backends.{name}"
        if module == prefix or module.startswith(prefix + "."):
            return rank
    if module.startswith("envfleet.backends."):
        raise AssertionError(f"{module} is in no family of {FAMILIES}: put it in one")
    return None


def is_face(module: str) -> bool:
    return module in FACE or any(module == p or module.startswith(p + ".") for p in FACE_PACKAGES)


def upward(graph: dict[str, list[Edge]]) -> list[Edge]:
    """Backend imports that run back up the family order."""
    wrong = []
    for edges in graph.values():
        for edge in edges:
            source, target = family(edge.source), family(edge.target)
            if source is not None and target is not None and target > source:
                wrong.append(edge)
    return wrong


def worker_side(graph: dict[str, list[Edge]]) -> set[str]:
    """The modules of :data:`WORKER_SIDE` and every module they import, transitively."""
    seen = {m for m in WORKER_SIDE if m in graph}
    frontier = list(seen)
    while frontier:
        frontier = [e.target for v in frontier for e in graph[v] if e.target not in seen]
        seen.update(frontier)
    return seen


def backends_to_face(graph: dict[str, list[Edge]]) -> list[Edge]:
    """Backend imports of anything outside the backends but the worker side and SHARED."""
    allowed = worker_side(graph) | SHARED
    return [
        edge
        for edges in graph.values()
        for edge in edges
        if family(edge.source) is not None
        and family(edge.target) is None
        and (is_face(edge.target) or edge.target not in allowed)
    ]


def worker_side_leaks(graph: dict[str, list[Edge]]) -> list[list[Edge]]:
    """Per face or backend module the worker side reaches, the imports that reach it."""
    roots = [m for m in WORKER_SIDE if m in graph]
    how: dict[str, list[Edge]] = {m: [] for m in roots}
    frontier = list(roots)
    while frontier:
        nxt = []
        for v in frontier:
            for edge in graph[v]:
                if edge.target not in how:
                    how[edge.target] = [*how[v], edge]
                    nxt.append(edge.target)
        frontier = nxt
    return [
        path
        for module, path in how.items()
        if path and (is_face(module) or family(module) is not None)
    ]


def nodes_named_outside(graph: dict[str, list[Edge]]) -> list[Edge]:
    nodes = "envfleet.backends.nodes"
    return [
        edge
        for edges in graph.values()
        for edge in edges
        if (edge.target == nodes or edge.target.startswith(nodes + "."))
        and not (edge.source == nodes or edge.source.startswith(nodes + "."))
        and edge.source != CHOOSER
    ]


def engine_to_command_line(graph: dict[str, list[Edge]]) -> list[Edge]:
    return [
        edge
        for edges in graph.values()
        for edge in edges
        if edge.source.startswith("envfleet.benchmark")
        and (edge.target == "envfleet.cli" or edge.target.startswith("envfleet.cli."))
    ]


def _lines(items: list[Edge]) -> str:
    return "\n".join(f"  {item}" for item in items)


def _paths(items: list[list[Edge]]) -> str:
    return "\n".join("  " + " ; ".join(str(e) for e in path) for path in items)


@pytest.fixture(scope="module")
def graph() -> dict[str, list[Edge]]:
    return import_graph(PACKAGE)


def test_no_import_circles(graph: dict[str, list[Edge]]) -> None:
    found = cycles(graph)
    assert not found, "import circles:\n" + _paths(found)


def test_backends_depend_one_way_by_family(graph: dict[str, list[Edge]]) -> None:
    wrong = upward(graph)
    order = " <- ".join(FAMILIES)
    assert not wrong, f"imports back up the family order ({order} <- chooser):\n" + _lines(wrong)


def test_backends_never_import_the_face(graph: dict[str, list[Edge]]) -> None:
    wrong = backends_to_face(graph)
    assert not wrong, "backends importing the face:\n" + _lines(wrong)


def test_the_worker_side_imports_neither_face_nor_backends(
    graph: dict[str, list[Edge]],
) -> None:
    leaks = worker_side_leaks(graph)
    assert not leaks, "the worker side reaches the face or a backend:\n" + _paths(leaks)


def test_only_the_node_family_and_the_chooser_name_nodes(graph: dict[str, list[Edge]]) -> None:
    wrong = nodes_named_outside(graph)
    assert not wrong, "envfleet.backends.nodes imported from outside:\n" + _lines(wrong)


def test_the_benchmark_engine_never_imports_the_command_line(
    graph: dict[str, list[Edge]],
) -> None:
    wrong = engine_to_command_line(graph)
    assert not wrong, "envfleet.benchmark importing envfleet.cli:\n" + _lines(wrong)


def test_every_family_is_a_package(graph: dict[str, list[Edge]]) -> None:
    """Each family is a package, and every backends module sits in one (or is the chooser)."""
    for name in FAMILIES:
        assert f"envfleet.backends.{name}" in graph
    for module in graph:
        family(module)  # raises for a module in no family


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "envfleet"


def test_the_checks_catch_what_they_forbid(tmp_path: Path) -> None:
    """The checks themselves, on a made-up package that breaks each rule once."""
    package = _write(
        tmp_path,
        {
            "envfleet/__init__.py": "",
            "envfleet/pool.py": "from envfleet.backends import Transport\n",
            "envfleet/worker.py": "from envfleet import protocol\n",
            "envfleet/protocol.py": "def run():\n    from envfleet.rollout_loop import sample\n",
            "envfleet/rollout_loop.py": "import envfleet.protocol\n",
            "envfleet/stats.py": "from envfleet.backends.nodes.agent import Agent\n",
            "envfleet/exchange.py": "",
            "envfleet/benchmark/__init__.py": "",
            "envfleet/benchmark/measure.py": "from envfleet.cli.common import clock\n",
            "envfleet/cli/__init__.py": "",
            "envfleet/cli/common.py": "",
            "envfleet/backends/__init__.py": "from .contract.base import Transport\n",
            "envfleet/backends/contract/__init__.py": "",
            "envfleet/backends/contract/base.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from envfleet.backends.contract.spares import Spares\n"
            ),
            "envfleet/backends/contract/spares.py": "from . import base\n",
            "envfleet/backends/local/__init__.py": "",
            "envfleet/backends/local/process.py": (
                "from envfleet.backends.ray import session\nimport envfleet.pool\n"
                "from envfleet import exchange\n"
            ),
            "envfleet/backends/ray/__init__.py": "",
            "envfleet/backends/ray/session.py": "",
            "envfleet/backends/nodes/__init__.py": "",
            "envfleet/backends/nodes/agent.py": "from envfleet.backends.local import process\n",
        },
    )
    made = import_graph(package)
    circles = {frozenset(e.source for e in circle) for circle in cycles(made)}
    assert circles == {
        frozenset({"envfleet.protocol", "envfleet.rollout_loop"}),
        frozenset({"envfleet.backends.contract.base", "envfleet.backends.contract.spares"}),
    }
    assert [str(e) for e in upward(made)] == [
        "envfleet.backends.local.process -> envfleet.backends.ray.session (line 1, module level)"
    ]
    assert [e.target for e in backends_to_face(made)] == ["envfleet.pool", "envfleet.exchange"]
    leaks = worker_side_leaks(made)
    assert not leaks  # protocol and rollout_loop import no backend
    assert [e.source for e in nodes_named_outside(made)] == ["envfleet.stats"]
    assert [e.target for e in engine_to_command_line(made)] == ["envfleet.cli.common"]
    made["envfleet.rollout_loop"].append(Edge("envfleet.rollout_loop", "envfleet.pool", 1, "x"))
    reached = {path[-1].target for path in worker_side_leaks(made)}
    assert "envfleet.pool" in reached and "envfleet.backends.contract.base" in reached
