"""FedDF (Lin et al. 2020, as Karras et al. ran it): FedAvg's clients, and a server that
fuses the received models by ensemble distillation on unlabeled public data.

Clients are FedAvg's (sampled clients, local training from the global model, every
FedAvg option: `optimizer`, `epochs`, `lr_decay`, `lr_scaling`). Each round the server

1. initialises the student as FedAvg would set the global model: the sample-weighted
   average of the received models, through the run's defense (FedDF's original choice;
   `distill_init = global` starts from the previous global model instead);
2. takes up to `distill_steps` Adam steps (lr `distill_lr`, cosine annealing over the
   `distill_steps`) on batches of `distill_batch` inputs drawn uniformly (with
   replacement) from U_train, minimising KL(p || q) with p = softmax(mean_k logits_k(x)
   / T) over the S received models (the teachers; with a filtering defense, the ones it
   kept) and q = softmax(student(x) / T), scaled by T^2 (T = `distill_temperature`, 1 by
   default);
3. every `distill_eval_every` steps evaluates the same KL on U_val and stops when it did
   not fall; the global model is the student with the lowest U_val KL seen (the starting
   one included).

The paper's budget is 10,000 steps with a check every 1,000; the defaults here (500,
every 100) suit the small digits pool. The teachers' logits of a batch are one batched
call over the stacked received models (computed once per round for all of U_train when
the steps visit it at least once: the teachers do not change). Batches come from a
public stream of the seed and round, so the server's client selection draws are
FedAvg's and every runtime agrees. Per round the server reports `server_distill_steps`, `server_distill_seconds` (its
compute time: averaging and distillation) and `server_distill_val_kl`.

Public data (`p4bench.data.public`): a held-out pool of the dataset's records that no
client holds, or the dataset's declared public source (cifar10: CIFAR-100 images).

Privacy: the clients' DP is FedAvg's (every local step a ledger release). The server
reads only the clients' released (noisy) models and public data, so distillation is
post-processing: it needs no ledger entry and the run's epsilon stays certified.
"""

from __future__ import annotations

import math
import time
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import vmap

from p4bench.data.public import PUBLIC_DATA_OPTIONS
from p4bench.engine.messages import Messages
from p4bench.engine.method import StepContext
from p4bench.engine.method_kit import prefixed_vectors
from p4bench.engine.state import State, unvectorize, vectorize
from p4bench.engine.training import PerExampleLoss, batched_loss_and_grad
from p4bench.errors import UsageError
from p4bench.models import Model, Params
from p4bench.options import Option, resolve_options
from p4bench_baselines.fedavg import UPDATE, FedAvg
from p4bench_baselines.local_optim import AdamMoments, adam_step

__all__ = ["FedDF", "distill", "ensemble_kl"]

_DISTILL_STREAM = (
    19  # public stream of the server's U_train batches (baselines.common uses 17 for graphs)
)
_CHUNK = 1024  # U_val inputs per forward pass


def ensemble_kl(temperature: float) -> PerExampleLoss:
    """Per-example T^2 KL(softmax(teacher / T) || softmax(student / T)); the teachers' mean
    logits come as the auxiliary input (`p4bench.engine.training.PerExampleLoss`)."""

    def loss(
        logits: torch.Tensor, labels: torch.Tensor, teacher: torch.Tensor | None
    ) -> torch.Tensor:
        assert teacher is not None
        target = F.log_softmax(teacher / temperature, dim=-1)
        return (target.exp() * (target - F.log_softmax(logits / temperature, dim=-1))).sum(
            -1
        ) * temperature**2

    return loss


class FedDF(FedAvg):
    """FedAvg with server-side ensemble distillation on public unlabeled data."""

    name = "feddf"
    description = (
        "FedDF (Lin et al.): FedAvg's clients; the server distils the received models' ensemble "
        "on public data"
    )
    capabilities = FedAvg.capabilities
    needs_public_data = True
    options: ClassVar[tuple[Option, ...]] = FedAvg.options + (
        Option(
            "distill_steps",
            int,
            500,
            "most server distillation steps per round (paper: 10000)",
            low=0,
        ),
        Option(
            "distill_eval_every",
            int,
            100,
            "steps between U_val checks; distillation stops when the U_val KL did "
            "not fall (paper: 1000)",
            low=1,
        ),
        Option(
            "distill_batch",
            int,
            128,
            "public inputs per distillation step",
            low=1,
            paper="FedDF, 128",
        ),
        Option(
            "distill_lr",
            float,
            1e-3,
            "Adam step size of the distillation, cosine-annealed over distill_steps",
            low=0.0,
            low_open=True,
            paper="FedDF, Adam 1e-3 cosine",
        ),
        Option(
            "distill_temperature",
            float,
            1.0,
            "softmax temperature T of teachers and student",
            low=0.0,
            low_open=True,
        ),
        Option(
            "distill_init",
            str,
            "average",
            "student start: average = the FedAvg average of the received models "
            "(FedDF), global = the previous global model",
            choices=("average", "global"),
            paper="FedDF, Alg. 1",
        ),
        *PUBLIC_DATA_OPTIONS,
    )

    def validate_options(self) -> None:
        super().validate_options()
        values = resolve_options(FedDF.options, self.config.options)
        self.distill_steps = int(values["distill_steps"])
        self.eval_every = int(values["distill_eval_every"])
        self.batch = int(values["distill_batch"])
        self.distill_lr = float(values["distill_lr"])
        self.temperature = float(values["distill_temperature"])
        self.init = str(
            values["distill_init"]
        )  # average: FedAvg's new global model (global_lr applies)

    def server_receive(
        self, exchange: str, state: State, inbox: Messages, ctx: StepContext
    ) -> State:
        if exchange != "upload" or not len(inbox):
            return state
        if self.public_data is None:
            raise UsageError(
                "feddf needs public data: run it through p4bench.run.runner.prepare, which sets public_data"
            )
        started = time.perf_counter()
        logged = len(ctx.aggregator.log)
        averaged = super().server_receive(exchange, state, inbox, ctx)[
            "params"
        ]  # the defense acts here
        dropped = [
            s for _, _, lost in ctx.aggregator.log[logged:] for s in lost
        ]  # a filtering defense's verdict
        keep = ~torch.isin(inbox.src, torch.tensor(dropped, dtype=inbox.src.dtype))
        if not bool(keep.any()):
            keep[:] = True
        reference = vectorize(
            state["params"]
        )  # (1, P): the global model the updates are deltas from
        teachers = unvectorize(
            reference + prefixed_vectors(inbox.payload, UPDATE)[keep].to(reference.dtype),
            state["params"],
        )
        start = averaged if self.init == "average" else state["params"]
        u_train, u_val = self.public_data.splits()
        seed = np.random.SeedSequence(
            [self.config.seed, _DISTILL_STREAM, max(ctx.round, 0)]
        ).generate_state(1, np.uint64)[0]
        student, steps, kl = distill(
            self.model,
            start,
            teachers,
            u_train,
            u_val,
            steps=self.distill_steps,
            eval_every=self.eval_every,
            batch=self.batch,
            lr=self.distill_lr,
            temperature=self.temperature,
            generator=torch.Generator().manual_seed(int(seed) & (2**63 - 1)),
        )
        ctx.metrics.update(
            {
                "server_distill_steps": float(steps),
                "server_distill_val_kl": kl,
                "server_distill_seconds": time.perf_counter() - started,
            }
        )
        return {**state, "params": student}


