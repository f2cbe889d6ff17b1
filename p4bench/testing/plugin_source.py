"""What a plugin package's source shows (`p4bench check-plugin DIST`), read statically (the
modules' syntax trees, every line, whatever a run reaches):

- **internal imports**: each `import`/`from ... import` of a p4bench module other than
  `p4bench.api` (the root package, `p4bench.engine.*`, `p4bench.options`, ...) or of a
  built-in plugin package (`p4bench_baselines`, ...): internal, free to change in any
  release (`p4bench.api`'s stability rule). The line says which of the imported names
  `p4bench.api` has.
- **undeclared options**: each option a plugin reads under a literal key that it does not
  declare: `X.options.get("key")`, `X.options["key"]`, `"key" in X.options` (the run's
  `config.options`, a 0.1 topology's `self.options`), `.option_values[...]`, the result of
  `resolve_options(...)` read the same ways, a local name bound to one of these, and 0.1's
  `self._option("key", ...)`. A read inside a registered plugin class is checked against
  that class's declarations (inherited ones included); elsewhere in the package, against
  every declaration of the package's plugins. Keys computed at run time are not seen.

Each finding is one line naming the file and line.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["internal_imports", "package_files", "source_findings", "undeclared_reads"]

PUBLIC = "p4bench.api"
OPTION_MAPPINGS = ("options", "option_values")  # attributes that hold option values by key


def package_files(packages: Iterable[str]) -> list[Path]:
    """The .py files of the top-level packages (or modules) `packages`, found where they
    would be imported from."""
    files: set[Path] = set()
    for package in packages:
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            continue
        if spec is None:
            continue
        if spec.submodule_search_locations:
            for folder in spec.submodule_search_locations:
                files.update(p for p in Path(folder).rglob("*.py") if "__pycache__" not in p.parts)
        elif spec.origin and spec.origin.endswith(".py"):
            files.add(Path(spec.origin))
    return sorted(files)


def _internal(module: str, builtin_packages: Iterable[str]) -> bool:
    top = module.split(".")[0]
    if top == "p4bench":
        return module != PUBLIC
    return top in builtin_packages


def internal_imports(
    path: Path, tree: ast.AST, builtin_packages: Iterable[str], public_names: Iterable[str]
) -> list[str]:
    """One line per import of an internal module in `tree` (the file `path`)."""
    public = set(public_names)
    lines: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        found: list[tuple[str, list[str]]] = []
        lineno = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            found = [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [alias.name for alias in node.names]
            if node.module == "p4bench" and names == ["api"]:
                continue  # `from p4bench import api`
            found = [(node.module, names)]
        for module, names in found:
            if not _internal(module, builtin_packages):
                continue
            has = [n for n in names if n in public]
            hint = (
                f"; p4bench.api has {', '.join(has)}"
                if has
                else "; p4bench.api has none of its names"
                if names
                else ""
            )
            lines.append(
                (
                    lineno,
                    f"internal import at {path}:{lineno}: {module} "
                    f"(import only p4bench.api; anything else may change in any release{hint})",
                )
            )
    return [line for _, line in sorted(lines)]


def _is_option_mapping(node: ast.AST, bound: set[str]) -> bool:
    """Whether `node` evaluates to options by key: `X.options`, `X.option_values`, a
    `resolve_options(...)` call, or a local name bound to one of those."""
    if isinstance(node, ast.Attribute):
        return node.attr in OPTION_MAPPINGS
    if isinstance(node, ast.Name):
        return node.id in bound
    if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return name == "resolve_options"
    return False


def _literal(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _reads(function: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, key) of each option read with a literal key in `function`'s body."""
    bound: set[str] = set()
    for node in ast.walk(function):  # names bound to option mappings, anywhere in the body
        if isinstance(node, ast.Assign) and _is_option_mapping(node.value, bound):
            bound.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            if isinstance(node.target, ast.Name) and _is_option_mapping(node.value, bound):
                bound.add(node.target.id)
    for node in ast.walk(function):
        key = None
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            key = _literal(node.slice) if _is_option_mapping(node.value, bound) else None
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            target, attr = node.func.value, node.func.attr
            if attr == "get" and _is_option_mapping(target, bound):
                key = _literal(node.args[0])
            elif attr == "_option" and isinstance(target, ast.Name) and target.id == "self":
                key = _literal(node.args[0])
        elif isinstance(node, ast.Compare) and len(node.ops) == 1:
            if isinstance(node.ops[0], ast.In | ast.NotIn):
                if _is_option_mapping(node.comparators[0], bound):
                    key = _literal(node.left)
        if key is not None:
            yield getattr(node, "lineno", 0), key


