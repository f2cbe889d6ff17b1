"""P4L: privacy-preserving peer-to-peer learning over Paillier-encrypted synergy chains.

The method is imported when the hook is called, or on first use of the name below
(`p4bench.lazy`): building the plugin manager must not import torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from p4bench.hookspecs import hookimpl
from p4bench.lazy import lazy_exports

if TYPE_CHECKING:
    from p4bench.engine.method import Method
    from p4bench.plugins.p4l.method import P4L

__all__ = ["P4L"]

__getattr__ = lazy_exports(globals(), {"p4bench.plugins.p4l.method": ("P4L",)})


@hookimpl
def register_methods() -> list[type[Method]]:
    from p4bench.plugins.p4l.method import P4L

    return [P4L]


@hookimpl
def register_presets() -> list[Any]:
    from p4bench.plugins.p4l.preset_report import P4L_PRESET  # imported when `reproduce` asks

    return [P4L_PRESET]
