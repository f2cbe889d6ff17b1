"""PDSL (Wang, Yuan, Wang, Li, "Privacy-Preserved Decentralized Stochastic Learning"):
method `pdsl`, a consensus method. Per round (spec section 1.2), for every agent i:

1. `models`: x_i goes to every neighbour j in M_i (the graph of option `topology`, W by
   Metropolis-Hastings or uniform weights; M_i includes i);
2. local step: on ONE batch B of its records, i computes g_ij = grad F_i(x_j; B) for every
   j in M_i, clips and adds noise (`cross_gradients`: all agents and neighbours in one
   batched computation, one DP release per agent and round);
3. `gradients`: g_ij goes back to j; i receives g_ji (its own model's gradient on j's data);
   it scores the candidate one-step models x_i - lr g_ji by Shapley values on the shared
   validation set Q (Monte-Carlo with R permutations, or exact), min-max normalises them
   (all equal: uniform shares, counted as a fallback), takes pi_ij = phi_hat_ij / (w_ij
   sum_k phi_hat_ik) as written (`normalize_pi`: the shares themselves), g_bar = sum_j
   pi_ij g_ji, u_hat = alpha u + g_bar, x_hat = x - lr u_hat;
4. `gossip`: (u_hat, x_hat) to the neighbours; u = sum_j w_ij u_hat_j, x = sum_j w_ij x_hat_j.

Q is a labeled pool of the dataset held out before partitioning (no agent holds it),
declared public data (`threat.public_data`), `val_size` records of it.

Privacy (record level, the harness's accountant): each agent's k_i = |M_i| gradients of a
round come from the same batch and are ONE release (`cross_gradients`: sensitivity 2C
sqrt(k_i) with the paper's batch clipping, accounted at rate 1; per-example clipping with
Poisson sampling at rate q), composed over T rounds. Everything else (Shapley scores on
public Q, momentum, gossip) is post-processing. The paper's per-round Theorem 1 epsilon is
reported beside it for reproduction only (`epsilon_theorem1_per_round`): its min-max
normalisation makes phi_min = 0 and the bound infinite, so phi_min is clamped to
`phi_floor` and the summary says so.
"""

from __future__ import annotations

import csv
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from p4bench.data.public import PUBLIC_DATA_OPTIONS
from p4bench.engine import DEFAULT_EPSILON, Capabilities, Exchange, LocalUpdate, Method
from p4bench.engine.messages import Messages
from p4bench.engine.method import Phase, PlannedRelease, Step, StepContext
from p4bench.engine.method_kit import replicate
from p4bench.engine.state import State, unvectorize, vectorize
from p4bench.errors import ConfigError
from p4bench.models import Params
from p4bench.options import Option, resolve_options, topology_options
from p4bench.privacy.concatenated import CLIP_MODES, noise_std_per_coordinate, release_rate
from p4bench_baselines.cross_gradients import MODEL, static_neighbourhoods
from p4bench_baselines.neighbour_exchange import (
    gossip_mix,
    neighbour_grid,
    neighbour_messages,
    received_gradients,
)
from p4bench_p2p_fl.policies import validation_split
from p4bench_pdsl.cross_linear import pdsl_cross_gradients
from p4bench_pdsl.shapley import coalition_game, exact_shapley, minmax_shares, monte_carlo_shapley

if TYPE_CHECKING:
    from p4bench.data import ClientTensors
    from p4bench.privacy.mechanism import DPSettings

SHAPLEY = ("mc", "exact")


