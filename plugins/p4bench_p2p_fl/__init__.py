"""Karras et al.'s peer-to-peer federated learning on edge devices: the method, its Table I CNN
(cnn-gray) and the paper's preset, registered through the `p4bench` entry point exactly as a
third-party plugin package is.

The classes are imported when the hooks are called, or on first use of a name below
(`p4bench.lazy`): building the plugin manager must not import torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from p4bench.hookspecs import hookimpl
from p4bench.lazy import LazyPackage

if TYPE_CHECKING:
    from p4bench.engine.method import Method
    from p4bench.models import Model
    from p4bench.studies.presets import Preset
    from p4bench_p2p_fl.method import P2PFL

PACKAGE = LazyPackage(
    globals(), {"p4bench_p2p_fl.method": ("P2PFL",)}
)  # the one list of this package's classes
__all__ = PACKAGE.names
__getattr__ = PACKAGE.getattr


@hookimpl
def register_methods() -> list[type[Method]]:
    return PACKAGE.load()


@hookimpl
def register_presets() -> list[Preset]:
    """Karras et al.'s preset (imported when `reproduce` asks)."""
    from p4bench_p2p_fl.preset import KARRAS_PRESET

    return [KARRAS_PRESET]


@hookimpl
def register_models() -> list[type[Model]]:
    """Karras et al.'s Table I CNN (cnn-gray), beside their method."""
    from p4bench_p2p_fl.models import GrayCNN

    return [GrayCNN]
