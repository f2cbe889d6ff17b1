"""The Synthetic(alpha, beta) federated dataset of Li et al. (FedProx / LEAF).

Client k draws
    u_k ~ N(0, alpha),  W_k ~ N(u_k, 1)^(L x d),  b_k ~ N(u_k, 1)^L,
    B_k ~ N(0, beta),   v_k ~ N(B_k, 1)^d,        x ~ N(v_k, Sigma),
with Sigma diagonal, Sigma_jj = j^-1.2 (j = 1..d), and y = argmax softmax(W_k x + b_k).
alpha controls how much the clients' models differ, beta how much their inputs differ.
N(m, s) has variance s. Unlike the Noble et al. generator (reference notes 3.5) the
model mean u_k is a shared scalar per client, and there is no label flipping and no
in-place "standardize" step.

Each client has its own seed stream, derived from (run seed, client index), so adding
clients never changes the data of the existing ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from p4bench.data.base import ArrayDataset, Dataset
from p4bench.options import Option, resolve_options

if TYPE_CHECKING:
    from p4bench.config import RunConfig

_SEED_SYNTHETIC = 13  # separates this stream from the runner's partition/malicious streams

DEFAULT_SAMPLES = 100
# `None` defaults come from the run config.
SYNTHETIC_OPTIONS: tuple[Option, ...] = (
    Option("synthetic_alpha", float, 1.0, "alpha: how much the clients' models differ", low=0),
    Option("synthetic_beta", float, 1.0, "beta: how much the clients' inputs differ", low=0),
    Option("synthetic_dim", int, 60, "d, input features", low=1),
    Option("synthetic_classes", int, 10, "L, classes", low=2),
    Option("synthetic_clients", int, None, "generated clients; default: --clients", low=1),
    Option(
        "synthetic_samples",
        int,
        None,
        f"samples per generated client; default: --samples-per-client, else {DEFAULT_SAMPLES}",
        low=2,
    ),
    Option("synthetic_iid", bool, False, "FedProx's Synthetic-IID: one shared model, v_k = 0"),
)


def generate_synthetic(
    num_clients: int,
    samples_per_client: int,
    *,
    alpha: float = 1.0,
    beta: float = 1.0,
    dim: int = 60,
    num_classes: int = 10,
    seed: int = 0,
    iid: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x (N, dim) float32, y (N,) int64, client id (N,) int64) with N = clients x samples."""
    variances = np.arange(1, dim + 1, dtype=np.float64) ** -1.2
    shared = np.random.default_rng(np.random.SeedSequence([seed, _SEED_SYNTHETIC, 0]))
    shared_w, shared_b = (
        shared.normal(0.0, 1.0, (num_classes, dim)),
        shared.normal(0.0, 1.0, num_classes),
    )
    xs, ys = [], []
    for k in range(num_clients):
        rng = np.random.default_rng(np.random.SeedSequence([seed, _SEED_SYNTHETIC, 1, k]))
        if iid:
            w, b, v = shared_w, shared_b, np.zeros(dim)
        else:
            u = rng.normal(0.0, np.sqrt(alpha))
            w, b = rng.normal(u, 1.0, (num_classes, dim)), rng.normal(u, 1.0, num_classes)
            v = rng.normal(rng.normal(0.0, np.sqrt(beta)), 1.0, dim)
        x = v + rng.standard_normal((samples_per_client, dim)) * np.sqrt(variances)
        xs.append(x.astype(np.float32))
        ys.append(np.argmax(x @ w.T + b, axis=1).astype(np.int64))
    clients = np.repeat(np.arange(num_clients, dtype=np.int64), samples_per_client)
    return np.concatenate(xs), np.concatenate(ys), clients


def synthetic_options(config: RunConfig | None) -> dict[str, Any]:
    """The generator's parameters from `config.options` (SYNTHETIC_OPTIONS)."""
    from p4bench.config import RunConfig

    config = config or RunConfig()
    values: dict[str, Any] = resolve_options(SYNTHETIC_OPTIONS, config.options)
    values["synthetic_clients"] = values["synthetic_clients"] or config.clients
    values["synthetic_samples"] = (
        values["synthetic_samples"] or config.samples_per_client or DEFAULT_SAMPLES
    )
    values["seed"] = config.seed
    return values


class SyntheticDataset(Dataset):
    """Synthetic(alpha, beta) of Li et al.: one generated distribution per client, no files.

    Reads `config.options` (see SYNTHETIC_OPTIONS), `config.seed`, `config.clients`
    and `config.samples_per_client`. Each client's samples are split 80/20 into the
    train/test arrays; writer ids are the generating client's index, so the `natural`
    partitioner gives every client its own distribution.
    """

    name = "synthetic"
    description = "Synthetic(alpha, beta) of Li et al. (FedProx), generated from the seed; client ids as writers"
    uses_run_config = True
    options = SYNTHETIC_OPTIONS

    def load(self, data_dir: Path, config: RunConfig | None = None) -> ArrayDataset:
        o = synthetic_options(config)
        samples = o["synthetic_samples"]
        x, y, clients = generate_synthetic(
            o["synthetic_clients"],
            samples,
            alpha=o["synthetic_alpha"],
            beta=o["synthetic_beta"],
            dim=o["synthetic_dim"],
            num_classes=o["synthetic_classes"],
            seed=o["seed"],
            iid=o["synthetic_iid"],
        )
        is_test = np.tile(
            np.arange(samples) >= samples - max(1, samples // 5), o["synthetic_clients"]
        )
        names = tuple(str(c) for c in range(o["synthetic_classes"]))
        return ArrayDataset(
            self.name,
            x[~is_test],
            y[~is_test],
            x[is_test],
            y[is_test],
            names,
            writers_train=clients[~is_test],
            writers_test=clients[is_test],
        )
