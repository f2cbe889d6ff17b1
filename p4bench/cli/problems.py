"""The problems of installed plugins, printed once per process as one yellow line each
(by `list` and `describe`, the commands that show plugins)."""

from __future__ import annotations

import weakref
from typing import Any

from rich.console import Console

__all__ = ["warn_plugin_problems", "warn_listed_problems"]

err_console = Console(stderr=True)
_warned: weakref.WeakSet[Any] = weakref.WeakSet()  # registries whose problems were printed
_listings_warned: set[tuple[str, int]] = (
    set()
)  # (plugin fingerprint, registry generation) already warned


def warn_plugin_problems() -> None:
    """Print each problem of an installed plugin as one yellow line on stderr, once per
    process (once per registry: tests that reset the registry see them again)."""
    from rich.markup import escape

    from p4bench.host.manager import default_registry

    registry = default_registry()
    if registry in _warned:
        return
    _warned.add(registry)
    for problem in registry.problems:
        err_console.print(
            f"[yellow]warning:[/yellow] {escape(problem.line())}", highlight=False, soft_wrap=True
        )


def warn_listed_problems(problems: list[dict[str, Any]], fingerprint: str) -> None:
    """`warn_plugin_problems` for a cached listing's problems (`p4bench.cli.plugin_cache`):
    the same lines, once per process and set of plugins (again after `reset_default`)."""
    from rich.markup import escape

    from p4bench.host.manager import PluginProblem, registry_generation

    key = (fingerprint, registry_generation())
    if key in _listings_warned:
        return
    _listings_warned.add(key)
    for problem in problems:
        line = PluginProblem(**problem).line()
        err_console.print(
            f"[yellow]warning:[/yellow] {escape(line)}", highlight=False, soft_wrap=True
        )
