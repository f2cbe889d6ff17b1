"""P4 and its secure aggregation, registered through the public hooks.

The classes are imported when a hook is called, or on first use of a name below
(`p4bench.lazy`): building the plugin manager must not import torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from p4bench.hookspecs import hookimpl
from p4bench.lazy import LazyPackage, package_getattr

if TYPE_CHECKING:
    from p4bench.engine.method import Method
    from p4bench.engine.threats import Defense

# each class named once: the hooks return them, the package exports them (on first use)
METHODS = LazyPackage(globals(), {"p4bench_p4.method": ("P4",)})
DEFENSES = LazyPackage(globals(), {"p4bench_p4.secure": ("P4Secure",)})
__all__ = [*METHODS.names, *DEFENSES.names]
__getattr__ = package_getattr(METHODS, DEFENSES)


@hookimpl
def register_methods() -> list[type[Method]]:
    return METHODS.load()


@hookimpl
def register_defenses() -> list[type[Defense]]:
    return DEFENSES.load()


@hookimpl
def register_presets() -> list[Any]:
    from p4bench_p4.presets import P4_PRESETS  # imported when `reproduce` asks, not at start-up

    return list(P4_PRESETS)
