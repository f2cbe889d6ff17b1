"""What the plugin host records about plugins: each registered class (`Entry`), where a
plugin comes from (`PluginSource`) and what went wrong with an installed one
(`PluginProblem`), kept by the `PluginManager`."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from functools import lru_cache

import pluggy

__all__ = ["Entry", "PluginManager", "PluginProblem", "PluginSource", "own_version", "source_of"]


@dataclass(frozen=True)
class Entry:
    """One registered plugin class and where it came from."""

    name: str
    kind: str
    cls: type
    distribution: str
    version: str

    @property
    def description(self) -> str:
        return str(
            getattr(self.cls, "description", "") or (self.cls.__doc__ or "").strip().split("\n")[0]
        )

    @property
    def qualname(self) -> str:
        return f"{self.cls.__module__}.{self.cls.__qualname__}"


@dataclass(frozen=True)
class PluginProblem:
    """Why (part of) a third-party plugin is not used; `name` is the plugin name concerned, if any."""

    distribution: str
    version: str
    kind: str  # a KINDS key, or "plugin" (loading) / "command" (register_commands) / "hook" (an unknown hook)
    name: str | None
    message: str

    def line(self) -> str:
        """One line for users: `plugin <distribution> <version>: <message>`."""
        return f"plugin {self.distribution} {self.version}: {self.message}"


@dataclass(frozen=True)
class PluginSource:
    """Where a registered plugin object comes from. `strict` sources (p4bench itself and
    plugins passed in code) raise on a bad registration; installed ones are reported."""

    distribution: str
    version: str
    strict: bool


class PluginManager(pluggy.PluginManager):
    """A pluggy manager that remembers each plugin's distribution and the problems met
    while loading installed plugins."""

    def __init__(self) -> None:
        super().__init__("p4bench")
        self.sources: dict[str, PluginSource] = {}
        self.problems: list[PluginProblem] = []


def source_of(pm: pluggy.PluginManager, plugin_name: str) -> PluginSource:
    """The source of a registered plugin; p4bench itself where the manager does not know."""
    sources: dict[str, PluginSource] = getattr(pm, "sources", {})
    return sources.get(plugin_name) or PluginSource("p4bench", own_version(), strict=True)


@lru_cache(maxsize=1)
def own_version() -> str:
    try:
        return importlib.metadata.version("p4bench")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"