@torch.no_grad()
def _teacher_logits(model: Model, teachers: Params, x: torch.Tensor) -> torch.Tensor:
    """(b, L): the mean over the stacked teachers (S, ...) of their logits on x, one batched call."""
    return vmap(model.forward, in_dims=(0, None))(teachers, x).mean(dim=0)


def _all_teacher_logits(model: Model, teachers: Params, x: torch.Tensor) -> torch.Tensor:
    return torch.cat(
        [_teacher_logits(model, teachers, x[i : i + _CHUNK]) for i in range(0, len(x), _CHUNK)]
    )


@torch.no_grad()
def _validation_kl(
    model: Model, student: Params, targets: torch.Tensor, u_val: torch.Tensor, temperature: float
) -> float:
    loss, single = ensemble_kl(temperature), {k: v[0] for k, v in student.items()}
    total = 0.0
    for start in range(0, len(u_val), _CHUNK):
        logits = model.forward(single, u_val[start : start + _CHUNK])
        total += float(loss(logits, torch.zeros(0), targets[start : start + _CHUNK]).sum())
    return total / max(len(u_val), 1)


def distill(
    model: Model,
    student: Params,
    teachers: Params,
    u_train: torch.Tensor,
    u_val: torch.Tensor,
    *,
    steps: int,
    eval_every: int,
    batch: int,
    lr: float,
    temperature: float,
    generator: torch.Generator,
) -> tuple[Params, int, float]:
    """Ensemble distillation of the stacked `teachers` (S, ...) into `student` (1, ...):
    Adam with cosine-annealed `lr`, early stopping on the U_val KL. Returns (the student
    with the lowest U_val KL seen, steps taken, that KL)."""
    targets = _all_teacher_logits(model, teachers, u_val)
    # the teachers are fixed for the round: when the steps would visit U_train at least once,
    # their logits on all of it cost less computed once than batch by batch
    train_targets = (
        _all_teacher_logits(model, teachers, u_train) if steps * batch >= len(u_train) else None
    )
    best, best_kl = student, _validation_kl(model, student, targets, u_val, temperature)
    moments, active = AdamMoments.zeros(student), torch.ones(1)
    loss, labels, weight = (
        ensemble_kl(temperature),
        torch.zeros(1, batch, dtype=torch.long),
        torch.ones(1, batch),
    )
    taken, last_kl = 0, best_kl
    # the batches' indices are drawn on the host (the generator's numbers on every device),
    # one block per `eval_every` steps (the same sequence as one draw per step), and moved
    # to U_train's device in one copy per block
    block, draws = min(eval_every, steps), torch.empty(0, batch, dtype=torch.long)
    for step in range(steps):
        if step % block == 0:
            shape = (min(block, steps - step), batch)
            draws = torch.randint(len(u_train), shape, generator=generator, device="cpu").to(
                u_train.device
            )
        index = draws[step % block]
        x = u_train[index]
        target = (
            train_targets[index]
            if train_targets is not None
            else _teacher_logits(model, teachers, x)
        )
        # the server's one model, computed the same way in every runtime (not ctx.loss_and_grad)
        _, grads = batched_loss_and_grad(
            model, student, x.unsqueeze(0), labels, weight, loss=loss, aux=target.unsqueeze(0)
        )
        rate = lr * 0.5 * (1.0 + math.cos(math.pi * step / steps))
        student, moments = adam_step(student, grads, moments, rate, active)
        taken = step + 1
        if taken % eval_every == 0 or taken == steps:
            last_kl = _validation_kl(model, student, targets, u_val, temperature)
            if not last_kl < best_kl:
                break  # the validation KL did not fall: stop (the best student so far is kept)
            best, best_kl = student, last_kl
    return best, taken, best_kl
