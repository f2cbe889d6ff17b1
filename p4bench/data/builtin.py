"""Registers the built-in datasets and partitioners through the public hooks (their
`p4bench data` commands are registered by `p4bench.cli.builtin`)."""

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
from p4bench.hookspecs import hookimpl


@hookimpl
def register_datasets():
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
def register_partitioners():
    return [IIDPartitioner, AlphaPartitioner, ShardsPartitioner, DirichletPartitioner, NaturalPartitioner, CBDSPartitioner]
