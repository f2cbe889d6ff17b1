"""Public unlabeled data for the methods that declare they need it (`Method.needs_public_data`,
e.g. FedDF's server distillation).

Where it comes from (the method's option `public_data`):

- ``pool`` (and ``auto`` for a dataset that declares no public source): a pool of the
  dataset's own records, a fraction `public_pool` drawn from a public stream of the run
  seed and removed from the pooled records *before* partitioning, so that no client ever
  holds one of them; their labels are dropped.
- ``auto`` for a dataset with a declared source (`Dataset.public_unlabeled`; cifar10:
  CIFAR-100's training images, as FedDF used), loaded only where the data is used.

Either way the inputs are split into U_train and U_val (a fraction `public_val`) by a
public permutation of the seed. The public data is not client data: a method may read
it outside the clients' DP ledger, and what it computes from public data and DP releases
is post-processing. The run records where it came from (summary key `public_data`,
MLflow tag `threat.public_data`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from p4bench.data.base import ArrayDataset, Dataset
from p4bench.errors import DataError
from p4bench.options import Option, resolve_options
from p4bench.rng import harness_rng

if TYPE_CHECKING:
    from p4bench.config import RunConfig

__all__ = ["PUBLIC_DATA_OPTIONS", "SEED_PUBLIC", "PublicData", "public_data", "without_records"]

SEED_PUBLIC = (
    13  # harness stream of the held-out pool and the U_train/U_val split (rng.py uses 7 and 11)
)

PUBLIC_DATA_OPTIONS = (
    Option(
        "public_data",
        str,
        "auto",
        "unlabeled public data: auto = the dataset's declared source (cifar10: "
        "CIFAR-100's training images), else a held-out pool; pool = a pool of the dataset's own records held out "
        "before partitioning (no client holds them; labels dropped)",
        choices=("auto", "pool"),
    ),
    Option(
        "public_pool",
        float,
        0.2,
        "fraction of the dataset's records held out as the public pool (public_data=pool, "
        "or auto without a declared source)",
        low=0.0,
        high=0.9,
        low_open=True,
    ),
    Option(
        "public_val",
        float,
        0.2,
        "fraction of the public data kept as the validation split U_val (early stopping); "
        "the rest is U_train",
        low=0.0,
        high=0.5,
        low_open=True,
    ),
)


@dataclass
class PublicData:
    """Unlabeled public inputs, split into U_train and U_val on first use.

    `held_out` are the indices (into the dataset's `pooled()` records) withheld from every
    client; empty when the data comes from another dataset.
    """

    description: str
    held_out: np.ndarray
    load: Callable[[], np.ndarray]
    feature_shape: tuple[int, ...]
    val_fraction: float
    seed: int
    _splits: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    # the held-out pool's labels, for a method that declares `needs_public_labels` (PDSL's
    # shared validation set Q); None for unlabeled public data
    labels: np.ndarray | None = None

    def labeled(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of the whole labeled pool; DataError when it has no labels."""
        if self.labels is None:
            raise DataError(f"public data ({self.description}) has no labels")
        device = torch.get_default_device()  # the run's (p4bench.engine.devices.device_scope)
        return (
            torch.from_numpy(np.asarray(self.load(), dtype=np.float32)).to(device),
            torch.from_numpy(self.labels.astype(np.int64)).to(device),
        )

    def splits(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(U_train (n_train, ...), U_val (n_val, ...)) float32, computed once."""
        if self._splits is None:
            x = np.asarray(self.load(), dtype=np.float32)
            if tuple(x.shape[1:]) != tuple(self.feature_shape):
                raise DataError(
                    f"public data ({self.description}) has features {tuple(x.shape[1:])}, "
                    f"the run's dataset {tuple(self.feature_shape)}"
                )
            order = harness_rng(self.seed, SEED_PUBLIC).permutation(
                len(x)
            )  # a stream apart from the pool's draw
            val = max(1, round(self.val_fraction * len(x)))
            if len(x) - val < 1:
                raise DataError(
                    f"public data ({self.description}) is too small for a validation split of {val}"
                )
            tensor = torch.from_numpy(x)
            self._splits = (
                tensor[torch.from_numpy(order[val:])],
                tensor[torch.from_numpy(order[:val])],
            )
        device = torch.get_default_device()  # the run's (p4bench.engine.devices.device_scope)
        return self._splits[0].to(device), self._splits[1].to(device)


def without_records(dataset: ArrayDataset, drop: np.ndarray) -> ArrayDataset:
    """`dataset` without the records `drop` (indices into `pooled()`), in both splits;
    the remaining records keep their order, so index i of the result's `pooled()` is
    the i-th kept index of the original."""
    count_train = len(dataset.y_train)
    keep = np.ones(count_train + len(dataset.y_test), dtype=bool)
    keep[drop] = False
    train, test = keep[:count_train], keep[count_train:]
    writers: dict[str, Any] = {}
    if dataset.writers_train is not None and dataset.writers_test is not None:
        writers = {
            "writers_train": dataset.writers_train[train],
            "writers_test": dataset.writers_test[test],
        }
    return replace(
        dataset,
        x_train=dataset.x_train[train],
        y_train=dataset.y_train[train],
        x_test=dataset.x_test[test],
        y_test=dataset.y_test[test],
        **writers,
    )


def public_data(
    plugin: type[Dataset] | Dataset,
    dataset: ArrayDataset,
    data_dir: Path,
    config: RunConfig,
    labeled: bool = False,
) -> tuple[ArrayDataset, PublicData]:
    """(the dataset the clients are partitioned from, the public data) for a method that
    needs public data; `dataset` is the plugin's loaded (and featurised) data, the run's
    options give `PUBLIC_DATA_OPTIONS`. `labeled`: the method reads labels (always a
    held-out pool of the dataset's own records, with their labels)."""
    values, seed, features = (
        resolve_options(PUBLIC_DATA_OPTIONS, config.options),
        config.seed,
        config.features,
    )
    instance = plugin() if isinstance(plugin, type) else plugin
    wanted = values["public_data"] == "auto" and not labeled
    source = instance.public_unlabeled(Path(data_dir), config) if wanted else None
    if source is not None:
        if features != "raw":
            raise DataError(
                f"the public data of {dataset.name} ({source.description}) is raw inputs; "
                f"with --features {features} use -o public_data=pool"
            )
        return dataset, PublicData(
            source.description,
            np.zeros(0, dtype=np.int64),
            source.load,
            dataset.feature_shape,
            float(values["public_val"]),
            seed,
        )
    count = len(dataset.y_train) + len(dataset.y_test)
    size = round(float(values["public_pool"]) * count)
    if size < 2:
        raise DataError(
            f"options.public_pool: {values['public_pool']} of {count} records leaves a pool of {size}; "
            "U_train and U_val need at least one record each"
        )
    held_out = np.sort(harness_rng(seed, SEED_PUBLIC).permutation(count)[:size])
    in_train = held_out < len(dataset.y_train)  # index each split: no copy of the whole dataset
    pool = np.concatenate(
        [
            dataset.x_train[held_out[in_train]],
            dataset.x_test[held_out[~in_train] - len(dataset.y_train)],
        ]
    )
    labels = None
    if labeled:
        labels = np.concatenate(
            [
                dataset.y_train[held_out[in_train]],
                dataset.y_test[held_out[~in_train] - len(dataset.y_train)],
            ]
        )
    description = (
        f"{dataset.name} held-out pool ({size} records, {'labeled' if labeled else 'unlabeled'})"
    )
    public = PublicData(
        description,
        held_out,
        lambda: pool,
        dataset.feature_shape,
        float(values["public_val"]),
        seed,
        labels=labels,
    )
    return without_records(dataset, held_out), public
