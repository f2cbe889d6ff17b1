"""Clients that join after training (`--unseen-fraction`): their fine-tune and report card.

The unseen clients are set aside before training (`p4bench.data.unseen`): the run trains
the other clients, whose figures (and epsilon) are the summary's as usual. After the last
round each unseen client

- starts from what a newly joining client gets, the method's `newcomer_params` of the
  trained clients' final state (default: the mean of their deployed models; P4 and
  ProxyFL: the mean of their proxies, since their private models are trained without DP
  and never leave their clients);
- fine-tunes on its own training split for `local_steps` (K) steps at the run's step size
  `lr` and data rate `data_rate`, all unseen clients batched in one call
  (`p4bench.engine.training.local_sgd`), through the DP mechanism of a private run: Poisson
  sampling, clipping to C, Gaussian noise at the run's noise multiplier, every release
  recorded in a ledger of the unseen clients (the run's accountant, delta and budget), so
  their own epsilon (`epsilon_unseen`, the largest among them) is reported apart from the
  reported clients', who spend nothing on it;
- is evaluated on its own test split: `accuracy_unseen_mean`, `_std`, `_p10`.

The training federation's clients keep their order with the unseen ones left out, and its
ids (per-client figures, clients.csv, the ledger) are theirs; the unseen clients' ids follow
(M - U .. M - 1), so their batch and noise streams are theirs alone. Verification: the
fine-tune runs after the run's own recording and the replay makes none, so the
post-processing check (`--verify full`) does not cover it; a private run's summary says so
(`unseen_fine_tune.verification`). Its releases go through the same `DPMechanism` as
training, and it sends nothing to anyone (the model stays with its client).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from p4bench.data.federated import FederatedData
from p4bench.engine.held_clients import STREAM_TRAINING
from p4bench.engine.method import StepContext
from p4bench.engine.method_kit import replicate
from p4bench.engine.threats import Aggregator
from p4bench.engine.training import accuracy, batched_loss_and_grad, local_sgd
from p4bench.privacy.groups import noise_generator
from p4bench.privacy.ledger import PrivacyLedger
from p4bench.privacy.mechanism import DPMechanism
from p4bench.privacy.noise import NoiseStreams
from p4bench.privacy.replay import replaying
from p4bench.records import Outcome
from p4bench.rng import client_rng, secret_draws
from p4bench.run.summary import spread

__all__ = ["UNSEEN_PHASE", "UNVERIFIED", "UnseenClients", "fine_tune_unseen"]

UNSEEN_PHASE = "unseen"  # the ledger's phase of the fine-tune's releases
UNVERIFIED = (
    "not covered for the unseen clients' fine-tune: it runs after the run's recording and the "
    "post-processing check does not replay it (its releases go through the same DP mechanism)"
)


@dataclass
class UnseenClients:
    """The unseen clients after their fine-tune: accuracies on their own test splits and,
    for a private run, their epsilons under the run's accountant."""

    accuracy: np.ndarray  # (U,)
    epsilon: np.ndarray | None  # (U,); None: the run is not private
    start: str  # what they started from (`Method.newcomer_start`)
    steps: int
    lr: float
    sample_rate: float
    noise_multiplier: float | None

    def summary(self) -> dict[str, Any]:
        """The summary's unseen section, in its order."""
        std, p10 = spread(self.accuracy)
        fields: dict[str, Any] = {
            "unseen_clients": len(self.accuracy),
            "accuracy_unseen_mean": float(self.accuracy.mean()),
            "accuracy_unseen_std": std,
            "accuracy_unseen_p10": p10,
        }
        if self.epsilon is not None:
            fields.update(
                epsilon_unseen=float(self.epsilon.max()),
                epsilon_unseen_mean=float(self.epsilon.mean()),
            )
        setup: dict[str, Any] = {
            "start": self.start,
            "steps": self.steps,
            "lr": self.lr,
            "sample_rate": self.sample_rate,
            "noise_multiplier": self.noise_multiplier,
        }
        if self.epsilon is not None:
            setup["verification"] = UNVERIFIED
        return fields | {"unseen_fine_tune": setup}


def fine_tune_unseen(prepared: Any, outcome: Outcome) -> UnseenClients | None:
    """Start every unseen client (`prepared.unseen`) from the method's newcomer model,
    fine-tune all of them at once on their own data (through the DP mechanism where the
    run is private) and evaluate them on their own test splits. None where the run has no
    unseen clients, or is a privacy check's replay (`p4bench.privacy.replay`: the run it
    replays made the fine-tune outside its recording, so the replay makes none)."""
    if prepared.unseen is None or replaying():
        return None
    job, ledger = prepared.job, prepared.ledger
    config, method, model = job.config, job.method, job.model
    unseen: FederatedData = prepared.unseen.to(prepared.device)
    trained, count = job.data.num_clients, unseen.num_clients
    if outcome.final_state is not None:
        start = method.newcomer_params(outcome.final_state)
        described = method.newcomer_start
    else:  # a runtime that keeps no state here: the deployed models' mean
        start = {k: v.mean(0) for k, v in outcome.final_params.items()}
        described = "the mean of the trained clients' deployed models"
    rows = torch.arange(trained, trained + count)
    secret = secret_draws(config.noise_source, False)
    own: PrivacyLedger | None = None
    dp: DPMechanism | None = None
    if ledger is not None and job.dp is not None:
        own = unseen_ledger(ledger, trained + count, config.local_steps)
        noise = NoiseStreams(
            config.seed, rows.tolist(), secure=secret, generator=noise_generator(config)
        )
        dp = DPMechanism(job.dp, noise, own.record_release, own.allowed)
    ctx = StepContext(
        config=config,
        model=model,
        phase=UNSEEN_PHASE,
        round=0,
        rows=rows.to(prepared.device),
        rng=client_rng(config.seed, rows, STREAM_TRAINING, secret),
        loss_and_grad=partial(batched_loss_and_grad, model),
        aggregator=Aggregator(None),
        num_clients=trained + count,
        dp=dp,
        train=unseen.train,
        dp_settings=job.dp,
    )
    params = replicate({k: v.to(prepared.device) for k, v in start.items()}, count)
    params, _ = local_sgd(ctx, params, unseen.train, config.local_steps, config.lr)
    scores = accuracy(model, params, unseen.test.x, unseen.test.y, unseen.test.n)
    return UnseenClients(
        accuracy=scores.cpu().numpy(),
        epsilon=None if own is None else own.epsilons()[trained:],
        start=described,
        steps=config.local_steps,
        lr=config.lr,
        sample_rate=config.data_rate,
        noise_multiplier=None if job.dp is None else job.dp.noise_multiplier,
    )


def unseen_ledger(run_ledger: PrivacyLedger, clients: int, steps: int) -> PrivacyLedger:
    """A ledger of the run's `clients` ids (the unseen ones last) with the run ledger's
    settings, accountants, delta and budget, that counts the fine-tune's releases alone."""
    context = {
        "local_steps": {UNSEEN_PHASE: steps},
        "client_rate": {UNSEEN_PHASE: 1.0},
        "clients": clients,
        "view": run_ledger.context.get("view", "third-party"),
    }
    return PrivacyLedger(
        run_ledger.settings,
        run_ledger.accountant,
        run_ledger.reference,
        clients,
        run_ledger.delta,
        run_ledger.budget,
        context,
        pld=run_ledger.pld,
    )
