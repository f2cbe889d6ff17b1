"""Builds the pluggy plugin manager and the per-kind registries of named plugins."""

from __future__ import annotations

import os
from dataclasses import asdict
from functools import lru_cache
from types import ModuleType
from typing import Any

import pluggy

from p4bench import hookspecs, topology
from p4bench.errors import DuplicateNameError, P4BenchError, PluginError, UnknownNameError
from p4bench.host.loading import ENTRY_POINT_GROUP, add_plugin_commands, load_entry_points, one_line
from p4bench.host.types import (
    Entry,
    PluginManager,
    PluginProblem,
    PluginSource,
    own_version,
    source_of,
)

__all__ = [  # Entry ... source_of and the loading functions are re-exported: they were defined here
    "BUILTIN_MODULES",
    "BUILTIN_PLUGINS",
    "DISABLE_AUTOLOAD_ENV",
    "ENTRY_POINT_GROUP",
    "KINDS",
    "Entry",
    "PluginManager",
    "PluginProblem",
    "PluginSource",
    "Registry",
    "add_plugin_commands",
    "create_plugin_manager",
    "default_built",
    "default_plugin_manager",
    "default_registry",
    "load_entry_points",
    "registry_generation",
    "reset_default",
    "source_of",
]

DISABLE_AUTOLOAD_ENV = "P4BENCH_DISABLE_PLUGIN_AUTOLOAD"

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

# The host's own hook implementations (data, models, runtimes, privacy, topology, commands),
# registered like installed plugins. They import their classes inside the hooks (and their
# packages re-export names lazily, `p4bench.lazy`), so building the manager costs no torch, scipy
# or MLflow: the command line builds it on every start, `p4bench --help` included.
BUILTIN_MODULES = (
    "p4bench.data.builtin",
    "p4bench.models.builtin",  # linear, scatter-cnn, cnn (cnn-gray: p4bench_p2p_fl)
    "p4bench.engine.runtimes",
    "p4bench.privacy.builtin",
    "p4bench.topology.builtin",
    "p4bench.cli.builtin",  # data, privacy, topology, audit, impact, sweep/tune/compare/reproduce commands
)

# The plugin folders' packages (entry point name -> package): p4bench's own `p4bench` entry
# points, loaded as an outside plugin package's are, and even where autoloading is disabled.
BUILTIN_PLUGINS: dict[str, str] = {
    "p4": "p4bench_p4",
    "p4l": "p4bench_p4l",
    "pdsl": "p4bench_pdsl",
    "p2p-fl": "p4bench_p2p_fl",
    "device": "p4bench_device",
    "baselines": "p4bench_baselines",
    "attacks": "p4bench_attacks",
    "defenses": "p4bench_defenses",
}


