"""The clients that join after training (`--unseen-fraction`): set aside from the federation
before any training, as the evaluation clients are, and handed back to the runner.

A fraction F of the clients, round(F * M), drawn with the harness's public stream
`SEED_UNSEEN` of the run seed among the clients that are not evaluation clients (those stay
reserved for tuning), takes no part in training: the training federation is the other
M - round(F * M) clients, in their order. The unseen clients keep their own 80/20 split;
after the last round each fine-tunes on its training split and is evaluated on its test
split (`p4bench.run.unseen`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from p4bench.config import RunConfig
from p4bench.data.federated import ClientTensors, FederatedData
from p4bench.errors import UsageError
from p4bench.rng import harness_rng

__all__ = ["SEED_UNSEEN", "client_subset", "split_unseen", "unseen_count"]

SEED_UNSEEN = 19  # harness stream choosing them (rng.py: 7, 11; public data 13; global test 17)


def unseen_count(config: RunConfig) -> int:
    """How many of the run's clients are unseen: round(F * M)."""
    return int(round(config.unseen_fraction * config.clients))


def client_subset(data: FederatedData, index: torch.Tensor) -> FederatedData:
    """The federation of `data`'s clients at `index`, in that order: their own train and
    test tensors (copies, trimmed to the longest kept client), roles and pooled indices."""

    def keep(tensors: ClientTensors) -> ClientTensors:
        n = tensors.n[index.to(tensors.n.device)].clone()
        width = int(n.max()) if len(n) else 0
        return ClientTensors(
            tensors.x[index.to(tensors.x.device), :width].clone(),
            tensors.y[index.to(tensors.y.device), :width].clone(),
            n,
        )

    return dataclasses.replace(
        data,
        train=keep(data.train),
        test=keep(data.test),
        evaluation=data.evaluation[index.to(data.evaluation.device)].clone(),
        client_indices=tuple(data.client_indices[int(i)] for i in index),
    )


def split_unseen(data: FederatedData, config: RunConfig) -> tuple[FederatedData, FederatedData]:
    """(the training federation, the unseen clients) of `data`, a federation of
    `config.clients` clients; a UsageError where the fraction leaves too few of either."""
    count = unseen_count(config)
    candidates = np.flatnonzero(~data.evaluation.cpu().numpy())
    if count < 1 or count > len(candidates) or data.num_clients - count < 2:
        raise UsageError(
            f"--unseen-fraction {config.unseen_fraction:g} of {config.clients} clients gives "
            f"{count} unseen clients; it needs at least 1, at most the {len(candidates)} "
            "non-evaluation clients, and leaves at least 2 to train"
        )
    chosen = np.sort(harness_rng(config.seed, SEED_UNSEEN).permutation(candidates)[:count])
    unseen = np.zeros(data.num_clients, dtype=bool)
    unseen[chosen] = True
    trained = client_subset(data, torch.from_numpy(np.flatnonzero(~unseen)))
    return trained, client_subset(data, torch.from_numpy(chosen))
