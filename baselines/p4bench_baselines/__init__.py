"""The methods the seed papers compare against (ProxyFL, DP-DSGT/DSGD, SCAFFOLD, FedAvg, FedDF,
Muffliato, DP-CGA, local, centralized), registered through the `p4bench` entry point exactly as
a third-party method package is.

The classes are imported when the hook is called, or on first use of a name below
(`p4bench.lazy`): building the plugin manager must not import torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from p4bench.hookspecs import hookimpl
from p4bench.lazy import LazyPackage

if TYPE_CHECKING:
    from p4bench.engine.method import Method
    from p4bench_baselines.centralized import Centralized
    from p4bench_baselines.dp_cga import DPCGA
    from p4bench_baselines.dsgt import DPDSGD, DPDSGT
    from p4bench_baselines.fedavg import FedAvg
    from p4bench_baselines.feddf import FedDF
    from p4bench_baselines.local import LocalTraining
    from p4bench_baselines.muffliato import Muffliato
    from p4bench_baselines.proxyfl import ProxyFL
    from p4bench_baselines.scaffold import Scaffold

PACKAGE = LazyPackage(
    globals(),
    {
        "p4bench_baselines.centralized": ("Centralized",),
        "p4bench_baselines.dp_cga": ("DPCGA",),
        "p4bench_baselines.dsgt": ("DPDSGD", "DPDSGT"),
        "p4bench_baselines.fedavg": ("FedAvg",),
        "p4bench_baselines.feddf": ("FedDF",),
        "p4bench_baselines.local": ("LocalTraining",),
        "p4bench_baselines.muffliato": ("Muffliato",),
        "p4bench_baselines.proxyfl": ("ProxyFL",),
        "p4bench_baselines.scaffold": ("Scaffold",),
    },
)  # the one list of this package's classes
__all__ = PACKAGE.names
__getattr__ = PACKAGE.getattr


@hookimpl
def register_methods() -> list[type[Method]]:
    return PACKAGE.load()
