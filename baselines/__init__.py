"""Baseline methods, registered through the same hook as third-party methods.

The classes are imported when the hook is called, or on first use of a name below
(`p4bench.lazy`): building the plugin manager must not import torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from p4bench.hookspecs import hookimpl
from p4bench.lazy import LazyPackage

if TYPE_CHECKING:
    from p4bench.baselines.centralized import Centralized
    from p4bench.baselines.dp_cga import DPCGA
    from p4bench.baselines.dsgt import DPDSGD, DPDSGT
    from p4bench.baselines.fedavg import FedAvg
    from p4bench.baselines.feddf import FedDF
    from p4bench.baselines.local import LocalTraining
    from p4bench.baselines.muffliato import Muffliato
    from p4bench.baselines.p2p_fl import P2PFL
    from p4bench.baselines.pdsl import PDSL, PDSLLocalVal
    from p4bench.baselines.proxyfl import ProxyFL
    from p4bench.baselines.scaffold import Scaffold
    from p4bench.engine.method import Method
    from p4bench.models import Model
    from p4bench.presets import Preset

PACKAGE = LazyPackage(globals(), {
    "p4bench.baselines.centralized": ("Centralized",),
    "p4bench.baselines.dp_cga": ("DPCGA",),
    "p4bench.baselines.dsgt": ("DPDSGD", "DPDSGT"),
    "p4bench.baselines.fedavg": ("FedAvg",),
    "p4bench.baselines.feddf": ("FedDF",),
    "p4bench.baselines.local": ("LocalTraining",),
    "p4bench.baselines.muffliato": ("Muffliato",),
    "p4bench.baselines.p2p_fl": ("P2PFL",),
    "p4bench.baselines.pdsl": ("PDSL", "PDSLLocalVal"),
    "p4bench.baselines.proxyfl": ("ProxyFL",),
    "p4bench.baselines.scaffold": ("Scaffold",),
})  # the one list of this package's classes
__all__ = PACKAGE.names
__getattr__ = PACKAGE.getattr


@hookimpl
def register_methods() -> list[type[Method]]:
    return PACKAGE.load()


@hookimpl
def register_presets() -> list[Preset]:
    """Karras et al.'s P2P FL paper and PDSL (imported when `reproduce` asks)."""
    from p4bench.baselines.karras_preset import KARRAS_PRESET
    from p4bench.baselines.pdsl_preset_report import PDSL_PRESET

    return [KARRAS_PRESET, PDSL_PRESET]


@hookimpl
def register_models() -> list[type[Model]]:
    """Karras et al.'s Table I CNN (cnn-gray), beside their P2P FL method."""
    from p4bench.baselines.karras_models import GrayCNN

    return [GrayCNN]