def _functions(tree: ast.AST) -> Iterator[tuple[str | None, ast.AST]]:
    """(enclosing class's qualified name or None, function) for every function."""

    def walk(node: ast.AST, owner: str | None, prefix: str) -> Iterator[tuple[str | None, ast.AST]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}", f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                yield owner, child  # nested functions are part of this one's walk
            else:
                yield from walk(child, owner, prefix)

    yield from walk(tree, None, "")


def undeclared_reads(
    path: Path,
    tree: ast.AST,
    module: str,
    plugins: dict[tuple[str, str], Any],
    everything: set[str],
) -> list[str]:
    """One line per option read in `tree` (the module `module`, file `path`) that is not
    declared: by the registered plugin class it is read in (`plugins`: (module, qualname)
    -> (kind, name, declared names)), elsewhere by any plugin of the package (`everything`)."""
    lines, seen = [], set()
    for owner, function in _functions(tree):
        plugin = plugins.get((module, owner)) if owner else None
        declared = plugin[2] if plugin else everything
        for lineno, key in sorted(_reads(function)):
            if key in declared or (lineno, key) in seen:
                continue
            seen.add((lineno, key))
            who = f"{plugin[0]} '{plugin[1]}'" if plugin else f"{owner or module}"
            fix = f"declare it in {owner}.options" if plugin else "declare it in a plugin's options"
            lines.append(
                f"undeclared option at {path}:{lineno}: {who} reads '{key}' without declaring "
                f"it ({fix} with p4bench.api.Option; undeclared options are refused from 0.3)"
            )
    return lines


def _module_name(path: Path, packages: Iterable[str]) -> str:
    """The import name of the file `path` inside one of the top-level `packages`."""
    parts = list(path.with_suffix("").parts)
    for index in range(len(parts) - 1, -1, -1):
        if parts[index] in packages:
            names = parts[index:]
            return ".".join(names[:-1] if names[-1] == "__init__" else names)
    return path.stem


def source_findings(distribution: str, plugin_manager: Any, registry: Any) -> list[str]:
    """Internal imports and undeclared option reads in the packages of `distribution`: those
    its entry points load (plugins of `plugin_manager`) and those defining the classes it
    registers (in `registry`)."""
    from p4bench import api
    from p4bench.host.manager import BUILTIN_PLUGINS, KINDS
    from p4bench.options import declared_options

    entries = [
        e for kind in KINDS for e in registry.entries(kind) if e.distribution == distribution
    ]
    sources = getattr(plugin_manager, "sources", {})
    loaded = [
        plugin_manager.get_plugin(n) for n, s in sources.items() if s.distribution == distribution
    ]
    packages = {str(getattr(m, "__name__", "")).split(".")[0] for m in loaded} - {""}
    packages |= {e.cls.__module__.split(".")[0] for e in entries}
    packages -= {"p4bench", *BUILTIN_PLUGINS.values()}
    plugins = {
        (e.cls.__module__, e.cls.__qualname__): (
            e.kind,
            e.name,
            {o.name for o in declared_options(e.cls)},
        )
        for e in entries
    }
    everything: set[str] = set().union(*(declared for _, _, declared in plugins.values()))
    lines = []
    for path in package_files(sorted(packages)):
        try:
            tree = ast.parse(path.read_text(), filename=str(path))
        except (OSError, SyntaxError, UnicodeDecodeError) as exc:
            lines.append(f"source at {path}: cannot be read ({type(exc).__name__})")
            continue
        lines += internal_imports(path, tree, BUILTIN_PLUGINS.values(), api.__all__)
        module = _module_name(path, packages)
        lines += undeclared_reads(path, tree, module, plugins, everything)
    return lines