class Registry:
    """Named plugin classes of every kind, built from the registration hooks.

    A bad registration of an installed plugin (hook raises or returns no list, an entry
    that is no class of its kind or has no name, a name taken twice) never stops the
    others: it becomes a `PluginProblem`, and only using the name concerned fails (exit
    code 2). Built-in registrations and plugins passed in code still raise: a bug.

    A `lazy` registry calls the hooks on first use instead of at once: the command line
    keeps one per process, and `p4bench --help` never calls them (the built-in classes
    import torch). Its `problems` need no hook call while no installed plugin is
    registered: only those report problems (a strict source raises instead).
    """

    def __init__(self, pm: pluggy.PluginManager, *, lazy: bool = False) -> None:
        self.pm = pm
        self._built = False
        if not lazy:
            self._build()

    def _build(self) -> None:
        """Call the registration hooks (importing every plugin class) once; a lazy
        registry does it on first use."""
        if self._built:
            return
        pm = self.pm
        self._entries: dict[str, dict[str, Entry]] = {kind: {} for kind in KINDS}
        self._problems: list[PluginProblem] = []
        # names that fail when used: broken registrations and ambiguous duplicates
        self._unusable: dict[str, dict[str, P4BenchError]] = {kind: {} for kind in KINDS}
        self._pending: dict[str, dict[str, P4BenchError]] = {kind: {} for kind in KINDS}
        bases = _kind_bases()
        for kind, hook_name in KINDS.items():
            candidates: list[tuple[Entry, bool]] = []
            for impl in getattr(pm.hook, hook_name).get_hookimpls():
                if impl.hookwrapper or impl.wrapper:
                    continue  # wrappers return no classes of their own
                source = source_of(pm, impl.plugin_name)
                for cls in self._call(impl, hook_name, kind, source):
                    entry = self._check(cls, kind, bases[kind], source)
                    if entry is not None:
                        candidates.append((entry, source.strict))
            owned: set[str] = set()  # names of strict sources: never taken over
            for entry, strict in sorted(candidates, key=lambda c: not c[1]):  # strict first
                self._add(entry, strict, owned)
            for name, error in self._pending[
                kind
            ].items():  # a broken class named like a good one is just dropped
                if name not in self._entries[kind]:
                    self._unusable[kind].setdefault(name, error)
        self._built = True

    # -- building ---------------------------------------------------------------------
    def _report(self, source: PluginSource, kind: str, name: str | None, message: str) -> None:
        if source.strict:
            raise TypeError(message)
        problem = PluginProblem(source.distribution, source.version, kind, name, message)
        self._problems.append(problem)
        if name is not None:
            self._pending[kind].setdefault(
                name, PluginError(f"{kind} '{name}' cannot be used: {problem.line()}")
            )

    def _call(self, impl: Any, hook_name: str, kind: str, source: PluginSource) -> list[Any]:
        try:
            returned = impl.function()
        except Exception as exc:
            if source.strict:
                raise
            self._report(source, kind, None, f"{hook_name} raised {one_line(exc)}")
            return []
        if returned is None:
            return []  # pluggy's "no result"
        if not isinstance(returned, (list, tuple)):
            named = (
                getattr(returned, "name", None) if isinstance(returned, type) else None
            )  # `--method <it>` says why
            self._report(
                source,
                kind,
                named if isinstance(named, str) and named else None,
                f"{hook_name} returned {_describe(returned)}, not a list of classes",
            )
            return []
        return list(returned)

    def _check(self, cls: Any, kind: str, base: type, source: PluginSource) -> Entry | None:
        if not isinstance(cls, type):
            self._report(
                source,
                kind,
                None,
                f"{KINDS[kind]} returned {_describe(cls)} in its list, not a class",
            )
            return None
        name = getattr(cls, "name", None)
        where = f"{cls.__module__}.{cls.__qualname__}"
        if not isinstance(name, str) or not name:
            self._report(source, kind, None, f"{kind} class {where} has no string attribute 'name'")
            return None
        if not issubclass(cls, base):
            self._report(
                source,
                kind,
                name,
                f"{kind} '{name}' ({where}) is not a subclass of "
                f"{base.__module__}.{base.__qualname__}",
            )
            return None
        return Entry(name, kind, cls, source.distribution, source.version)

    def _add(self, entry: Entry, strict: bool, owned: set[str]) -> None:
        kind, name = entry.kind, entry.name
        existing = self._entries[kind].get(name)
        if strict:
            if existing is not None:
                raise DuplicateNameError(
                    f"{kind} '{name}' is registered twice: by {existing.qualname} ({existing.distribution}) "
                    f"and by {entry.qualname} ({entry.distribution})"
                )
            self._entries[kind][name] = entry
            owned.add(name)
            return
        if name in owned:  # a built-in keeps its name; the installed class is ignored
            assert existing is not None  # an owned name is never removed from the entries
            message = (
                f"{kind} '{name}' ({entry.qualname}) is ignored: "
                f"{existing.distribution} registers '{name}' itself"
            )
        elif existing is None and name not in self._unusable[kind]:
            self._entries[kind][name] = entry
            return
        elif existing is not None:  # two installed plugins claim the name: neither is used
            del self._entries[kind][name]
            self._unusable[kind][name] = DuplicateNameError(
                f"{kind} '{name}' is registered by {existing.distribution} {existing.version} ({existing.qualname}) "
                f"and by {entry.distribution} {entry.version} ({entry.qualname}); uninstall one of them"
            )
            message = (
                f"{kind} '{name}' ({entry.qualname}) is also registered by {existing.distribution} "
                f"{existing.version}; neither is used"
            )
        else:
            message = f"{kind} '{name}' ({entry.qualname}) is registered by other installed plugins too; none is used"
        self._problems.append(PluginProblem(entry.distribution, entry.version, kind, name, message))

    # -- reading ----------------------------------------------------------------------
    @property
    def problems(self) -> list[PluginProblem]:
        """Problems of installed plugins: loading them (kept by the manager) and their registrations."""
        loading = list(getattr(self.pm, "problems", []))
        if not self._built and not self._has_installed_plugins():
            return (
                loading  # nothing can report a registration problem: no need to import every plugin
            )
        self._build()
        return loading + self._problems

    def _has_installed_plugins(self) -> bool:
        """Whether a registered plugin is an installed one (not strict): only those report problems."""
        return any(not source_of(self.pm, name).strict for name, _ in self.pm.list_name_plugin())

    def names(self, kind: str) -> list[str]:
        self._build()
        return sorted(self._entries[kind])

    def entries(self, kind: str) -> list[Entry]:
        return [self._entries[kind][name] for name in self.names(kind)]

    def entry(self, kind: str, name: str) -> Entry:
        """The entry registered as `name`; PluginError or DuplicateNameError (exit code 2)
        for a broken or ambiguous registration, else UnknownNameError listing the names."""
        self._build()
        try:
            return self._entries[kind][name]
        except KeyError:
            if name in self._unusable[kind]:
                raise self._unusable[kind][name] from None
            error = UnknownNameError(kind, name, self._entries[kind])
            unloaded = [p for p in getattr(self.pm, "problems", []) if p.kind == "plugin"]
            if unloaded:  # the name may be one of theirs: say so, not just "unknown"
                listed = "; ".join(f"{p.distribution} {p.version}: {p.message}" for p in unloaded)
                error.args = (
                    f"{error.args[0]}; installed plugin packages that failed to load: {listed}",
                )
            raise error from None

    def get(self, kind: str, name: str) -> type:
        """The class registered as `name` (errors as `entry`)."""
        return self.entry(kind, name).cls

    def as_dict(self) -> dict[str, Any]:
        """`{kind: [{name, distribution, version, description}], "problems": [...]}`."""
        listing: dict[str, Any] = {
            kind: [
                {
                    "name": e.name,
                    "distribution": e.distribution,
                    "version": e.version,
                    "description": e.description,
                }
                for e in self.entries(kind)
            ]
            for kind in KINDS
        }
        listing["problems"] = [asdict(p) for p in self.problems]
        return listing


