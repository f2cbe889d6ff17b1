"""Loading installed plugins (the `p4bench` entry points) and the commands plugins add:
a plugin that fails becomes a `PluginProblem` of the manager, never a dead command line."""

from __future__ import annotations

import importlib.metadata
import warnings
from typing import Any

import pluggy

from p4bench.host.types import PluginManager, PluginProblem, PluginSource, source_of

__all__ = [
    "ENTRY_POINT_GROUP",
    "add_plugin_commands",
    "import_deprecations",
    "load_entry_points",
    "one_line",
]

ENTRY_POINT_GROUP = "p4bench"
# distribution -> the deprecated API its modules used while they were imported, as
# (file, line, message): a module is imported once per process, later managers only see it
_IMPORT_DEPRECATIONS: dict[str, list[tuple[str, int, str]]] = {}


def import_deprecations(distribution: str) -> list[tuple[str, int, str]]:
    """(file, line, message) of each deprecated path or call a distribution's plugin
    modules met while being imported in this process (`p4bench check-plugin` lists them)."""
    return list(_IMPORT_DEPRECATIONS.get(distribution, ()))


def _load(ep: importlib.metadata.EntryPoint, distribution: str) -> Any:
    """`ep.load()`, keeping the deprecation warnings it raises for `import_deprecations`;
    they are then issued again as they were, for the command line to show."""
    from p4bench.errors import PluginDeprecationWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PluginDeprecationWarning)
        try:
            return ep.load()
        finally:
            deprecations = [w for w in caught if issubclass(w.category, PluginDeprecationWarning)]
            _IMPORT_DEPRECATIONS.setdefault(distribution, []).extend(
                (w.filename, w.lineno, str(w.message)) for w in deprecations
            )
            others = [w for w in caught if w not in deprecations]
            for w in [*deprecations, *others]:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


def load_entry_points(
    pm: PluginManager, group: str = ENTRY_POINT_GROUP, *, only_distribution: str | None = None
) -> None:
    """Register every installed plugin of `group` (of one distribution, if named), one entry
    point at a time: one that fails to import or register becomes a problem of `pm` and the
    others still load. p4bench's own come first: no installed plugin can take their names."""
    points = [(_distribution(ep), ep) for ep in importlib.metadata.entry_points(group=group)]
    points.sort(key=lambda point: point[0] != "p4bench")  # stable: the rest keep their order
    for distribution, ep in points:
        if only_distribution is not None and distribution != only_distribution:
            continue
        dist = ep.dist
        version = dist.version if dist is not None else ""
        if pm.get_plugin(ep.name) is not None or pm.is_blocked(ep.name):
            pm.problems.append(
                PluginProblem(
                    distribution,
                    version,
                    "plugin",
                    None,
                    f"entry point '{ep.name}' is skipped: a plugin of that name is registered",
                )
            )
            continue
        try:
            plugin = _load(ep, distribution)
            if pm.is_registered(plugin):
                continue  # a second entry point to the same module
            name = pm.register(plugin, name=ep.name)
        except Exception as exc:  # a broken plugin must not take the others down
            if distribution == "p4bench":
                raise
            pm.problems.append(
                PluginProblem(
                    distribution,
                    version,
                    "plugin",
                    None,
                    f"cannot be loaded (entry point '{ep.name} = {ep.value}'): {one_line(exc)}",
                )
            )
            continue
        if name is not None:
            pm.sources[name] = PluginSource(distribution, version, strict=distribution == "p4bench")


def _distribution(ep: importlib.metadata.EntryPoint) -> str:
    dist = ep.dist
    return (dist.metadata["Name"] or ep.module) if dist is not None else ep.module


def add_plugin_commands(pm: pluggy.PluginManager, app: Any) -> None:
    """Call every `register_commands` implementation; an installed plugin's failure
    becomes a problem of `pm` instead of breaking every command."""
    for impl in pm.hook.register_commands.get_hookimpls():
        if impl.hookwrapper or impl.wrapper:
            continue
        source = source_of(pm, impl.plugin_name)
        try:
            impl.function(**{arg: app for arg in impl.argnames})
        except Exception as exc:
            problems = getattr(pm, "problems", None)
            if source.strict or not isinstance(problems, list):
                raise
            problem = PluginProblem(
                source.distribution,
                source.version,
                "command",
                None,
                f"register_commands raised {one_line(exc)}",
            )
            if problem not in problems:  # the app may be built more than once per manager
                problems.append(problem)


def one_line(exc: BaseException) -> str:
    """The exception's type and first line, and where in the plugin it was raised."""
    import traceback

    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    line = f"{type(exc).__name__}: {first[:300]}" if first else type(exc).__name__
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    if frames and "importlib" not in frames[-1].filename:
        line += f" (at {frames[-1].filename}:{frames[-1].lineno})"
    return line
