"""P4L: privacy-preserving peer-to-peer learning over Paillier-encrypted synergy chains.

The method is imported when the hook is called, or on first use of the name below
(`p4bench.lazy`): building the plugin manager must not import torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from p4bench.hookspecs import hookimpl
from p4bench.lazy import LazyPackage

if TYPE_CHECKING:
    from p4bench.engine.method import Method

METHODS = LazyPackage(globals(), {"p4bench_p4l.method": ("P4L",)})  # the class named once
__all__ = METHODS.names
__getattr__ = METHODS.getattr


@hookimpl
def register_methods() -> list[type[Method]]:
    return METHODS.load()


@hookimpl
def register_presets() -> list[Any]:
    from p4bench_p4l.preset_report import P4L_PRESET  # imported when `reproduce` asks

    return [P4L_PRESET]
