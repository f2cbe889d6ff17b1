"""Registers the built-in datasets and partitioners through the public hooks (their
`p4bench data` commands are registered by `p4bench.cli.builtin`). The classes are
imported when the hooks are called: building the plugin manager must not import torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from p4bench.hookspecs import hookimpl
from p4bench.lazy import lazy_exports

if TYPE_CHECKING:
    from p4bench.data.base import Dataset, Partitioner
    from p4bench.data.cbds import CBDSPartitioner
    from p4bench.data.digits import DigitsDataset
    from p4bench.data.partitioners import (
        AlphaPartitioner,
        DirichletPartitioner,
        IIDPartitioner,
        NaturalPartitioner,
        ShardsPartitioner,
    )
    from p4bench.data.sources import (
        Cifar10Dataset,
        Cifar100Dataset,
        EmnistBalancedDataset,
        LeafFemnistDataset,
        MnistDataset,
    )
    from p4bench.data.synthetic import SyntheticDataset

__all__ = [
    "AlphaPartitioner", "CBDSPartitioner", "Cifar100Dataset", "Cifar10Dataset", "DigitsDataset", "DirichletPartitioner",
    "EmnistBalancedDataset", "IIDPartitioner", "LeafFemnistDataset", "MnistDataset", "NaturalPartitioner",
    "ShardsPartitioner", "SyntheticDataset", "register_datasets", "register_partitioners",
]

# the names this module used to import, for code that imports them from here
__getattr__ = lazy_exports(globals(), {
    "p4bench.data.cbds": ("CBDSPartitioner",),
    "p4bench.data.digits": ("DigitsDataset",),
    "p4bench.data.partitioners": (
        "AlphaPartitioner", "DirichletPartitioner", "IIDPartitioner", "NaturalPartitioner", "ShardsPartitioner",
    ),
    "p4bench.data.sources": (
        "Cifar10Dataset", "Cifar100Dataset", "EmnistBalancedDataset", "LeafFemnistDataset", "MnistDataset",
    ),
    "p4bench.data.synthetic": ("SyntheticDataset",),
})


@hookimpl
def register_datasets() -> list[type[Dataset]]:
    from p4bench.data.digits import DigitsDataset
    from p4bench.data.sources import (
        Cifar10Dataset,
        Cifar100Dataset,
        EmnistBalancedDataset,
        LeafFemnistDataset,
        MnistDataset,
    )
    from p4bench.data.synthetic import SyntheticDataset

    return [
        DigitsDataset,
        Cifar10Dataset,
        Cifar100Dataset,
        MnistDataset,
        EmnistBalancedDataset,
        LeafFemnistDataset,
        SyntheticDataset,
    ]


@hookimpl
def register_partitioners() -> list[type[Partitioner]]:
    from p4bench.data.cbds import CBDSPartitioner
    from p4bench.data.partitioners import (
        AlphaPartitioner,
        DirichletPartitioner,
        IIDPartitioner,
        NaturalPartitioner,
        ShardsPartitioner,
    )

    return [IIDPartitioner, AlphaPartitioner, ShardsPartitioner, DirichletPartitioner, NaturalPartitioner, CBDSPartitioner]
