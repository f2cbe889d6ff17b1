"""P4 and its secure aggregation, registered through the public hooks.

The classes are imported when a hook is called, or on first use of a name below
(`p4bench.lazy`): building the plugin manager must not import torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from p4bench.hookspecs import hookimpl
from p4bench.lazy import lazy_exports

if TYPE_CHECKING:
    from p4bench.engine.method import Method
    from p4bench.engine.threats import Defense
    from p4bench.plugins.p4.method import P4
    from p4bench.plugins.p4.secure import P4Secure

__all__ = ["P4", "P4Secure"]

__getattr__ = lazy_exports(globals(), {
    "p4bench.plugins.p4.method": ("P4",),
    "p4bench.plugins.p4.secure": ("P4Secure",),
})


@hookimpl
def register_methods() -> list[type[Method]]:
    from p4bench.plugins.p4.method import P4

    return [P4]


@hookimpl
def register_defenses() -> list[type[Defense]]:
    from p4bench.plugins.p4.secure import P4Secure

    return [P4Secure]


@hookimpl
def register_presets() -> list[Any]:
    from p4bench.plugins.p4.presets import P4_PRESETS  # imported when `reproduce` asks, not at start-up

    return list(P4_PRESETS)
