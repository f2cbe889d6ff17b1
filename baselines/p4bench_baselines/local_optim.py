"""Local optimisers batched over clients: SGD or Adam, with a step size that decays once
per local epoch (FedAvg as Karras et al. ran it: E epochs of Adam, eta <- gamma eta).

Every tensor has the leading client axis of a state; Adam's moments are stacked the same
way, (C, ...) per parameter, and one step updates every row at once. Gradients come from
`batch_gradient`, so a private run takes every step through the DP mechanism (one
ledger release per step; the optimiser's arithmetic on the noisy gradient is
post-processing), and a row whose budget refuses a step leaves its parameters, moments
and step count unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from p4bench.engine.method_kit import per_row
from p4bench.engine.training import batch_gradient, gather_batch, sample_batches
from p4bench.models import Params

if TYPE_CHECKING:
    from p4bench.data import ClientTensors
    from p4bench.engine.training import TrainingContext

__all__ = [
    "ADAM_BETAS",
    "ADAM_EPS",
    "AdamMoments",
    "LocalSchedule",
    "adam_step",
    "local_train",
    "steps_per_epoch",
]

ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8  # Kingma & Ba's defaults (PyTorch's)


def steps_per_epoch(data_rate: float) -> int:
    """Batches of one local epoch: ceil(1 / s), so that E epochs visit about E * n_i
    samples of a client at batch s * n_i."""
    return max(
        1, math.ceil(1.0 / data_rate * (1 - 1e-6))
    )  # 1/0.2 is 5.000000000000001 in floats; 1/0.0133333333 is 75


@dataclass(frozen=True)
class LocalSchedule:
    """One round of local training: `steps` steps of `optimizer` ("sgd" | "adam") from
    step size `lr`, multiplied by `decay` after every `epoch` steps."""

    optimizer: str
    lr: float
    steps: int
    epoch: int
    decay: float = 1.0

    def lr_at(self, step: int) -> float:
        return self.lr * self.decay ** (step // self.epoch)


@dataclass
class AdamMoments:
    """Adam's per-row state: first and second moments (C, ...) per parameter and the (C,)
    number of steps each row has taken (for the bias corrections)."""

    m: Params
    v: Params
    t: torch.Tensor

    @staticmethod
    def zeros(params: Params) -> AdamMoments:
        count = next(iter(params.values())).shape[0]
        return AdamMoments(
            {k: torch.zeros_like(p) for k, p in params.items()},
            {k: torch.zeros_like(p) for k, p in params.items()},
            torch.zeros(count, dtype=torch.float64),
        )


def adam_step(
    params: Params,
    grads: Params,
    moments: AdamMoments,
    lr: float | torch.Tensor,
    active: torch.Tensor,
) -> tuple[Params, AdamMoments]:
    """One Adam step of every row with `active` (C,) > 0; other rows keep their
    parameters and moments. `lr` is a number or (C,) per row."""
    (b1, b2), on = ADAM_BETAS, active > 0
    t = moments.t + on.double()
    c1, c2 = 1.0 - b1 ** t.clamp_min(1.0), 1.0 - b2 ** t.clamp_min(1.0)
    rate = lr if isinstance(lr, torch.Tensor) else torch.full_like(t, float(lr))
    new_params, m, v = {}, {}, {}
    for k, p in params.items():
        g = grads[k]
        keep = per_row(on, p).bool()
        m[k] = torch.where(keep, b1 * moments.m[k] + (1 - b1) * g, moments.m[k])
        v[k] = torch.where(keep, b2 * moments.v[k] + (1 - b2) * g * g, moments.v[k])
        step = per_row(rate / c1, p) * m[k] / ((v[k] / per_row(c2, p)).sqrt() + ADAM_EPS)
        new_params[k] = torch.where(keep, p - step, p)
    return new_params, AdamMoments(m, v, t)


def local_train(
    ctx: TrainingContext, params: Params, train: ClientTensors, schedule: LocalSchedule
) -> tuple[Params, torch.Tensor]:
    """`schedule.steps` steps of every row from `params` (Adam moments start at zero: the
    clients start every round from the global model); returns the parameters and each
    row's mean loss over the steps it took. Batches as `sample_batches` draws them
    (Poisson at rate s when private, round(s n_i) without replacement otherwise)."""
    count = len(ctx.rows)
    total, taken = torch.zeros(count, dtype=torch.float64), torch.zeros(count, dtype=torch.float64)
    moments = AdamMoments.zeros(params) if schedule.optimizer == "adam" else None
    for step in range(schedule.steps):
        index, mask = sample_batches(ctx, train)
        grads, loss, done = batch_gradient(
            ctx, params, gather_batch(train.x, index), gather_batch(train.y, index), mask, train
        )
        if ctx.dp is not None and not bool(done.any()):
            break  # every row's budget is spent, as in DPMechanism.sgd
        lr = schedule.lr_at(step)
        if moments is None:
            params = {k: p - lr * grads[k] * per_row(done, p) for k, p in params.items()}
        else:
            params, moments = adam_step(params, grads, moments, lr, done)
        total += loss * done.double()
        taken += done.double()
    return params, total / taken.clamp_min(1)
