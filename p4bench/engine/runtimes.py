"""Registers the built-in runtimes through the public hook (imported when the hook is
called: building the plugin manager must not import torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from p4bench.hookspecs import hookimpl

if TYPE_CHECKING:
    from p4bench.engine.runtime import Runtime


@hookimpl
def register_runtimes() -> list[type[Runtime]]:
    from p4bench.engine.runtime import BytesRuntime, ReferenceRuntime, SimulationRuntime

    return [SimulationRuntime, ReferenceRuntime, BytesRuntime]
