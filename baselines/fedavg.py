"""FedAvg (McMahan et al.): a server samples clients, they run K local steps, the server
averages their updates weighted by local training-set size.

Round structure, as in Noble et al.'s reference code: the selected clients train from
the current global model, upload their update Delta_i, the server applies
x <- x + eta_g * sum_i (n_i / sum_j n_j) Delta_i (through the run's defense, if any) and
broadcasts the new model with the next round's selection. The deployed model of every
client is the global model.

DP-FedAvg as in Noble et al.: with a target epsilon every local step is a DP-SGD step
(Poisson rate s). Privacy is counted against the server, which sees individual
updates: the rdp/prv ledger counts every step a client takes, with no amplification
from client sampling. The local step size follows Noble et al.'s code,
eta_l = lr / (max(round(K * s), 1) * eta_g) (option lr_scaling = noble, the default, as
P4 does); lr_scaling = none uses eta_l = lr.

FedAvg as Karras et al. ran it (options; the defaults keep the plain SGD above, bit for
bit): `optimizer = adam` trains with Adam, its moments stacked per client and reset
every round (clients start every round from the global model, so no optimiser state
survives a round); `epochs = E` sets K = E * ceil(1 / s) local steps (an epoch is
ceil(1 / s) batches of s * n_i samples; unset: `local_steps` K); `lr_decay = gamma`
multiplies the local step size by gamma after every local epoch, restarting from eta_l
each round (the paper does not say whether the decay carries over rounds). With DP, every
step is one ledger release whatever the optimiser (`p4bench.baselines.local_optim`).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from p4bench.baselines.common import prefixed_vectors
from p4bench.baselines.local_optim import LocalSchedule, local_train, steps_per_epoch
from p4bench.engine import Capabilities, Exchange, LocalUpdate, Messages, Method, Phase
from p4bench.engine.messages import MODEL_PREFIX, UPDATE_PREFIX, params_layout
from p4bench.engine.method import PlannedRelease
from p4bench.engine.state import flatten, unvectorize
from p4bench.engine.training import local_sgd, noble_local_lr
from p4bench.options import Option, resolve_options
from p4bench.rng import SERVER_ID

MODEL, UPDATE = MODEL_PREFIX, UPDATE_PREFIX

LR_SCALING = Option("lr_scaling", str, "noble", "local step size: noble = lr / (max(round(K s), 1) eta_g) as Noble et "
                    "al.'s code, none = lr", choices=("noble", "none"))
# FedAvg's local training as Karras et al. ran it; subclasses with their own local update
# (SCAFFOLD) declare LR_SCALING only.
LOCAL_TRAINING = (
    Option("optimizer", str, "sgd", "local optimiser: sgd, or adam (moments per client, reset every round)",
           choices=("sgd", "adam")),
    Option("epochs", int, None, "E local epochs per round: K = E * ceil(1/data_rate) steps (unset: local_steps)", low=1),
    Option("lr_decay", float, 1.0, "gamma: the local step size is multiplied by gamma after every local epoch of "
           "ceil(1/data_rate) steps, from lr again every round", low=0.0, high=1.0, low_open=True),
)


class FedAvg(Method):
    """Server-based federated averaging with client sampling ratio l (`client_rate`)."""

    name = "fedavg"
    description = "FedAvg: sampled clients, K local steps, sample-weighted average at a server"
    capabilities = Capabilities(shares_individual_updates=True, has_aggregator=True, uses_server=True)
    options: ClassVar[tuple[Option, ...]] = (LR_SCALING, *LOCAL_TRAINING)

    def validate_options(self) -> None:
        values = resolve_options(FedAvg.options, self.config.options)  # a subclass's config holds the defaults
        config, epoch = self.config, steps_per_epoch(self.config.data_rate)
        self.local_steps = config.local_steps if values["epochs"] is None else int(values["epochs"]) * epoch
        if values["lr_scaling"] == "none":
            self.local_lr = config.lr
        elif values["epochs"] is None:
            self.local_lr = noble_local_lr(config)
        else:  # Noble et al.'s scaling with the K the epochs give
            self.local_lr = noble_local_lr(config.replace(local_steps=self.local_steps))
        self.schedule = LocalSchedule(str(values["optimizer"]), self.local_lr, self.local_steps, epoch,
                                      float(values["lr_decay"]))

    def privacy_plan(self):
        c = self.config  # the base plan with K = self.local_steps (`epochs` may set it)
        participations = math.ceil(c.client_rate * c.rounds)
        return [PlannedRelease("train", c.data_rate, self.local_steps * participations, self.local_steps, c.rounds,
                               c.client_rate)]

    def phases(self):
        return [Phase("train", self.config.rounds, setup=(Exchange("broadcast"),))]

    def round_steps(self, phase, round_index):
        return (LocalUpdate(), Exchange("upload"), Exchange("broadcast"))

    # -- clients -------------------------------------------------------------------
    def init_client_state(self, train, ctx):
        count = len(ctx.rows)
        params = {k: v.expand(count, *v.shape).clone() for k, v in self.initial_params().items()}
        return {
            "global": params,
            "params": {k: v.clone() for k, v in params.items()},
            "selected": torch.zeros(count, dtype=torch.bool),
            "num_train": train.n.clone(),
        }

    def participants(self, state, ctx):
        return state["selected"]

    def local_update(self, state, train, ctx):
        schedule = self.schedule
        if schedule.optimizer == "sgd" and schedule.decay == 1.0:  # the original path (fused DP-SGD when private)
            params, loss = local_sgd(ctx, state["global"], train, schedule.steps, self.local_lr)
        else:
            params, loss = local_train(ctx, state["global"], train, schedule)
        return {**state, "params": params}, loss

    def outgoing(self, exchange, state, ctx):
        if exchange != "upload":
            return Messages.empty()
        chosen = state["selected"]
        delta = {k: state["params"][k][chosen] - state["global"][k][chosen] for k in state["params"]}
        payload = {**flatten(delta, UPDATE), "weight": state["num_train"][chosen].double()}
        count = int(chosen.sum())
        return Messages(ctx.rows[chosen], torch.full((count,), SERVER_ID), payload)

    def receive(self, exchange, state, inbox, ctx):
        if exchange != "broadcast" or not len(inbox):
            return state
        position = torch.searchsorted(ctx.rows, inbox.dst)
        model = unvectorize(prefixed_vectors(inbox.payload, MODEL), state["global"])  # names may contain dots
        params = {k: v.clone() for k, v in state["global"].items()}
        for k in params:
            params[k][position] = model[k]
        selected = state["selected"].clone()
        selected[position] = inbox.payload["selected"].bool()
        return {**state, "global": params, "params": {k: v.clone() for k, v in params.items()}, "selected": selected}

    def deployed_params(self, state):
        return state["global"]

    def update_reference(self, exchange, state):
        return state["global"] if exchange == "upload" else None

    def message_layout(self, exchange, phase, round_index):
        """Declared: the server only receives `upload`, clients only receive `broadcast`."""
        if type(self).outgoing is not FedAvg.outgoing or type(self).server_outgoing is not FedAvg.server_outgoing:
            return None  # a subclass that sends other payloads (SCAFFOLD's controls) declares its own
        params = self.initial_params()
        if exchange == "upload":
            return {**params_layout(params, UPDATE_PREFIX), "weight": (torch.float64, ())}
        if exchange == "broadcast":
            return {**params_layout(params, MODEL_PREFIX), "selected": (torch.bool, ())}
        return None

    # -- server --------------------------------------------------------------------
    def init_server_state(self, ctx):
        return {"params": {k: v.unsqueeze(0) for k, v in self.initial_params().items()}}

    def server_outgoing(self, exchange, state, ctx):
        if exchange != "broadcast":
            return Messages.empty()
        count = self.num_clients
        chosen = max(1, int(self.config.client_rate * count))
        order = torch.argsort(ctx.rng.bits(count)[0], stable=True)
        selected = torch.zeros(count, dtype=torch.bool)
        selected[order[:chosen]] = True
        model = {k: v.expand(count, *v.shape[1:]) for k, v in state["params"].items()}
        payload = {**flatten(model, MODEL), "selected": selected}
        return Messages(torch.full((count,), SERVER_ID), torch.arange(count), payload)

    def server_receive(self, exchange, state, inbox, ctx):
        if exchange != "upload" or not len(inbox):
            return state
        mean = ctx.aggregator.aggregate(inbox, inbox.payload["weight"], ctx.round)
        step = unvectorize(mean.unsqueeze(0).to(torch.float32), state["params"])
        params = {k: state["params"][k] + self.config.global_lr * step[k] for k in state["params"]}
        return {**state, "params": params}
