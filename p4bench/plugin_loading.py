"""Loading installed plugins (the `p4bench` entry points) and the commands plugins add:
a plugin that fails becomes a `PluginProblem` of the manager, never a dead command line."""

from __future__ import annotations

import importlib.metadata
from typing import Any

import pluggy

from p4bench.plugin_types import PluginManager, PluginProblem, PluginSource, source_of

__all__ = ["ENTRY_POINT_GROUP", "add_plugin_commands", "load_entry_points", "one_line"]

ENTRY_POINT_GROUP = "p4bench"


def load_entry_points(pm: PluginManager, group: str = ENTRY_POINT_GROUP) -> None:
    """Register every installed plugin of `group`, one entry point at a time: one that
    fails to import or register becomes a problem of `pm` and the others still load."""
    for ep in importlib.metadata.entry_points(group=group):
        dist = ep.dist
        distribution = (dist.metadata["Name"] or ep.module) if dist is not None else ep.module
        version = dist.version if dist is not None else ""
        if pm.get_plugin(ep.name) is not None or pm.is_blocked(ep.name):
            pm.problems.append(PluginProblem(distribution, version, "plugin", None,
                                             f"entry point '{ep.name}' is skipped: a plugin of that name is registered"))
            continue
        try:
            plugin = ep.load()
            if pm.is_registered(plugin):
                continue  # a second entry point to the same module
            name = pm.register(plugin, name=ep.name)
        except Exception as exc:  # a broken plugin must not take the others down
            if distribution == "p4bench":
                raise
            pm.problems.append(PluginProblem(distribution, version, "plugin", None,
                                             f"cannot be loaded (entry point '{ep.name} = {ep.value}'): {one_line(exc)}"))
            continue
        if name is not None:
            pm.sources[name] = PluginSource(distribution, version, strict=distribution == "p4bench")


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
            problem = PluginProblem(source.distribution, source.version, "command", None,
                                    f"register_commands raised {one_line(exc)}")
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
