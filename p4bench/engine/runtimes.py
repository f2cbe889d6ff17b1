"""Registers the built-in runtimes through the public hook (imported when the hook is
called: building the plugin manager must not import torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from p4bench.hookspecs import hookimpl
from p4bench.lazy import lazy_exports

if TYPE_CHECKING:
    from p4bench.engine.runtime import BytesRuntime, ReferenceRuntime, Runtime, SimulationRuntime

__all__ = ["BytesRuntime", "ReferenceRuntime", "Runtime", "SimulationRuntime", "register_runtimes"]

# the names this module used to import, for code that imports them from here
__getattr__ = lazy_exports(
    globals(),
    {
        "p4bench.engine.runtime": (
            "BytesRuntime",
            "ReferenceRuntime",
            "Runtime",
            "SimulationRuntime",
        )
    },
)


@hookimpl
def register_runtimes() -> list[type[Runtime]]:
    from p4bench.engine.runtime import BytesRuntime, ReferenceRuntime, SimulationRuntime

    return [SimulationRuntime, ReferenceRuntime, BytesRuntime]
