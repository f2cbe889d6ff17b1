"""Dataset plugins that read the official on-disk formats (no network access here)."""

from p4bench.data.sources.cifar import Cifar10Dataset, Cifar100Dataset
from p4bench.data.sources.leaf import LeafFemnistDataset
from p4bench.data.sources.mnist import EmnistBalancedDataset, MnistDataset

__all__ = [
    "Cifar10Dataset",
    "Cifar100Dataset",
    "EmnistBalancedDataset",
    "LeafFemnistDataset",
    "MnistDataset",
]
