"""The global test set (`--eval global|both`): one held-out test set for every client.

Karras et al. and P4L score every client's model on one held-out test set, PDSL its
consensus model; P4 scores each client on its own test split. A global test set is
drawn before partitioning and never enters a client's data: it is the dataset's own
test split (CIFAR's and MNIST's official 10,000, digits' fixed last 20%), so the
clients share the training split alone; a dataset without a test split gives a
stratified 20% of its records instead (`GLOBAL_TEST_FRACTION`, seeded).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from p4bench.data.base import ArrayDataset
from p4bench.data.federated import ClientTensors
from p4bench.rng import harness_rng

__all__ = ["GLOBAL_TEST_FRACTION", "SEED_GLOBAL_TEST", "hold_out_global_test"]

GLOBAL_TEST_FRACTION = 0.2
SEED_GLOBAL_TEST = 17  # harness stream of the stratified hold-out (datasets without a test split)


def hold_out_global_test(dataset: ArrayDataset, seed: int) -> tuple[ArrayDataset, ClientTensors]:
    """(the dataset the clients are partitioned from, the global test set as one row
    (1, N, ...)): the dataset's test split, or a stratified `GLOBAL_TEST_FRACTION` of it
    where it has none."""
    if len(dataset.y_test):
        x, y = dataset.x_test, dataset.y_test
        rest = replace(
            dataset,
            x_test=dataset.x_test[:0],
            y_test=dataset.y_test[:0],
            writers_test=None if dataset.writers_test is None else dataset.writers_test[:0],
        )
    else:
        rng = harness_rng(seed, SEED_GLOBAL_TEST)
        held = np.zeros(len(dataset.y_train), dtype=bool)
        for label in np.unique(dataset.y_train):  # a loop over classes: the same share of each
            members = rng.permutation(np.flatnonzero(dataset.y_train == label))
            held[members[: int(round(GLOBAL_TEST_FRACTION * len(members)))]] = True
        x, y = dataset.x_train[held], dataset.y_train[held]
        rest = replace(
            dataset,
            x_train=dataset.x_train[~held],
            y_train=dataset.y_train[~held],
            writers_train=None if dataset.writers_train is None else dataset.writers_train[~held],
        )
    samples = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))[None]
    return rest, ClientTensors(
        samples, torch.from_numpy(np.asarray(y, dtype=np.int64))[None], torch.tensor([len(y)])
    )
