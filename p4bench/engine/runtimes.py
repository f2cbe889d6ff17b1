"""Registers the built-in runtimes through the public hook."""

from p4bench.engine.runtime import BytesRuntime, ReferenceRuntime, Runtime, SimulationRuntime
from p4bench.hookspecs import hookimpl


@hookimpl
def register_runtimes() -> list[type[Runtime]]:
    return [SimulationRuntime, ReferenceRuntime, BytesRuntime]