class PDSL(Method):
    """Shapley-weighted DP decentralized SGD with cross-gradients (module docstring)."""

    name, tuning_options = "pdsl", ("data_rate", "clip")  # no client sampling, no local steps
    description = (
        "PDSL (Wang et al.): cross-gradients on one batch per round, Monte-Carlo Shapley weights on a "
        "shared validation set, momentum and model gossip; DP per agent and round"
    )
    # consensus; neighbours see each other's models and gradients, combined by Shapley weights (no defense point)
    capabilities = Capabilities(shares_individual_updates=True)
    default_epsilon = DEFAULT_EPSILON
    needs_public_data = True
    needs_public_labels = True
    options: ClassVar[tuple[Option, ...]] = (
        *topology_options("complete"),
        Option(
            "mixing",
            str,
            "metropolis",
            "W: metropolis (Metropolis-Hastings) or uniform",
            choices=("metropolis", "uniform"),
        ),
        Option(
            "momentum",
            float,
            0.5,
            "alpha (paper: 0.5 MNIST, 0.7 CIFAR-10)",
            low=0,
            high=1,
            high_open=True,
            paper="0.5 on MNIST",
        ),
        Option("R", int, 10, "Monte-Carlo permutations per agent and round", low=1),
        Option(
            "shapley",
            str,
            "mc",
            "mc (Castro et al., the paper's Alg. 2) or exact (2^|M_i| coalitions)",
            choices=SHAPLEY,
            paper="Alg. 2",
        ),
        Option(
            "normalize_pi",
            bool,
            False,
            "use the Shapley shares as weights (sum 1) instead of pi as written",
        ),
        Option(
            "clip_mode",
            str,
            "batch",
            "batch: clip each batch-mean gradient (the paper's, accounted without "
            "amplification); per-example: per-record clipping with Poisson sampling",
            choices=CLIP_MODES,
            paper="Alg. 1",
        ),
        Option(
            "val_size",
            int,
            2000,
            "records of the held-out labeled pool used as Q",
            low=1,
            paper="|Q| = 2,000",
        ),
        Option(
            "phi_floor",
            float,
            1e-3,
            "phi_min clamp in the paper's Theorem 1 (its bound is infinite at 0)",
            low=0,
            low_open=True,
        ),
        *PUBLIC_DATA_OPTIONS,
    )

    def validate_options(self) -> None:
        values = resolve_options(self.options, self.config.options)
        self.values = values
        graph = static_neighbourhoods(values, self.num_clients, self.config.seed, self.name)
        self.weights, self.neighbourhood, self.mixing = graph.weights, graph.members, graph.report
        self.table = (
            graph.table
        )  # M_i as K = max degree slots: state and work per round grow with the edges
        self.clip_mode = str(values["clip_mode"])
        largest = self.table.width
        if values["shapley"] == "exact" and largest > 12:
            raise ConfigError(
                "options.shapley",
                f"exact Shapley over {largest} players needs 2^{largest} coalitions "
                "per agent and round; use mc (options.R) or a sparser topology",
            )
        self.log: list[
            tuple[int, int, int, float, float]
        ] = []  # (round, agent, neighbour, phi, pi)
        self.dp_settings: DPSettings | None = (
            None  # the run's, seen in local_update (for Theorem 1)
        )

    # -- schedule and privacy ----------------------------------------------------------------
    def round_steps(self, phase: Phase, round_index: int) -> Sequence[Step]:
        return (Exchange("models"), LocalUpdate(), Exchange("gradients"), Exchange("gossip"))

    def privacy_plan(self) -> list[PlannedRelease]:
        c = self.config
        rate = release_rate(self.clip_mode, c.data_rate)
        return [PlannedRelease("train", rate, c.rounds, 1, c.rounds, 1.0)]

    def privacy_context(self) -> dict[str, Any]:
        m = self.mixing
        if self.needs_public_data:
            used = (
                len(self._q[1]) if hasattr(self, "_q") else self.values["val_size"]
            )  # the pool may be smaller
            q = f"{used} labeled held-out records (public)"
        else:
            q = f"each agent's own held-out split ({self.values['val_fraction']:g} of its records)"
        out: dict[str, Any] = {
            "rho": m["rho"],
            "degree_min": m["degree_min"],
            "degree_max": m["degree_max"],
            "receivers_per_release": int(m["degree_max"]),
            "clip_mode": self.clip_mode,
            "validation_set": q,
        }
        if self.dp_settings is not None:
            out.update(self._theorem1(self.dp_settings))
        return out

    def _theorem1(self, settings: DPSettings) -> dict[str, Any]:
        """The paper's per-round epsilon for the noise actually used (reproduction only)."""
        floor = float(self.values["phi_floor"])
        delta = float(self.config.delta) if self.config.delta is not None else 1e-5
        w = self.weights
        omega_min = float(w[w > 0].min())
        worst = 0.0
        for i in range(self.num_clients):
            row = w[i][w[i] > 0]
            sigma = noise_std_per_coordinate(settings, self.clip_mode, int(len(row)))
            value = (
                2
                * settings.clip
                * (1 / omega_min + (1 / row).sum())
                * math.sqrt(2 * math.log(1.25 / delta))
            )
            worst = max(worst, value / (floor * sigma * math.sqrt((row**-2.0).sum())))
        return {
            "epsilon_theorem1_per_round": worst,
            "theorem1_phi_min": floor,
            "theorem1_note": "the paper's per-round bound (no composition over rounds or over the |M_i| releases); "
            f"min-max scaling makes phi_min 0 and the bound infinite: clamped to {floor:g}",
        }

    # -- clients ------------------------------------------------------------------------------
    def init_client_state(self, train: ClientTensors, ctx: StepContext) -> State:
        count = len(ctx.rows)
        params = replicate(self.initial_params(), count)
        size = vectorize(params).shape[1]
        zeros = torch.zeros(
            count, self.table.width, size
        )  # one slot per neighbour (`NeighbourTable`)
        return {
            "params": params,
            "momentum": torch.zeros(count, size),
            "models": zeros,
            "cross": zeros.clone(),
            "u_hat": torch.zeros(count, size),
            "x_hat": torch.zeros(count, size),
        }

    def _present(self, rows: torch.Tensor) -> torch.Tensor:
        return self.table.real[rows]

    def local_update(
        self, state: State, train: ClientTensors, ctx: StepContext
    ) -> tuple[State, torch.Tensor]:
        if ctx.dp is not None:
            self.dp_settings = ctx.dp.settings
        present = self._present(ctx.rows)
        models = state["models"].clone()
        models[torch.arange(len(ctx.rows)), self.table.own[ctx.rows]] = vectorize(
            state["params"]
        )  # x_i itself
        grads, loss, _ = pdsl_cross_gradients(
            ctx, models, state["params"], present, self._training(train, state), self.clip_mode
        )
        return {**state, "cross": grads}, loss

    def outgoing(self, exchange: str, state: State, ctx: StepContext) -> Messages:
        gossip = {"u": state["u_hat"], "x": state["x_hat"]}
        return neighbour_messages(exchange, state, ctx.rows, self.table, gossip)

    def receive(self, exchange: str, state: State, inbox: Messages, ctx: StepContext) -> State:
        if exchange == "models":
            size = state["momentum"].shape[1]
            return {**state, "models": neighbour_grid(inbox, ctx.rows, MODEL, size, self.table)}
        if exchange == "gradients":
            return self._shapley_step(
                state, received_gradients(inbox, state, ctx.rows, self.table), ctx
            )
        if exchange == "gossip":
            mixed = gossip_mix(
                inbox, ctx.rows, self.table, {"u": state["u_hat"], "x": state["x_hat"]}
            )
            return {
                **state,
                "momentum": mixed["u"].float(),
                "params": unvectorize(mixed["x"].float(), state["params"]),
            }
        return state

    def _shapley_step(self, state: State, received: torch.Tensor, ctx: StepContext) -> State:
        started = time.perf_counter()
        rows, present = ctx.rows, self._present(ctx.rows)
        lr, x = float(self.config.lr), vectorize(state["params"])
        q_x, q_y, q_n = self._validation(ctx, state)

        values = coalition_game(self.model, state["params"], x, received, lr, q_x, q_y, q_n=q_n)
        if self.values["shapley"] == "exact":  # validate_options bounds the neighbourhood size
            phi = exact_shapley(values, present)
        else:
            slots = self.table.width  # an order over the agent's own neighbourhood slots
            keys = ctx.rng.uniform(int(self.values["R"]) * slots).view(len(rows), -1, slots)
            phi = monte_carlo_shapley(values, present, int(self.values["R"]), keys=keys)
        _, shares, fallback = minmax_shares(phi, present)
        w = self.table.weights[rows].to(shares.dtype)
        pi = (
            shares
            if bool(self.values["normalize_pi"])
            else torch.where(present, shares / w.clamp_min(1e-300), 0.0)
        )
        g_bar = torch.bmm(pi.unsqueeze(1).to(received.dtype), received).squeeze(1)
        u_hat = float(self.values["momentum"]) * state["momentum"] + g_bar
        x_hat = x - lr * u_hat
        self._record(ctx, phi, pi, present, fallback, time.perf_counter() - started)
        return {**state, "u_hat": u_hat, "x_hat": x_hat}

    def _validation(
        self, ctx: StepContext, state: State
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Q shared by every agent: (inputs, labels, None)."""
        if not hasattr(self, "_q"):
            assert self.public_data is not None, (
                "the runner sets the labeled public pool (needs_public_labels)"
            )
            inputs, labels = self.public_data.labeled()
            size = min(int(self.values["val_size"]), len(labels))
            self._q = (inputs[:size], labels[:size])  # the pool is a public random draw already
        return (*self._q, None)

    def _training(self, train: ClientTensors, state: State) -> ClientTensors:
        """The records the cross-gradients are computed on (all of them here)."""
        return train

    def _record(
        self,
        ctx: StepContext,
        phi: torch.Tensor,
        pi: torch.Tensor,
        present: torch.Tensor,
        fallback: torch.Tensor,
        seconds: float,
    ) -> None:
        real = torch.where(present, phi, torch.nan)
        spread = (
            real.nan_to_num(-torch.inf).max(1).values - real.nan_to_num(torch.inf).min(1).values
        )
        metrics = ctx.metrics
        metrics["pdsl.phi_spread_sum"] = metrics.get("pdsl.phi_spread_sum", 0.0) + float(
            spread.sum()
        )
        metrics["pdsl.agents"] = metrics.get("pdsl.agents", 0.0) + float(len(ctx.rows))
        metrics["pdsl.fallbacks"] = metrics.get("pdsl.fallbacks", 0.0) + float(fallback.sum())
        metrics["pdsl.shapley_s"] = metrics.get("pdsl.shapley_s", 0.0) + seconds
        agents, ids = (
            ctx.rows.tolist(),
            self.table.ids[ctx.rows].tolist(),
        )  # one host read each, not one per pair
        phis, pis = phi.tolist(), pi.tolist()
        for a, k in present.nonzero().tolist():
            self.log.append(
                (ctx.round, int(agents[a]), int(ids[a][k]), float(phis[a][k]), float(pis[a][k]))
            )

    def derived_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        agents = totals.get("pdsl.agents", 0.0)
        return (
            {"pdsl.phi_spread_mean": totals.get("pdsl.phi_spread_sum", 0.0) / agents}
            if agents
            else {}
        )

    def deployed_params(self, state: State) -> Params:
        params: Params = state["params"]
        return params

    def write_artifacts(self, state: State, folder: Path) -> list[Path]:
        if not self.log:
            return []
        path = folder / "pdsl_shapley.csv"
        with open(path, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["round", "agent", "neighbour", "phi", "pi"])
            writer.writerows(self.log)
        return [path]


class PDSLLocalVal(PDSL):
    """`pdsl-local-val`: PDSL with each agent scoring the candidates on its own held-out
    split Q_i (`val_fraction` of its records, never trained on) instead of a shared Q. A
    deviation from the paper (its Q is shared); it needs no public data. Under DP the
    Shapley scores read Q_i outside the ledger, so the run is reported uncertified."""

    name = "pdsl-local-val"
    description = (
        "PDSL with Shapley values on each agent's own held-out split (a documented deviation)"
    )
    needs_public_data = False
    needs_public_labels = False
    options = tuple(
        o
        for o in PDSL.options
        if o.name not in {p.name for p in PUBLIC_DATA_OPTIONS} | {"val_size"}
    ) + (
        Option(
            "val_fraction",
            float,
            0.2,
            "share of each agent's records held out as its own validation split Q_i",
            low=0,
            high=1,
            low_open=True,
            high_open=True,
        ),
    )

    def init_client_state(self, train: ClientTensors, ctx: StepContext) -> State:
        return {**super().init_client_state(train, ctx), "split_key": ctx.rng.bits(2)}

    def uncertified_steps(self) -> list[str]:
        return [
            "pdsl-local-val: the Shapley weights read each agent's own validation records Q_i outside the "
            "ledger (not a DP release), and they shape the released model"
        ]

    def _split(self, train: ClientTensors, state: State) -> tuple[ClientTensors, ClientTensors]:
        return validation_split(train, state["split_key"], float(self.values["val_fraction"]))

    def _training(self, train: ClientTensors, state: State) -> ClientTensors:
        return self._split(train, state)[0]

    def _validation(
        self, ctx: StepContext, state: State
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        assert ctx.train is not None, "the driver passes the rows' records to every step"
        held_out = self._split(ctx.train, state)[1]
        return held_out.x, held_out.y, held_out.n
