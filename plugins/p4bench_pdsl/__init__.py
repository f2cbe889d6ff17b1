"""PDSL (Wang et al.): Shapley-weighted cross-gradient decentralized learning, its local-validation
variant and the paper's preset, registered through the `p4bench` entry point exactly as a
third-party plugin package is.

The classes are imported when the hooks are called, or on first use of a name below
(`p4bench.lazy`): building the plugin manager must not import torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from p4bench.hookspecs import hookimpl
from p4bench.lazy import LazyPackage

if TYPE_CHECKING:
    from p4bench.engine.method import Method
    from p4bench.studies.presets import Preset
    from p4bench_pdsl.method import PDSL, PDSLLocalVal

PACKAGE = LazyPackage(
    globals(), {"p4bench_pdsl.method": ("PDSL", "PDSLLocalVal")}
)  # the one list of this package's classes
__all__ = PACKAGE.names
__getattr__ = PACKAGE.getattr


@hookimpl
def register_methods() -> list[type[Method]]:
    return PACKAGE.load()


@hookimpl
def register_presets() -> list[Preset]:
    """The PDSL paper's preset (imported when `reproduce` asks)."""
    from p4bench_pdsl.preset_report import PDSL_PRESET

    return [PDSL_PRESET]
