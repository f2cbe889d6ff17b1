"""Registers the built-in datasets and partitioners through the public hooks (their
`p4bench data` commands are registered by `p4bench.cli.builtin`). The classes are
imported when the hooks are called: building the plugin manager must not import torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from p4bench.hookspecs import hookimpl
from p4bench.lazy import LazyPackage, package_getattr

if TYPE_CHECKING:
    from p4bench.data.base import Dataset, Partitioner

# Each built-in class is named once, here: the hooks return them in this order, and the
# module exports them (imported on first use) for code that imported them from here.
DATASETS = LazyPackage(
    globals(),
    {
        "p4bench.data.digits": ("DigitsDataset",),
        "p4bench.data.sources": (
            "Cifar10Dataset",
            "Cifar100Dataset",
            "MnistDataset",
            "EmnistBalancedDataset",
            "LeafFemnistDataset",
        ),
        "p4bench.data.synthetic": ("SyntheticDataset",),
    },
)
PARTITIONERS = LazyPackage(
    globals(),
    {
        "p4bench.data.partitioners": (
            "IIDPartitioner",
            "AlphaPartitioner",
            "ShardsPartitioner",
            "DirichletPartitioner",
            "NaturalPartitioner",
        ),
        "p4bench.data.cbds": ("CBDSPartitioner",),
    },
)
__all__ = [*DATASETS.names, *PARTITIONERS.names, "register_datasets", "register_partitioners"]
__getattr__ = package_getattr(DATASETS, PARTITIONERS)


@hookimpl
def register_datasets() -> list[type[Dataset]]:
    return DATASETS.load()


@hookimpl
def register_partitioners() -> list[type[Partitioner]]:
    return PARTITIONERS.load()
