"""DP-SCAFFOLD (Noble, Bellet & Dieuleveut, AISTATS 2022; SCAFFOLD of Karimireddy et
al. with Option II control variates).

Round structure as FedAvg (server samples a fraction l of clients; eta_l = lr /
(max(round(K s), 1) eta_g) as in Noble et al.'s code). A selected client i starts from
the global model x and, for K steps, takes
    y <- y - eta_l (g_i(y) + c - c_i)
where g_i is a (DP-)mean gradient on a batch of rate s. The correction is added after
the noise, so it is post-processing. Then, with K' steps actually taken (K unless the
budget stopped the client),
    Delta_i = y - x,   c_i+ = c_i - c - Delta_i / (K' eta_l)          (Option II)
the client uploads Delta_i and Delta c_i = c_i+ - c_i, and the server does
    x <- x + eta_g sum_i (n_i / sum_j n_j) Delta_i     (through the run's defense; FedAvg's `weighting`)
    c <- c + (1 / M) sum_i Delta c_i                  (the senders the defense kept)
and broadcasts x, c with the next round's selection. The same control update is used
with and without DP; option control_update = noble-code multiplies Delta_i / (K' eta_l)
by s in non-private runs, as that code's non-DP path does (to reproduce its numbers).

Option warm_start (default false): a phase "warmup" of one round before training in
which every client sets c_i to the mean of K (DP-)gradients at x_0 and sends it; the
server sets c = mean of the c_i. Those K releases per client are in the privacy plan
and the ledger (the authors' warm start is neither counted nor, in their DP code,
working). Simplification: every client joins the warm-up round at once, where the
authors collect c_i over the first round(4/l) rounds as clients are sampled.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from p4bench.engine import Capabilities, Exchange, LocalUpdate, Messages, Phase
from p4bench.engine.declared_sizes import MAX_DECLARED_RECORDS
from p4bench.engine.messages import MODEL_PREFIX, UPDATE_PREFIX
from p4bench.engine.method import PlannedRelease, Step, StepContext
from p4bench.engine.method_kit import draw_batch, per_row, unpack
from p4bench.engine.state import State, flatten
from p4bench.engine.training import batch_gradient
from p4bench.models import Params
from p4bench.options import Option, resolve_options
from p4bench.rng import SERVER_ID
from p4bench_baselines.fedavg import LR_SCALING, WEIGHTING, FedAvg, declared_weights

if TYPE_CHECKING:
    from p4bench.data import ClientTensors

MODEL, UPDATE, CONTROL = MODEL_PREFIX, UPDATE_PREFIX, "control."
WARMUP, TRAIN = "warmup", "train"


def _zeros_like(params: Params) -> Params:
    return {k: torch.zeros_like(v) for k, v in params.items()}


class Scaffold(FedAvg):
    """Server-based SCAFFOLD with control variates (options in the module docstring)."""

    name = "scaffold"
    description = "DP-SCAFFOLD (Noble et al.): FedAvg with Option II control variates; optional counted warm start"
    capabilities = Capabilities(
        shares_individual_updates=True, has_aggregator=True, uses_server=True
    )
    options = (  # FedAvg's lr_scaling; its local optimiser options do not apply to SCAFFOLD's own update
        LR_SCALING,
        Option(
            "warm_start",
            bool,
            False,
            "a counted warm-up round that sets the control variates c_i and c",
        ),
        Option(
            "control_update",
            str,
            "paper",
            "Option II control update; noble-code scales Delta_i / (K' eta_l) by "
            "s in non-private runs, as that code does",
            choices=("paper", "noble-code"),
        ),
        WEIGHTING,
        MAX_DECLARED_RECORDS,  # read by the receive gate (p4bench.engine.declared_sizes)
    )

    def validate_options(self) -> None:
        super().validate_options()
        values = resolve_options(self.options, self.config.options)
        self.warm_start, self.control_update = values["warm_start"], values["control_update"]

    # -- schedule ----------------------------------------------------------------------
    def phases(self) -> list[Phase]:
        train = Phase(TRAIN, self.config.rounds, setup=(Exchange("broadcast"),))
        if not self.warm_start:
            return [train]
        return [Phase(WARMUP, 1, setup=(Exchange("broadcast"),)), Phase(TRAIN, self.config.rounds)]

    def round_steps(self, phase: Phase, round_index: int) -> Sequence[Step]:
        if phase.name == WARMUP:
            return (LocalUpdate(), Exchange("controls"), Exchange("broadcast"))
        return (LocalUpdate(), Exchange("upload"), Exchange("broadcast"))

    def privacy_plan(self) -> list[PlannedRelease]:
        plan = list(super().privacy_plan())
        if self.warm_start:
            k = self.config.local_steps
            plan.insert(0, PlannedRelease(WARMUP, self.config.data_rate, k, k, 1, 1.0))
        return plan

    # -- clients -------------------------------------------------------------------------
    def init_client_state(self, train: ClientTensors, ctx: StepContext) -> State:
        state = super().init_client_state(train, ctx)
        zeros = _zeros_like(state["global"])
        return {
            **state,
            "control": zeros,
            "server_control": dict(zeros),
            "control_delta": dict(zeros),
            "trained": torch.zeros(len(ctx.rows), dtype=torch.bool),
        }

    def participants(self, state: State, ctx: StepContext) -> torch.Tensor:
        if ctx.phase == WARMUP:
            return torch.ones(len(ctx.rows), dtype=torch.bool)
        return super().participants(state, ctx)

    def local_update(
        self, state: State, train: ClientTensors, ctx: StepContext
    ) -> tuple[State, torch.Tensor]:
        if ctx.phase == WARMUP:
            return self._warm_controls(state, train, ctx)
        x, c, c_i = state["global"], state["server_control"], state["control"]
        y = {k: v.clone() for k, v in x.items()}
        total, taken = torch.zeros(len(ctx.rows), dtype=torch.float64), torch.zeros(len(ctx.rows))
        for _ in range(self.config.local_steps):
            bx, by, mask = draw_batch(ctx, train)
            grads, loss, done = batch_gradient(ctx, y, bx, by, mask, train)
            y = {
                k: y[k] - self.local_lr * (grads[k] + c[k] - c_i[k]) * per_row(done, y[k])
                for k in y
            }
            total, taken = total + loss * done, taken + done
        factor = (
            self.config.data_rate
            if (self.control_update == "noble-code" and ctx.dp is None)
            else 1.0
        )
        trained = taken > 0
        scale = factor / (taken.clamp_min(1) * self.local_lr)
        new_control: Params = {}
        for k in y:
            candidate = c_i[k] - c[k] - (y[k] - x[k]) * per_row(scale, y[k])
            new_control[k] = torch.where(per_row(trained, y[k]).bool(), candidate, c_i[k])
        delta = {k: new_control[k] - c_i[k] for k in y}
        state = {
            **state,
            "params": y,
            "control": new_control,
            "control_delta": delta,
            "trained": trained,
        }
        return state, total / taken.clamp_min(1)

    def _warm_controls(
        self, state: State, train: ClientTensors, ctx: StepContext
    ) -> tuple[State, torch.Tensor]:
        """c_i <- mean of K (DP-)gradients at the initial model (released to the server)."""
        x = state["global"]
        total = _zeros_like(x)
        loss_sum, taken = (
            torch.zeros(len(ctx.rows), dtype=torch.float64),
            torch.zeros(len(ctx.rows)),
        )
        for _ in range(self.config.local_steps):
            bx, by, mask = draw_batch(ctx, train)
            grads, loss, done = batch_gradient(ctx, x, bx, by, mask, train)
            total = {k: total[k] + grads[k] * per_row(done, grads[k]) for k in total}
            loss_sum, taken = loss_sum + loss * done, taken + done
        control = {k: v / per_row(taken.clamp_min(1), v) for k, v in total.items()}
        return {**state, "control": control, "trained": taken > 0}, loss_sum / taken.clamp_min(1)

    def outgoing(self, exchange: str, state: State, ctx: StepContext) -> Messages:
        if exchange == "controls":
            chosen = state["trained"]
            payload = flatten({k: v[chosen] for k, v in state["control"].items()}, CONTROL)
            return Messages(ctx.rows[chosen], torch.full((int(chosen.sum()),), SERVER_ID), payload)
        if exchange != "upload":
            return Messages.empty()
        chosen = state["selected"] & state["trained"]
        delta = {
            k: state["params"][k][chosen] - state["global"][k][chosen] for k in state["params"]
        }
        payload = {
            **flatten(delta, UPDATE),
            **flatten({k: v[chosen] for k, v in state["control_delta"].items()}, CONTROL),
            "weight": declared_weights(self.weighting, state["num_train"][chosen]),
        }
        return Messages(ctx.rows[chosen], torch.full((int(chosen.sum()),), SERVER_ID), payload)

    def receive(self, exchange: str, state: State, inbox: Messages, ctx: StepContext) -> State:
        if exchange != "broadcast" or not len(inbox):
            return state
        state = super().receive(exchange, state, inbox, ctx)
        position = torch.searchsorted(ctx.rows, inbox.dst)
        control = unpack(inbox.payload, CONTROL, state["server_control"])
        server_control = {k: v.clone() for k, v in state["server_control"].items()}
        for k in server_control:
            server_control[k][position] = control[k]
        return {**state, "server_control": server_control}

    # -- server ----------------------------------------------------------------------------
    def init_server_state(self, ctx: StepContext) -> State:
        state = super().init_server_state(ctx)
        return {**state, "control": _zeros_like(state["params"])}

    def server_outgoing(self, exchange: str, state: State, ctx: StepContext) -> Messages:
        messages = super().server_outgoing(exchange, state, ctx)
        if not len(messages):
            return messages
        control = {k: v.expand(len(messages), *v.shape[1:]) for k, v in state["control"].items()}
        return Messages(
            messages.src, messages.dst, {**messages.payload, **flatten(control, CONTROL)}
        )

    def server_receive(
        self, exchange: str, state: State, inbox: Messages, ctx: StepContext
    ) -> State:
        if not len(inbox):
            return state
        if exchange == "controls":  # warm start: c = (1/M) sum_i c_i
            received = unpack(inbox.payload, CONTROL, state["control"])
            control = {
                k: v.sum(dim=0, keepdim=True) / self.num_clients for k, v in received.items()
            }
            return {**state, "control": control}
        if exchange != "upload":
            return state
        inbox, _, state = self.admitted_uploads(
            state, inbox, ctx
        )  # a changed weight drops the controls too
        if not len(inbox):
            return state
        logged = len(ctx.aggregator.log)
        state = super().server_receive(exchange, state, inbox, ctx)
        kept = torch.ones(len(inbox), dtype=torch.bool)
        if (
            len(ctx.aggregator.log) > logged
        ):  # a defense filtered the model updates: drop the same controls
            kept = torch.isin(inbox.src, torch.tensor(ctx.aggregator.log[-1][1], dtype=torch.int64))
        deltas = unpack(inbox.payload, CONTROL, state["control"])
        control = {
            k: state["control"][k]
            + (deltas[k] * per_row(kept, deltas[k])).sum(dim=0, keepdim=True) / self.num_clients
            for k in state["control"]
        }
        return {**state, "control": control}


__all__ = ["Scaffold"]