def _kind_bases() -> dict[str, type]:
    """The base class of each kind, imported late: these modules import the plugin host."""
    from p4bench.data.base import Dataset, Partitioner
    from p4bench.engine.method import Method
    from p4bench.engine.runtime import Runtime
    from p4bench.engine.threats import Attack, Defense
    from p4bench.models import Model
    from p4bench.privacy.accountants import Accountant
    from p4bench.topology.graphs import Topology

    return {
        "method": Method,
        "attack": Attack,
        "defense": Defense,
        "dataset": Dataset,
        "partitioner": Partitioner,
        "model": Model,
        "topology": Topology,
        "accountant": Accountant,
        "runtime": Runtime,
    }


def _describe(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, type):
        return f"the class {value.__module__}.{value.__qualname__}"
    return f"{type(value).__name__} {value!r:.80}"


def create_plugin_manager(
    extra_plugins: tuple[Any, ...] = (), autoload: bool | None = None
) -> PluginManager:
    """A plugin manager with the built-ins, entry-point plugins (unless disabled) and extras.

    Autoloading of third-party plugins is skipped when the environment variable
    ``P4BENCH_DISABLE_PLUGIN_AUTOLOAD`` is set to a non-empty value, or `autoload` is False.
    """
    pm = PluginManager()
    pm.add_hookspecs(hookspecs)
    own = PluginSource("p4bench", own_version(), strict=True)
    for module_name in BUILTIN_MODULES:
        module: ModuleType = __import__(module_name, fromlist=["_"])
        pm.sources[pm.register(module, name=module_name) or module_name] = own
    if autoload is None:
        autoload = not os.environ.get(DISABLE_AUTOLOAD_ENV)
    load_entry_points(pm, only_distribution=None if autoload else "p4bench")
    missing = sorted(name for name in BUILTIN_PLUGINS if pm.get_plugin(name) is None)
    if missing:
        raise PluginError(
            f"p4bench's own plugin packages are not installed ({', '.join(missing)}: no "
            f"'{ENTRY_POINT_GROUP}' entry point): reinstall p4bench (scripts/setup.sh)"
        )
    for plugin in extra_plugins:
        name = pm.register(plugin)
        if name is not None:
            pm.sources[name] = own  # passed in code: a bad registration is the caller's bug
    try:
        pm.check_pending()
    except pluggy.PluginValidationError:
        pm.problems.extend(_unknown_hooks(pm))
    return pm


def _unknown_hooks(pm: PluginManager) -> list[PluginProblem]:
    """A problem for each implementation of a hook p4bench does not define (pluggy's
    `check_pending`, for every plugin): a misspelt `register_method` is never called."""
    import difflib

    callers = {name: caller for name, caller in vars(pm.hook).items() if not name.startswith("_")}
    specified = [name for name, caller in callers.items() if caller.has_spec()]
    problems = []
    for name, caller in callers.items():
        if caller.has_spec():
            continue
        close = difflib.get_close_matches(name, specified, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        for impl in caller.get_hookimpls():
            if impl.optionalhook:
                continue
            plugin = impl.plugin
            what = (
                f"module {plugin.__name__}"
                if isinstance(plugin, ModuleType)
                else f"{type(plugin).__module__}.{type(plugin).__qualname__}"
            )
            source = source_of(pm, impl.plugin_name)
            problems.append(
                PluginProblem(
                    source.distribution,
                    source.version,
                    "hook",
                    None,
                    f"{what} implements unknown hook '{name}'{hint}: it is never called",
                )
            )
    return problems


@lru_cache(maxsize=1)
def _default() -> tuple[PluginManager, Registry]:
    pm = create_plugin_manager()
    return pm, Registry(pm, lazy=True)  # the classes are imported when first asked for


def default_built() -> bool:
    """Whether the process-wide plugin manager exists already (plugins may have been
    registered on it in code)."""
    return _default.cache_info().currsize > 0


def default_plugin_manager() -> PluginManager:
    """The process-wide plugin manager (built once, on first use)."""
    return _default()[0]


def default_registry() -> Registry:
    """The process-wide registry (its hooks are called once, on first use)."""
    return _default()[1]


topology._default_registry = (
    default_registry  # what a deprecated `get_topology` call without registry= uses
)


_generation = 0  # how many times the process-wide registry was reset


def registry_generation() -> int:
    """Bumped by `reset_default`: what was shown of the registry before is shown again."""
    return _generation


def reset_default() -> None:
    """Forget the process-wide registry (tests that install plugins call this)."""
    global _generation
    _generation += 1
    _default.cache_clear()
