"""P2P federated learning with validation-weighted personal averages (Karras et al.,
"Peer to Peer Federated Learning", Algorithms 2 and 3): method `p2p-fl`.

Every round r, every client i
1. (r >= 1) receives the models all clients sent after the previous round's training,
   scores each of them and its own on its validation split V_i and builds its personal
   average W_i,avg with the LocalAverage policy (`p4bench_p2p_fl.policies`),
   combined through `ctx.aggregator` (a run's defense filters there); W_i,avg is never
   sent;
2. evaluates on V_i (pre-fit accuracy), trains E epochs on the rest of its data D_i,
   evaluates again (post-fit accuracy) and deploys that model;
3. sends it to every other client, which is step 1 of the next round. Round 0 trains from
   the common initial model (Algorithm 3's W_set = None).

V_i holds out `val_fraction` of the client's training records (each record by an
independent coin of the client's own stream, drawn once: the same split every round);
they are never trained on. The test split stays the harness's, so reported accuracies
are the deployed (post-fit) personal models on each client's own test records; pre-fit
and post-fit validation accuracies are reported per client and round as the extra
accuracies `prefit_val` and `postfit_val` (metrics `accuracy_prefit_val_mean`,
`accuracy_postfit_val_mean`) and written to `p2p_validation.csv`; the last round's
weights to `p2p_weights.csv`.

The paper does not give the weighting rule (its text promises it "in the following
section" and never does): option `policy` chooses uniform | acc-weighted |
softmax-loss | top-k | threshold. The default, acc-weighted (w_j proportional to the
validation accuracy of model j), is the most direct reading of "use the evaluations in
the averaging": uniform ignores them (it is all-to-all FedAvg followed by local
training), and the filters (top-k, threshold) need a parameter the paper does not give.

Exchange (option `exchange`): `relay`, the paper's simulated setting, where a
coordinator (node -1) gathers all C models and sends the full set to every client
(C uploads + C x C downloads per round, a client's own model included); or `mesh`,
direct peer messages (C (C - 1) per round). Both give the same models. Capabilities
are per instance: `uses_server` is set for relay only (the class declares the default,
relay, for `p4bench describe`).

Local training: `epochs` E sets E * ceil(1 / s) steps per round, s the run's data rate,
so that one epoch sees |D_i| records in expectation (batches are s |D_i|); without it a
round is the run's local_steps K, as in the other methods. Plain SGD at the run's lr by
default; `optimizer = adam` with `lr_decay` gives the paper's Table II optimiser (Adam,
eta decayed by gamma per local epoch), as FedAvg's option of the same names.

Differential privacy (optional: `default_epsilon` None, non-private like the paper):
record-level, the same axis as P4. Training is DP-SGD through `ctx.dp` (`local_sgd`), so
every model sent is post-processing of ledger releases. The weights of a
score-reading policy depend on V_i, and the personal average is the start of the next
released model, so under DP the scores are released too: one release per round
(`private_scores`: a Poisson sample of V_i at rate s, per-record outcomes clipped, the
mechanism's noise), planned and accounted like a training step; uniform reads no
scores and releases none. Peers see each sender's individual model (no secure
aggregation), so the accountants count every release for the sender against one
observer with no amplification from aggregation, which is what every one of the C - 1
receivers (and, in relay, the coordinator) sees: the summary reports
`receivers_per_release` = C - 1. The pre/post-fit validation accuracies are harness
measurements (like test accuracy) and are never sent.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from p4bench.engine import Capabilities, Exchange, LocalUpdate, Messages, Method
from p4bench.engine.messages import UPDATE_PREFIX
from p4bench.engine.method import Phase, PlannedRelease, Step, StepContext
from p4bench.engine.method_kit import prefixed_vectors, replicate
from p4bench.engine.state import State, unvectorize, vectorize
from p4bench.engine.training import accuracy, local_sgd
from p4bench.models import Params
from p4bench.options import Option, resolve_options
from p4bench.rng import SERVER_ID
from p4bench_baselines.local_optim import LocalSchedule, local_train, steps_per_epoch
from p4bench_p2p_fl.policies import (
    POLICIES,
    exact_scores,
    policy_weights,
    private_scores,
    validation_split,
)

if TYPE_CHECKING:
    from p4bench.data import ClientTensors

EXCHANGES = ("relay", "mesh")
MODEL = UPDATE_PREFIX + "params"  # the flattened model a message carries (what attacks replace)
ORIGIN = "origin"  # relay: the client whose model the coordinator forwards


class P2PFL(Method):
    """Karras et al.'s P2P learning: validation-scored personal averages (module docstring)."""

    name, tuning_options = "p2p-fl", ("local_steps", "data_rate", "clip")  # no client sampling
    description = (
        "P2P FL (Karras et al. Alg. 2-3): every client scores all peers' models on its validation split, "
        "averages them by policy, trains E epochs; relay (coordinator) or mesh exchange"
    )
    # relay, the default; an instance sets its own in validate_options (mesh: no server)
    capabilities = Capabilities(
        shares_individual_updates=True, has_aggregator=True, personalized=True, uses_server=True
    )
    default_epsilon = None  # non-private by default, like the paper
    options = (
        Option(
            "policy",
            str,
            "acc-weighted",
            "LocalAverage rule (unspecified in the paper): uniform, acc-weighted "
            "(w ~ validation accuracy, the default), softmax-loss (w ~ exp(-loss/tau)), top-k (k best by "
            "accuracy), threshold (drop peers scoring below the own model); the own model is always kept",
            choices=POLICIES,
        ),
        Option(
            "tau",
            float,
            0.1,
            "softmax-loss temperature: weights proportional to exp(-validation loss / tau)",
            low=0,
            low_open=True,
        ),
        Option(
            "top_k",
            int,
            3,
            "top-k: how many of the best models by validation accuracy are kept (the own model "
            "in any case)",
            low=1,
        ),
        Option(
            "val_fraction",
            float,
            0.2,
            "share of each client's training records held out as its validation "
            "split V_i (never trained on)",
            low=0,
            high=1,
            low_open=True,
            high_open=True,
        ),
        Option(
            "epochs",
            int,
            None,
            "local epochs E per round, each ceil(1/data_rate) steps; default: local_steps "
            "steps per round",
            low=1,
        ),
        Option(
            "exchange",
            str,
            "relay",
            "relay: a coordinator gathers and forwards all models (C + C*C "
            "transfers, the paper's); mesh: direct peer messages (C*(C-1))",
            choices=EXCHANGES,
            paper="Fig. 1, a coordinator relays",
        ),
        Option(
            "optimizer",
            str,
            "sgd",
            "local optimiser: sgd, or adam (the paper's Table II: moments per client, "
            "reset every round, as FedAvg's)",
            choices=("sgd", "adam"),
        ),
        Option(
            "lr_decay",
            float,
            1.0,
            "gamma: the local step size is multiplied by gamma after every local epoch of "
            "ceil(1/data_rate) steps, from lr again every round (Table II: 0.995)",
            low=0.0,
            high=1.0,
            low_open=True,
        ),
    )

    def validate_options(self) -> None:
        values, config = resolve_options(self.options, self.config.options), self.config
        self.policy, self.tau, self.top_k = (
            str(values["policy"]),
            float(values["tau"]),
            int(values["top_k"]),
        )
        self.val_fraction = float(values["val_fraction"])
        epochs = values["epochs"]
        self.steps = (
            int(epochs) * math.ceil(1.0 / config.data_rate)
            if epochs is not None
            else config.local_steps
        )
        self.exchange = str(values["exchange"])
        self.schedule = LocalSchedule(
            str(values["optimizer"]),
            config.lr,
            self.steps,
            steps_per_epoch(config.data_rate),
            float(values["lr_decay"]),
        )
        relay = self.exchange == "relay"
        # Per instance: the driver and the device launcher read `method.capabilities`.
        self.capabilities = Capabilities(  # type: ignore[misc]  # a ClassVar the instance refines
            shares_individual_updates=True,
            has_aggregator=True,
            personalized=True,
            uses_server=relay,
        )

    # -- schedule and privacy -----------------------------------------------------------------
    def round_steps(self, phase: Phase, round_index: int) -> Sequence[Step]:
        if round_index == 0:
            return (LocalUpdate(),)  # Algorithm 3: W_set = None in the first round
        exchanges = ("upload", "relay") if self.exchange == "relay" else ("share",)
        return (*(Exchange(name) for name in exchanges), LocalUpdate())

    @property
    def scores_released(self) -> bool:
        """Whether the policy reads validation scores (under DP: one release per round >= 1)."""
        return self.policy != "uniform"

    def privacy_plan(self) -> list[PlannedRelease]:
        c = self.config
        scores = c.rounds - 1 if self.scores_released else 0
        return [
            PlannedRelease(
                "train", c.data_rate, self.steps * c.rounds + scores, self.steps, c.rounds, 1.0
            )
        ]

    def privacy_context(self) -> dict[str, Any]:
        return {
            "receivers_per_release": self.num_clients - 1,
            "release_observers": "every peer"
            + (" and the coordinator" if self.exchange == "relay" else ""),
        }

    # -- clients ---------------------------------------------------------------------------------
    def init_client_state(self, train: ClientTensors, ctx: StepContext) -> State:
        count, size = len(ctx.rows), vectorize(replicate(self.initial_params(), 1)).shape[1]
        return {
            "params": replicate(self.initial_params(), count),
            "split_key": ctx.rng.bits(2),  # the client's own validation coins (secret on devices)
            "inbox": torch.zeros(
                count, 0, size
            ),  # (C, M, P) models received this round, then emptied
            "received": torch.zeros(count, 0, dtype=torch.bool),
            "weights": torch.zeros(
                count, self.num_clients, dtype=torch.float64
            ),  # last policy weights
            "prefit_val": torch.full((count,), math.nan, dtype=torch.float64),
            "postfit_val": torch.full((count,), math.nan, dtype=torch.float64),
            "history": torch.full((count, self.config.rounds, 2), math.nan, dtype=torch.float64),
        }

    def local_update(
        self, state: State, train: ClientTensors, ctx: StepContext
    ) -> tuple[State, torch.Tensor]:
        fit, validation = validation_split(train, state["split_key"], self.val_fraction)
        params, weights = state["params"], state["weights"]
        if state["inbox"].shape[1]:
            params, weights = self._personal_average(state, validation, ctx)
        prefit = self._validation_accuracy(params, validation)
        if self.schedule.optimizer == "sgd" and self.schedule.decay == 1.0:
            params, loss = local_sgd(
                ctx, params, fit, self.steps, self.config.lr
            )  # plain SGD: the original path
        else:  # Table II's Adam with per-epoch decay, as FedAvg's (`p4bench_baselines.local_optim`)
            params, loss = local_train(ctx, params, fit, self.schedule)
        postfit = self._validation_accuracy(params, validation)
        history = state["history"].clone()
        history[:, ctx.round] = torch.stack([prefit, postfit], dim=1)
        return {
            **state,
            "params": params,
            "weights": weights,
            "prefit_val": prefit,
            "postfit_val": postfit,
            "history": history,
            "inbox": state["inbox"].new_zeros(len(ctx.rows), 0, state["inbox"].shape[2]),
            "received": state["received"].new_zeros(
                len(ctx.rows), 0
            ),  # fresh: free the round's models
        }, loss

    def _validation_accuracy(self, params: Params, validation: ClientTensors) -> torch.Tensor:
        value = accuracy(self.model, params, validation.x, validation.y, validation.n)
        return torch.where(validation.n > 0, value.double(), math.nan)

    def _personal_average(
        self, state: State, validation: ClientTensors, ctx: StepContext
    ) -> tuple[Params, torch.Tensor]:
        """LocalAverage_i for every row: score the candidates (the received models and the
        own one, in client order), weight them by policy, combine through the aggregator."""
        count, own = len(ctx.rows), ctx.rows
        grid, present = state["inbox"], state["received"]  # the own model included (`receive`)
        slots = grid.shape[1]
        flat = unvectorize(grid.reshape(count * slots, -1), state["params"])
        candidates = {k: v.reshape(count, slots, *v.shape[1:]) for k, v in flat.items()}
        accuracy_, loss = self._scores(candidates, validation, present, ctx)
        weights = policy_weights(
            self.policy, accuracy_, loss, present, own, tau=self.tau, top_k=self.top_k
        )
        receiver, origin = (weights > 0).nonzero(
            as_tuple=True
        )  # row-major: sorted by receiver, then origin
        kept = Messages(origin, ctx.rows[receiver], {MODEL: grid[receiver, origin]})
        dst, mean = ctx.aggregator.aggregate_by_destination(
            kept, weights[receiver, origin], ctx.round
        )
        averaged = vectorize(state["params"]).clone()
        averaged[torch.searchsorted(ctx.rows, dst)] = mean.to(averaged.dtype)
        return unvectorize(averaged, state["params"]), weights

    def _scores(
        self, candidates: Params, validation: ClientTensors, present: torch.Tensor, ctx: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(accuracy, loss) (C, K) float64 of every candidate on the row's V_i: exact without
        DP, one DP release with it (NaN where the budget refused it); none for uniform."""
        shape = present.shape
        if not self.scores_released:
            return torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64)
        if ctx.dp is None:
            return exact_scores(self.model, candidates, validation)
        use_loss = self.policy == "softmax-loss"
        scores, released = private_scores(
            ctx, self.model, candidates, validation, present, use_loss
        )
        scores = torch.where(released.unsqueeze(1), scores, math.nan)  # refused: uniform weights
        return (
            (torch.full(shape, math.nan, dtype=torch.float64), scores)
            if use_loss
            else (scores, scores)
        )

    def outgoing(self, exchange: str, state: State, ctx: StepContext) -> Messages:
        if exchange == "upload":
            return Messages(
                ctx.rows,
                torch.full((len(ctx.rows),), SERVER_ID),
                {MODEL: vectorize(state["params"])},
            )
        if exchange != "share":
            return Messages.empty()
        others = torch.arange(self.num_clients).unsqueeze(0) != ctx.rows.unsqueeze(
            1
        )  # (C, M): to every other client
        sender, receiver = others.nonzero(as_tuple=True)
        return Messages(
            ctx.rows[sender], receiver, {MODEL: vectorize(state["params"])}, rows=sender
        )

    def receive(self, exchange: str, state: State, inbox: Messages, ctx: StepContext) -> State:
        if exchange not in ("share", "relay") or not len(inbox):
            return state
        # relay: every message comes from the coordinator, which names the model's origin
        origin = inbox.src if exchange == "share" else inbox.value(ORIGIN).long()
        valid = (origin >= 0) & (origin < self.num_clients)  # what a peer sends is untrusted
        position = torch.searchsorted(ctx.rows, inbox.dst[valid])
        vectors = prefixed_vectors(inbox.payload, MODEL)[valid]
        grid = torch.zeros(
            len(ctx.rows), self.num_clients, vectors.shape[1], dtype=state["inbox"].dtype
        )
        grid[position, origin[valid]] = vectors.to(grid.dtype)
        received = torch.zeros(len(ctx.rows), self.num_clients, dtype=torch.bool)
        received[position, origin[valid]] = True
        rows = torch.arange(len(ctx.rows))
        grid[rows, ctx.rows] = vectorize(state["params"]).to(
            grid.dtype
        )  # the own model as trained, not as relayed
        received[rows, ctx.rows] = True
        return {**state, "inbox": grid, "received": received}

    def deployed_params(self, state: State) -> Params:
        params: Params = state["params"]
        return params

    def client_accuracies(self, state: State) -> dict[str, torch.Tensor]:
        return {"prefit_val": state["prefit_val"], "postfit_val": state["postfit_val"]}

    def write_artifacts(self, state: State, folder: Path) -> list[Path]:
        history, weights = state["history"].cpu().numpy(), state["weights"].cpu().numpy()
        validation, mixing = folder / "p2p_validation.csv", folder / "p2p_weights.csv"
        with open(validation, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["client", "round", "prefit_val_acc", "postfit_val_acc"])
            writer.writerows(
                [c, r, history[c, r, 0], history[c, r, 1]]
                for c in range(len(history))
                for r in range(history.shape[1])
            )
        with open(mixing, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["client", *(f"w{j}" for j in range(weights.shape[1]))])
            writer.writerows([c, *weights[c].tolist()] for c in range(len(weights)))
        return [validation, mixing]

    # -- the relay coordinator --------------------------------------------------------------------
    def init_server_state(self, ctx: StepContext) -> State:
        size = vectorize(replicate(self.initial_params(), 1)).shape[1]
        return {
            "models": torch.zeros(1, self.num_clients, size),
            "present": torch.zeros(1, self.num_clients, dtype=torch.bool),
        }

    def server_receive(
        self, exchange: str, state: State, inbox: Messages, ctx: StepContext
    ) -> State:
        if exchange != "upload" or not len(inbox):
            return state
        valid = (inbox.src >= 0) & (inbox.src < self.num_clients)
        models, present = torch.zeros_like(state["models"]), torch.zeros_like(state["present"])
        models[0, inbox.src[valid]] = prefixed_vectors(inbox.payload, MODEL)[valid].to(models.dtype)
        present[0, inbox.src[valid]] = True
        return {"models": models, "present": present}

    def server_messages_per_pair(self, exchange: str, phase: str, round_index: int) -> int:
        """The relay forwards every client's model to every client: one message per origin."""
        return self.num_clients if exchange == "relay" else 1

    def server_outgoing(self, exchange: str, state: State, ctx: StepContext) -> Messages:
        if exchange != "relay":
            return Messages.empty()
        origins = state["present"][0].nonzero().squeeze(1)
        table = {MODEL: state["models"][0, origins], ORIGIN: origins}
        receiver = torch.arange(self.num_clients).repeat_interleave(
            len(origins)
        )  # the full set to every client
        rows = torch.arange(len(origins)).repeat(self.num_clients)
        return Messages(torch.full((len(rows),), SERVER_ID), receiver, table, rows=rows)
