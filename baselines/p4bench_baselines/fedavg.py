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

Aggregation weights (option `weighting`): `records`, the sample-weighted average above,
with each client's record count n_i declared in its first upload and then fixed: the
server weights with what it recorded then, never with what the current message says,
and rejects an upload whose weight changed (`rejected changed weight from <id>`); the
receive gate holds a declared weight to [0, N]. `uniform` weights every upload 1, as
Noble et al.'s analysis assumes (their code weights by n_i). Default: `records` for
non-private runs, `uniform` for private ones, because n_i changes with one record under
add-remove: a private add-remove run with `records` is reported uncertified.

FedAvg as Karras et al. ran it (options; the defaults keep the plain SGD above, bit for
bit): `optimizer = adam` trains with Adam, its moments stacked per client and reset
every round (clients start every round from the global model, so no optimiser state
survives a round); `epochs = E` sets K = E * ceil(1 / s) local steps (an epoch is
ceil(1 / s) batches of s * n_i samples; unset: `local_steps` K); `lr_decay = gamma`
multiplies the local step size by gamma after every local epoch, restarting from eta_l
each round (the paper does not say whether the decay carries over rounds). With DP, every
step is one ledger release whatever the optimiser (`p4bench_baselines.local_optim`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import torch

from p4bench.engine import Capabilities, Exchange, LocalUpdate, Messages, Method, Phase
from p4bench.engine.declared_sizes import MAX_DECLARED_RECORDS
from p4bench.engine.messages import MODEL_PREFIX, UPDATE_PREFIX, PayloadLayout, params_layout
from p4bench.engine.method import PlannedRelease, Step, StepContext
from p4bench.engine.method_kit import pinned_declarations, power_law_weights, prefixed_vectors
from p4bench.engine.state import State, flatten, unvectorize
from p4bench.engine.training import local_sgd, noble_local_lr
from p4bench.errors import UsageError
from p4bench.models import Params
from p4bench.options import Option, resolve_options
from p4bench.rng import SERVER_ID, ClientRng
from p4bench_baselines.local_optim import LocalSchedule, local_train, steps_per_epoch

if TYPE_CHECKING:
    from p4bench.config import RunConfig
    from p4bench.data import ClientTensors

MODEL, UPDATE = MODEL_PREFIX, UPDATE_PREFIX

LR_SCALING = Option(
    "lr_scaling",
    str,
    "noble",
    "local step size: noble = lr / (max(round(K s), 1) eta_g) as Noble et al.'s code, none = lr",
    choices=("noble", "none"),
)
# FedAvg's local training as Karras et al. ran it; subclasses with their own local update
# (SCAFFOLD) declare LR_SCALING only.
LOCAL_TRAINING = (
    Option(
        "optimizer",
        str,
        "sgd",
        "local optimiser: sgd, or adam (moments per client, reset every round)",
        choices=("sgd", "adam"),
    ),
    Option(
        "epochs",
        int,
        None,
        "E local epochs per round: K = E * ceil(1/data_rate) steps (unset: local_steps)",
        low=1,
    ),
    Option(
        "lr_decay",
        float,
        1.0,
        "gamma: the local step size is multiplied by gamma after every local epoch of "
        "ceil(1/data_rate) steps, from lr again every round",
        low=0.0,
        high=1.0,
        low_open=True,
    ),
)
CLIENT_SAMPLING = Option(
    "client_sampling",
    str,
    "uniform",
    "which clients a round selects: uniform, or powerlaw "
    "(client i with weight F((i+1)/M) - F(i/M), F(x) = x^2: P4L's participation skew, a = 2; "
    "non-private runs only)",
    choices=("uniform", "powerlaw"),
)
WEIGHTING = Option(
    "weighting",
    str,
    None,
    "aggregation weights: records (n_i, declared in a client's first upload, "
    "then fixed) or uniform; default records without DP, uniform with DP (n_i changes with one "
    "record under add-remove)",
    choices=("records", "uniform"),
)


def select_clients(count: int, chosen: int, sampling: str, rng: ClientRng) -> torch.Tensor:
    """(count,) bool: the `chosen` clients of a round, drawn from the server's stream `rng`:
    uniformly without replacement, or (`powerlaw`) without replacement with the weights of
    `power_law_weights` (Efraimidis-Spirakis: the largest log(u) / w)."""
    if sampling == "powerlaw":
        weights = torch.from_numpy(power_law_weights(count))
        order = torch.argsort(
            -(rng.uniform(count)[0].double().clamp_min(1e-300).log() / weights), stable=True
        )
    else:
        order = torch.argsort(rng.bits(count)[0], stable=True)
    selected = torch.zeros(count, dtype=torch.bool)
    selected[order[:chosen]] = True
    return selected


class FedAvg(Method):
    """Server-based federated averaging with client sampling ratio l (`client_rate`)."""

    name = "fedavg"
    description = "FedAvg: sampled clients, K local steps, sample-weighted average at a server"
    capabilities = Capabilities(
        shares_individual_updates=True, has_aggregator=True, uses_server=True
    )
    options: ClassVar[tuple[Option, ...]] = (
        LR_SCALING,
        *LOCAL_TRAINING,
        WEIGHTING,
        CLIENT_SAMPLING,
        MAX_DECLARED_RECORDS,  # read by the receive gate (p4bench.engine.declared_sizes)
    )

    def validate_options(self) -> None:
        values = resolve_options(
            FedAvg.options, self.config.options
        )  # a subclass's config holds the defaults
        config, epoch = self.config, steps_per_epoch(self.config.data_rate)
        self.local_steps = (
            config.local_steps if values["epochs"] is None else int(values["epochs"]) * epoch
        )
        if values["lr_scaling"] == "none":
            self.local_lr = config.lr
        elif values["epochs"] is None:
            self.local_lr = noble_local_lr(config)
        else:  # Noble et al.'s scaling with the K the epochs give
            self.local_lr = noble_local_lr(config.replace(local_steps=self.local_steps))
        self.schedule = LocalSchedule(
            str(values["optimizer"]),
            self.local_lr,
            self.local_steps,
            epoch,
            float(values["lr_decay"]),
        )
        self.weighting = resolve_weighting(config)
        self.client_sampling = str(values["client_sampling"])
        if self.client_sampling == "powerlaw" and config.private:
            raise UsageError(
                "fedavg -o client_sampling=powerlaw is for non-private runs (P4L's FL baseline): the "
                "accountant amplifies by uniform client sampling at client_rate, which a power law is not"
            )

    def uncertified_steps(self) -> list[str]:
        return weighting_uncertified(self.config, self.weighting, self.default_neighbouring)

    def privacy_plan(self) -> list[PlannedRelease]:
        c = self.config  # the base plan with K = self.local_steps (`epochs` may set it)
        participations = math.ceil(c.client_rate * c.rounds)
        return [
            PlannedRelease(
                "train",
                c.data_rate,
                self.local_steps * participations,
                self.local_steps,
                c.rounds,
                c.client_rate,
            )
        ]

    def phases(self) -> list[Phase]:
        return [Phase("train", self.config.rounds, setup=(Exchange("broadcast"),))]

    def round_steps(self, phase: Phase, round_index: int) -> Sequence[Step]:
        return (LocalUpdate(), Exchange("upload"), Exchange("broadcast"))

    # -- clients -------------------------------------------------------------------
    def init_client_state(self, train: ClientTensors, ctx: StepContext) -> State:
        count = len(ctx.rows)
        params = {k: v.expand(count, *v.shape).clone() for k, v in self.initial_params().items()}
        return {
            "global": params,
            "params": {k: v.clone() for k, v in params.items()},
            "selected": torch.zeros(count, dtype=torch.bool),
            "num_train": train.n.clone(),
        }

    def participants(self, state: State, ctx: StepContext) -> torch.Tensor:
        selected: torch.Tensor = state["selected"]
        return selected

    def local_update(
        self, state: State, train: ClientTensors, ctx: StepContext
    ) -> tuple[State, torch.Tensor]:
        schedule = self.schedule
        if (
            schedule.optimizer == "sgd" and schedule.decay == 1.0
        ):  # the original path (fused DP-SGD when private)
            params, loss = local_sgd(ctx, state["global"], train, schedule.steps, self.local_lr)
        else:
            params, loss = local_train(ctx, state["global"], train, schedule)
        return {**state, "params": params}, loss

    def outgoing(self, exchange: str, state: State, ctx: StepContext) -> Messages:
        if exchange != "upload":
            return Messages.empty()
        chosen = state["selected"]
        delta = {
            k: state["params"][k][chosen] - state["global"][k][chosen] for k in state["params"]
        }
        payload = {
            **flatten(delta, UPDATE),
            "weight": declared_weights(self.weighting, state["num_train"][chosen]),
        }
        count = int(chosen.sum())
        return Messages(ctx.rows[chosen], torch.full((count,), SERVER_ID), payload)

    def receive(self, exchange: str, state: State, inbox: Messages, ctx: StepContext) -> State:
        if exchange != "broadcast" or not len(inbox):
            return state
        position = torch.searchsorted(ctx.rows, inbox.dst)
        model = unvectorize(
            prefixed_vectors(inbox.payload, MODEL), state["global"]
        )  # names may contain dots
        params = {k: v.clone() for k, v in state["global"].items()}
        for k in params:
            params[k][position] = model[k]
        selected = state["selected"].clone()
        selected[position] = inbox.payload["selected"].bool()
        return {
            **state,
            "global": params,
            "params": {k: v.clone() for k, v in params.items()},
            "selected": selected,
        }

    def deployed_params(self, state: State) -> Params:
        params: Params = state["global"]
        return params

    def update_reference(self, exchange: str, state: State) -> Params | None:
        reference: Params = state["global"]
        return reference if exchange == "upload" else None

    def message_layout(self, exchange: str, phase: str, round_index: int) -> PayloadLayout | None:
        """Declared: the server only receives `upload`, clients only receive `broadcast`."""
        if (
            type(self).outgoing is not FedAvg.outgoing
            or type(self).server_outgoing is not FedAvg.server_outgoing
        ):
            return (
                None  # a subclass that sends other payloads (SCAFFOLD's controls) declares its own
            )
        params = self.initial_params()
        if exchange == "upload":
            return {**params_layout(params, UPDATE_PREFIX), "weight": (torch.float64, ())}
        if exchange == "broadcast":
            return {**params_layout(params, MODEL_PREFIX), "selected": (torch.bool, ())}
        return None

    def fresh_payloads(self, exchange: str, phase: str, round_index: int) -> bool:
        """With DP every upload is a model update after noisy local steps: never repeated
        (a client whose budget refused its steps uploads a zero update, which is not judged).
        Subclasses that send other payloads declare their own."""
        return (
            exchange == "upload" and self.config.private and type(self).outgoing is FedAvg.outgoing
        )

    # -- server --------------------------------------------------------------------
    def init_server_state(self, ctx: StepContext) -> State:
        return {
            "params": {k: v.unsqueeze(0) for k, v in self.initial_params().items()},
            "declared": torch.full((self.num_clients,), float("nan"), dtype=torch.float64),
        }

    def server_outgoing(self, exchange: str, state: State, ctx: StepContext) -> Messages:
        if exchange != "broadcast":
            return Messages.empty()
        count = self.num_clients
        chosen = max(1, int(self.config.client_rate * count))
        selected = select_clients(count, chosen, self.client_sampling, ctx.rng)
        model = {k: v.expand(count, *v.shape[1:]) for k, v in state["params"].items()}
        payload = {**flatten(model, MODEL), "selected": selected}
        return Messages(torch.full((count,), SERVER_ID), torch.arange(count), payload)

    def server_receive(
        self, exchange: str, state: State, inbox: Messages, ctx: StepContext
    ) -> State:
        if exchange != "upload" or not len(inbox):
            return state
        inbox, weights, state = self.admitted_uploads(state, inbox, ctx)
        if not len(inbox):
            return state
        mean = ctx.aggregator.aggregate(inbox, weights, ctx.round)
        step = unvectorize(mean.unsqueeze(0).to(torch.float32), state["params"])
        params = {k: state["params"][k] + self.config.global_lr * step[k] for k in state["params"]}
        return {**state, "params": params}

    def admitted_uploads(
        self, state: State, inbox: Messages, ctx: StepContext
    ) -> tuple[Messages, torch.Tensor, State]:
        """(uploads kept, their aggregation weights, server state): each sender's weight is
        the one it declared in its first upload (`records`) or 1 (`uniform`); uploads whose
        weight differs from the declared one are rejected, naming the sender."""
        inbox, pinned, declared = pinned_declarations(
            state.get("declared"), inbox, ctx, self.num_clients
        )
        weights = pinned if self.weighting == "records" else torch.ones_like(pinned)
        return inbox, weights, {**state, "declared": declared}


def resolve_weighting(config: RunConfig) -> str:
    """Option `weighting`, its default by privacy (module docstring)."""
    given = WEIGHTING.resolve((config.options or {}).get("weighting"), "options.weighting")
    return str(given) if given is not None else ("uniform" if config.private else "records")


def weighting_uncertified(
    config: RunConfig, weighting: str, default_neighbouring: str
) -> list[str]:
    """Why record-count weights break a private run's epsilon, if they do."""
    relation = config.neighbouring or default_neighbouring
    if config.private and weighting == "records" and relation == "add-remove":
        return [
            "weighting=records: each upload declares the client's record count n_i, which changes with one "
            "record under add-remove and is not a DP release (use weighting=uniform, the default with DP)"
        ]
    return []


def declared_weights(weighting: str, num_train: torch.Tensor) -> torch.Tensor:
    """The weight each upload declares: its record count, or 1 (`uniform`: nothing about
    the client's records leaves it)."""
    return (
        num_train.double()
        if weighting == "records"
        else torch.ones(len(num_train), dtype=torch.float64)
    )
