"""Datasets, partitioners and the per-client tensors every method trains on.

The names below are imported on first use (`p4bench.lazy`): the plugin host imports
this package to register the built-in datasets, and the command line must start
without torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from p4bench.lazy import lazy_exports

if TYPE_CHECKING:
    from p4bench.data.base import ArrayDataset, Dataset, Partitioner
    from p4bench.data.federated import (
        ClientTensors,
        FederatedData,
        build_federated_data,
        split_client_indices,
    )

__all__ = [
    "ArrayDataset",
    "Dataset",
    "Partitioner",
    "ClientTensors",
    "FederatedData",
    "build_federated_data",
    "split_client_indices",
]

__getattr__ = lazy_exports(
    globals(),
    {
        "p4bench.data.base": ("ArrayDataset", "Dataset", "Partitioner"),
        "p4bench.data.federated": (
            "ClientTensors",
            "FederatedData",
            "build_federated_data",
            "split_client_indices",
        ),
    },
)
