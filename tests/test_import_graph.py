"""Settled layers: the import graph of p4bench and its shipped plugin packages.

Every ``import`` counts, wherever it stands: at the top, inside functions (lazy imports)
and under ``if TYPE_CHECKING:``. A lazy import only hides a cycle from the interpreter,
not from the reader, so the graph must be acyclic as written.

Rules:

- no cycles;
- no internal module imports the root facade ``p4bench`` (``from p4bench import hookimpl``):
  internal code imports from the defining module, so the facade stays on top;
- the engine, the privacy package, ``records`` and ``hookspecs`` never import the run
  driver, trackers, studies or the command line, directly or through other modules;
- typer is imported only by command modules: ``p4bench/cli/`` and a plugin package's ``cli.py``.
"""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FACADE = "p4bench"
LOW_LAYERS = ("p4bench.engine", "p4bench.privacy", "p4bench.records", "p4bench.hookspecs")
HIGH_LAYERS = ("p4bench.run", "p4bench.cli", "p4bench.tracking.tracker", "p4bench.studies")


@dataclass(frozen=True)
class Import:
    """One import statement's target inside the package."""

    importer: str
    target: str  # the module (or package) that is executed by the import
    line: int
    type_checking: bool  # under `if TYPE_CHECKING:`: never executed, still a dependency
    facade: bool  # names something of the root package's __init__, not a submodule


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module shipped (pyproject's source roots: a path below
    a root is its import name)."""
    roots = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"][
        "find"
    ]["where"]
    modules: dict[str, Path] = {}
    for root in roots:
        base = ROOT / root
        for path in sorted(base.glob("p4bench*/**/*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Collector(ast.NodeVisitor):
    """Every import of a module, with whether it sits under `if TYPE_CHECKING:`."""

    def __init__(self, name: str, is_package: bool) -> None:
        self.name, self.is_package = name, is_package
        self.found: list[
            tuple[str, str | None, int, bool]
        ] = []  # (module, imported name, line, type-checking)
        self._type_checking = 0

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            self._type_checking += 1
            for child in node.body:
                self.visit(child)
            self._type_checking -= 1
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.found.append((alias.name, None, node.lineno, bool(self._type_checking)))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level:  # relative: resolved against this module's package
            base = self.name if self.is_package else self.name.rpartition(".")[0]
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            module = f"{base}.{module}" if module else base
        for alias in node.names:
            self.found.append((module, alias.name, node.lineno, bool(self._type_checking)))


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The shipped module that `import name` executes last (its longest known prefix)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(modules: dict[str, Path]) -> list[Import]:
    found: list[Import] = []
    for name, path in modules.items():
        collector = _Collector(name, path.name == "__init__.py")
        collector.visit(ast.parse(path.read_text(), str(path)))
        for module, imported, line, type_checking in collector.found:
            if module.split(".")[0] != FACADE:
                continue
            full = f"{module}.{imported}" if imported else module
            target = _resolve(full, modules) if full in modules else _resolve(module, modules)
            if target is None or target == name:
                continue
            # `import p4bench` or `from p4bench import x` with x not a submodule
            facade = target == FACADE and (imported is None or full not in modules)
            found.append(Import(name, target, line, type_checking, facade))
    return found


MODULES = _modules()
IMPORTS = _imports(MODULES)


def _graph() -> dict[str, dict[str, Import]]:
    graph: dict[str, dict[str, Import]] = {name: {} for name in MODULES}
    for imp in IMPORTS:
        graph[imp.importer].setdefault(imp.target, imp)
    return graph


def _strongly_connected(graph: dict[str, dict[str, Import]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
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
                    components.append(sorted(component))
    return components


def _shortest_cycle(graph: dict[str, dict[str, Import]], component: list[str]) -> list[Import]:
    """One shortest cycle through the component's first module, as its import edges."""
    members, start = set(component), component[0]
    previous: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target, imp in sorted(graph[node].items()):
                if target not in members or target in previous:
                    continue
                previous[target] = imp
                if target == start:
                    path, current = [], start
                    while True:
                        edge = previous[current]
                        path.append(edge)
                        current = edge.importer
                        if current == start:
                            return path[::-1]
                following.append(target)
        frontier = following
    return []


def _where(imp: Import) -> str:
    path = MODULES[imp.importer].relative_to(ROOT)
    how = " (TYPE_CHECKING)" if imp.type_checking else ""
    return f"{imp.importer} ({path}:{imp.line}{how}) -> {imp.target}"


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_graph_covers_the_shipped_packages():
    assert {
        "p4bench.run.runner",
        "p4bench.hookspecs",
        "p4bench.cli",
        "p4bench_p4",
        "p4bench_baselines",
    } <= set(MODULES)
    assert any(imp.type_checking for imp in IMPORTS)  # annotation-only imports are counted


def test_no_import_cycles():
    graph = _graph()
    components = _strongly_connected(graph)
    report = []
    for component in components:
        cycle = _shortest_cycle(graph, component)
        report.append(
            f"{len(component)} modules in a cycle: {', '.join(component)}\n  e.g. "
            + "\n     ".join(_where(imp) for imp in cycle)
        )
    print("\n".join(report))
    assert not components, "import cycles:\n" + "\n".join(report)


def test_no_internal_module_imports_the_root_facade():
    offenders = [_where(imp) for imp in IMPORTS if imp.facade]
    assert not offenders, "import from the defining module instead of `p4bench`:\n" + "\n".join(
        offenders
    )


def _path_to(
    graph: dict[str, dict[str, Import]], start: str, wanted: tuple[str, ...]
) -> list[Import]:
    """The import chain from `start` to the nearest module under `wanted`, if any."""
    previous: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target, imp in sorted(graph[node].items()):
                if target in previous or target == start:
                    continue
                previous[target] = imp
                if _under(target, wanted):
                    path = [imp]
                    while path[-1].importer != start:
                        path.append(previous[path[-1].importer])
                    return path[::-1]
                following.append(target)
        frontier = following
    return []


def test_low_layers_never_import_the_driver_or_the_command_line():
    """Not even through other modules: the chain is printed."""
    graph = _graph()
    chains = [
        _path_to(graph, name, HIGH_LAYERS) for name in sorted(MODULES) if _under(name, LOW_LAYERS)
    ]
    report = ["\n  ".join(_where(imp) for imp in chain) for chain in chains if chain]
    assert not report, "\n".join(report)


def test_typer_only_in_command_modules():
    offenders = []
    for name, path in MODULES.items():
        parts = name.split(".")
        if _under(name, ("p4bench.cli",)) or (
            parts[0].startswith("p4bench_") and parts[-1] == "cli"
        ):
            continue
        collector = _Collector(name, path.name == "__init__.py")
        collector.visit(ast.parse(path.read_text()))
        # annotation-only imports (hookspecs names `typer.Typer`) do not load typer
        offenders += [
            f"{path.relative_to(ROOT)}:{line}"
            for module, _, line, type_checking in collector.found
            if module.split(".")[0] == "typer" and not type_checking
        ]
    assert not offenders, (
        "typer outside command modules (they belong in p4bench/cli/):\n" + "\n".join(offenders)
    )
