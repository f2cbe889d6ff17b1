"""What a plugin package written against p4bench 0.1 may still do, each with one
`PluginDeprecationWarning` line naming the plugin, what to change and the removal version
(`p4bench.moved.REMOVED_IN`).

- **Undeclared options.** Before plugins declared their options (`options = (Option(...),)`),
  a plugin read the run's free-form `config.options` (`self.config.options.get("mu", 0.1)`),
  and a method chose its graph the same way (`-o topology=NAME`). An installed plugin whose
  own classes declare no `options` still receives the keys no plugin of the run declares
  (`-o key=value`, `--topology`, `--topology-option`), instead of the refusal (exit 2) every
  other run gets; a plugin that declares options is checked as before.
- **A topology's `option_help`.** A 0.1 topology listed its option keys in `option_help`
  and read them with `self._option(key, default, kind)` or `self.options`; it is built as
  it was then (`legacy_topology`).

This module sits below `p4bench.options` (which calls it): it imports no plugin base.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from collections.abc import Callable, Container, Iterable, Mapping
from typing import Any

from p4bench.errors import ConfigError, PluginDeprecationWarning
from p4bench.moved import REMOVED_IN

__all__ = [
    "declares_options",
    "legacy_topology",
    "option_help_options",
    "pass_undeclared",
    "read_option",
]

OWN_DISTRIBUTION = "p4bench"
GRAPH_KEYS = ("topology", "topology_options")


def declares_options(cls: type) -> bool:
    """Whether a class of `cls`'s own top-level package (the plugin's, not the base it
    extends, e.g. p4bench's FedAvg) sets `options`."""
    package = cls.__module__.split(".")[0]
    return any("options" in vars(c) for c in cls.__mro__ if c.__module__.split(".")[0] == package)


def takes_undeclared(entry: Any) -> bool:
    """Whether a registered plugin (`p4bench.host.types.Entry`) is an installed one whose own
    classes declare no options: a 0.1 plugin, which reads the run's options itself."""
    return bool(entry.distribution != OWN_DISTRIBUTION and not declares_options(entry.cls))


def pass_undeclared(
    given: Mapping[str, Any],
    declared: Container[str],
    used: Iterable[tuple[str, str, type]],
    registry: Any,
) -> list[str]:
    """The keys of `given` (the run's options) that no plugin of the run declares (none is in
    `declared`) and that are to be refused: none where an installed plugin of the run
    declares no options of its own (a 0.1 plugin), which then reads them itself. For each
    such plugin, one deprecation line for its options and one for its graph (`topology`)."""
    keys = [str(key) for key in given if key not in declared]
    if not keys:
        return []
    legacy = [(k, n, cls) for k, n, cls in used if takes_undeclared(registry.entry(k, n))]
    if not legacy:
        return list(keys)
    for kind, name, cls in legacy:
        label = f"{kind} '{name}' of {_distribution(registry, kind, name, version=True)}"
        plain = [k for k in keys if k not in GRAPH_KEYS]
        if plain:
            listed = ", ".join(f"-o {k}" for k in plain)
            _warn_at(
                cls,
                f"{label} reading {listed} without declaring {'it' if len(plain) == 1 else 'them'}",
                f"declare {'it' if len(plain) == 1 else 'them'} in {cls.__name__}.options "
                "(p4bench.api.Option) and read the values with p4bench.api.resolve_options",
            )
        if any(k in GRAPH_KEYS for k in keys):
            graph = given.get("topology")
            which = f"--topology {graph}" if isinstance(graph, str) else "--topology-option"
            default = graph if isinstance(graph, str) else "ring"
            _warn_at(
                cls,
                f"{label} taking its graph ({which}) without declaring the option 'topology'",
                f'declare options = (*topology_options("{default}"), ...) and build the graph '
                "with get_topology(name, options, registry=default_registry()) (p4bench.api)",
            )
    return []


def option_help_options(cls: type, option: Callable[..., Any]) -> tuple[Any, ...]:
    """A 0.1 topology's `option_help` (its keys and what they mean) as declared options of
    any value, built with `option` (`p4bench.options.Option`, which imports this module);
    () for every other class."""
    if not _is_legacy_topology(cls):
        return ()
    return tuple(option(k, object, None, h) for k, h in cls.option_help.items())  # type: ignore[attr-defined]


def _is_legacy_topology(cls: type) -> bool:
    return bool(getattr(cls, "option_help", None)) and not declares_options(cls)


def legacy_topology(topology: Any, options: Mapping[str, Any] | None) -> bool:
    """Build a 0.1 topology (one with `option_help` and no `options` of its own) as 0.1
    did: `self.options` the given mapping, unknown keys refused naming the valid ones, and
    `_option(key, default, kind)` to read them; False (nothing done) for any other."""
    cls = type(topology)
    if not _is_legacy_topology(cls):
        return False
    help_of = dict(cls.option_help)
    given = dict(options or {})
    unknown = sorted(set(given) - set(help_of))
    if unknown:
        valid = ", ".join(sorted(help_of))
        raise ConfigError(
            f"options.topology_options.{unknown[0]}",
            f"unknown option of topology '{cls.name}'; valid: {valid}",
        )
    topology.options = given
    topology.option_values = given
    _warn_at(
        cls,
        f"topology '{cls.name}' declaring its options in option_help (p4bench 0.1)",
        f"declare them in {cls.__name__}.options (p4bench.api.Option) and read "
        "self.option_values instead of self.options and self._option",
    )
    return True


def read_option(
    topology: Any, key: str, default: Any, kind: type, check: Any = None, expect: str = ""
) -> Any:
    """0.1's `Topology._option`: the option `key` converted to `kind` and checked."""
    value = topology.options.get(key, default)
    if value is None:
        return None
    field = f"options.topology_options.{key}"
    try:
        converted = kind(value)
    except (TypeError, ValueError):
        raise ConfigError(field, f"expected {expect or kind.__name__}, got {value!r}") from None
    if kind is int and converted != value:
        raise ConfigError(field, f"expected an integer, got {value!r}")
    if check is not None and not check(converted):
        raise ConfigError(field, f"expected {expect}, got {value!r}")
    return converted


def _distribution(registry: Any, kind: str, name: str, *, version: bool = False) -> str:
    try:
        entry = registry.entry(kind, name)
    except Exception:  # noqa: BLE001 - a registry without entries (a test's stand-in)
        return OWN_DISTRIBUTION
    return f"{entry.distribution} {entry.version}" if version else str(entry.distribution)


def _warn_at(cls: type, what: str, instead: str) -> None:
    """One deprecation line at the plugin class's definition, shown once per place and
    message as `warnings.warn` would (the module's `__warningregistry__`)."""
    try:
        filename = inspect.getsourcefile(cls) or cls.__module__
        lineno = inspect.getsourcelines(cls)[1]
    except (OSError, TypeError):
        filename, lineno = cls.__module__, 1
    module = sys.modules.get(cls.__module__)
    registry = vars(module).setdefault("__warningregistry__", {}) if module else None
    warnings.warn_explicit(
        f"{what} is deprecated since p4bench 0.2 and will be removed in {REMOVED_IN}: {instead}",
        PluginDeprecationWarning,
        filename,
        lineno,
        module=cls.__module__,
        registry=registry,
    )
