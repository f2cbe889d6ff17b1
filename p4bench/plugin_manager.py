"""Builds the pluggy plugin manager and the per-kind registries of named plugins."""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass
from functools import lru_cache
from types import ModuleType
from typing import Any

import pluggy

from p4bench import hookspecs
from p4bench.errors import DuplicateNameError, UnknownNameError

DISABLE_AUTOLOAD_ENV = "P4BENCH_DISABLE_PLUGIN_AUTOLOAD"
ENTRY_POINT_GROUP = "p4bench"

# kind -> registration hook; the kind is what users see in `p4bench list` and errors.
KINDS: dict[str, str] = {
    "method": "register_methods",
    "attack": "register_attacks",
    "defense": "register_defenses",
    "dataset": "register_datasets",
    "partitioner": "register_partitioners",
    "model": "register_models",
    "topology": "register_topologies",
    "accountant": "register_accountants",
    "runtime": "register_runtimes",
}

BUILTIN_MODULES = (
    "p4bench.data.builtin",
    "p4bench.models",
    "p4bench.engine.runtimes",
    "p4bench.baselines",
    "p4bench.plugins.p4",
    "p4bench.plugins.device",  # the device runtime and `p4bench device` commands
    "p4bench.attacks",
    "p4bench.defenses",
    "p4bench.impact",  # `p4bench impact`: attack impact and ideal-defense gap from MLflow
    "p4bench.privacy.builtin",
    "p4bench.audit.builtin",  # `p4bench audit`: empirical privacy audit with canaries
    "p4bench.topology.builtin",
    "p4bench.sweep",  # sweep / tune / compare / reproduce commands
)


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
        return str(getattr(self.cls, "description", "") or (self.cls.__doc__ or "").strip().split("\n")[0])


class Registry:
    """Named plugin classes of every kind, built from the registration hooks."""

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self.pm = pm
        self._entries: dict[str, dict[str, Entry]] = {kind: {} for kind in KINDS}
        sources = _plugin_sources(pm)
        for kind, hook_name in KINDS.items():
            for impl in getattr(pm.hook, hook_name).get_hookimpls():
                distribution, version = sources.get(id(impl.plugin), ("unknown", ""))
                for cls in impl.function() or []:
                    self._add(Entry(_name_of(cls, kind), kind, cls, distribution, version), impl.plugin_name)

    def _add(self, entry: Entry, plugin_name: str) -> None:
        existing = self._entries[entry.kind].get(entry.name)
        if existing is not None:
            raise DuplicateNameError(
                f"{entry.kind} '{entry.name}' is registered twice: by {existing.cls.__module__}."
                f"{existing.cls.__qualname__} ({existing.distribution}) and by {entry.cls.__module__}."
                f"{entry.cls.__qualname__} ({entry.distribution}, plugin '{plugin_name}')"
            )
        self._entries[entry.kind][entry.name] = entry

    def names(self, kind: str) -> list[str]:
        return sorted(self._entries[kind])

    def entries(self, kind: str) -> list[Entry]:
        return [self._entries[kind][name] for name in self.names(kind)]

    def get(self, kind: str, name: str) -> type:
        """The class registered as `name`, or an error listing the registered names."""
        try:
            return self._entries[kind][name].cls
        except KeyError:
            raise UnknownNameError(kind, name, self._entries[kind]) from None

    def as_dict(self) -> dict[str, list[dict[str, str]]]:
        return {
            kind: [
                {"name": e.name, "distribution": e.distribution, "version": e.version, "description": e.description}
                for e in self.entries(kind)
            ]
            for kind in KINDS
        }


def _name_of(cls: type, kind: str) -> str:
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{kind} class {cls.__module__}.{cls.__qualname__} has no string attribute 'name'")
    return name


def _plugin_sources(pm: pluggy.PluginManager) -> dict[int, tuple[str, str]]:
    """Map each registered plugin object to (distribution, version)."""
    own = ("p4bench", _own_version())
    sources = {id(plugin): own for plugin in pm.get_plugins()}
    for plugin, dist in pm.list_plugin_distinfo():
        sources[id(plugin)] = (dist.metadata["name"], dist.version)
    return sources


def _own_version() -> str:
    try:
        return importlib.metadata.version("p4bench")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def create_plugin_manager(extra_plugins: tuple[Any, ...] = (), autoload: bool | None = None) -> pluggy.PluginManager:
    """A plugin manager with the built-ins, entry-point plugins (unless disabled) and extras.

    Autoloading of third-party plugins is skipped when the environment variable
    ``P4BENCH_DISABLE_PLUGIN_AUTOLOAD`` is set to a non-empty value, or `autoload` is False.
    """
    pm = pluggy.PluginManager("p4bench")
    pm.add_hookspecs(hookspecs)
    for module_name in BUILTIN_MODULES:
        module: ModuleType = __import__(module_name, fromlist=["_"])
        pm.register(module, name=module_name)
    if autoload is None:
        autoload = not os.environ.get(DISABLE_AUTOLOAD_ENV)
    if autoload:
        pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    for plugin in extra_plugins:
        pm.register(plugin)
    return pm


@lru_cache(maxsize=1)
def _default() -> tuple[pluggy.PluginManager, Registry]:
    pm = create_plugin_manager()
    return pm, Registry(pm)


def default_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager (built once, on first use)."""
    return _default()[0]


def default_registry() -> Registry:
    """The process-wide registry (built once, on first use)."""
    return _default()[1]


def reset_default() -> None:
    """Forget the process-wide registry (tests that install plugins call this)."""
    _default.cache_clear()
