"""DP-CGA: Cross-Gradient Aggregation (Esfandiari et al., ICML 2021) with Gaussian noise on
the cross-gradients, the PDSL paper's baseline (spec seed-004 section 3): method `dp-cga`,
a consensus method. Per round, for every agent i with neighbourhood M_i (i included) and
W from option `topology` (Metropolis-Hastings or uniform weights, option `mixing`):

1. `models`: x_i goes to every neighbour;
2. local step: on ONE batch B of its records, i computes g_ij = grad F_i(x_j; B) for every
   j in M_i, clipped and noised as one release (`cross_gradients`, shared with PDSL);
3. `gradients`: g_ij goes back to j; i now holds g_ii and g_ji (its model on j's data);
4. projection (CGA's QP, as in the authors' code): rows r_j = w_ij g_ji (j != i), anchor
   a = w_ii g_ii (`anchor=mean`: sum_j w_ij g_ji); lambda = argmin_{lambda >= margin}
   1/2 ||a + sum_j lambda_j r_j||^2 and g~ = a + sum_j lambda_j r_j. With margin 0 this is
   the dual of min ||v - a||^2 s.t. <v, r_j> >= 0 (no update that conflicts with a
   neighbour's data); the authors use GEM's margin 0.5 (every neighbour's gradient enters
   with at least half its weight), the default. Solved per parameter tensor as their code
   does (`qp_scope=layer`) or on the whole vector (`model`), see `cone_projection`;
5. momentum u = beta u + g~, step d = g~ + beta u (`nesterov`, the authors' code) or u, and
   (`order=cta`, CGA's combine-then-adapt) x_i = sum_j w_ij x_j - lr d with the models of
   step 1, no further exchange; or (`order=atc`, adapt-then-combine as PDSL) x_hat_i =
   x_i - lr d, then `gossip`: x_i = sum_j w_ij x_hat_j. The momentum is never gossiped.
   With cta the deployed models differ by one (noisy) local step: they agree only up to
   lr d, which the DP noise dominates in short runs; atc ends every round on a gossip.

Defaults from the authors' code (github.com/yasesf93/CrossGradientAggregation): momentum
0.9 (their CLI default; README example 0.5), margin 0.5, per-layer QP, Nesterov-form step.
`clip_mode` defaults to batch clipping, PDSL's, for parity with the PDSL comparison (the
PDSL paper only says "noise added to cross-gradients").

Privacy: exactly PDSL's. The |M_i| gradients of a round are one release per agent
(`cross_gradients`: batch clipping at rate 1, or per-example clipping with Poisson
sampling at rate q), composed over T rounds; the QP, momentum and consensus are
post-processing of released values and of models that are themselves post-processing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from p4bench.engine import DEFAULT_EPSILON, Capabilities, Exchange, LocalUpdate, Method
from p4bench.engine.messages import Messages
from p4bench.engine.method import Phase, PlannedRelease, Step, StepContext
from p4bench.engine.method_kit import replicate
from p4bench.engine.state import State, unvectorize, vectorize
from p4bench.models import Params
from p4bench.options import Option, resolve_options, topology_options
from p4bench.privacy.concatenated import CLIP_MODES, release_rate
from p4bench_baselines.cross_gradients import MODEL, cross_gradients, static_neighbourhoods
from p4bench_baselines.neighbour_exchange import (
    gossip_mix,
    neighbour_grid,
    neighbour_messages,
    received_gradients,
)

if TYPE_CHECKING:
    from p4bench.data import ClientTensors

ANCHORS = ("self", "mean")
ORDERS = ("cta", "atc")
SCOPES = ("layer", "model")


# Iterations of the QP solver between checks that every item has converged (a host read).
CONVERGENCE_CHECK_EVERY = 8


def solve_cone_qp(
    gram: torch.Tensor,
    linear: torch.Tensor,
    mask: torch.Tensor,
    margin: float = 0.0,
    iterations: int = 500,
    tolerance: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched QP on Gram matrices: (lambda (B, K), residual (B,)), both float64.

    lambda = argmin 1/2 lambda^T H lambda + b^T lambda over lambda_j >= margin for j in
    `mask` (other slots are padding: lambda 0), H = `gram` (B, K, K), b = `linear` (B, K).
    FISTA with step 1/L (L the largest eigenvalue of each H) and O'Donoghue-Candes
    adaptive restart on mu = lambda - margin >= 0. Each item is frozen once its natural
    residual max_j |mu_j - max(0, mu_j - grad_j / L)| <= tolerance * max(1, max_j mu_j), so
    its result does not depend on the rest of the batch; `residual` is that value at the
    end (0 iff optimal)."""
    keep_slot = mask.double()
    gram = gram.double() * keep_slot.unsqueeze(1) * keep_slot.unsqueeze(2)
    shift = margin * keep_slot
    linear = linear.double() * keep_slot + torch.bmm(gram, shift.unsqueeze(-1)).squeeze(-1)
    lipschitz: torch.Tensor = torch.linalg.eigvalsh(gram)[:, -1].clamp_min(1e-300).unsqueeze(1)

    def gradient(mu: torch.Tensor) -> torch.Tensor:
        return torch.bmm(gram, mu.unsqueeze(-1)).squeeze(-1) + linear

    def residual(mu: torch.Tensor) -> torch.Tensor:
        step = (mu - (mu - gradient(mu) / lipschitz).clamp_min(0)).abs().amax(1)
        return step / mu.amax(1).clamp_min(1.0)

    mu = torch.zeros_like(linear)
    y, t = mu.clone(), torch.ones(len(mu), 1, dtype=torch.float64)
    active = residual(mu) > tolerance
    for iteration in range(iterations):
        # Converged items are frozen (every update is masked by `active`), so checking for
        # the end only every few iterations changes nothing but the host reads it costs.
        if iteration % CONVERGENCE_CHECK_EVERY == 0 and not bool(active.any()):
            break
        g = gradient(y)
        new = (y - g / lipschitz).clamp_min(0)
        restart = (g * (new - mu)).sum(1, keepdim=True) > 0  # the momentum points uphill: drop it
        t_new = (1 + torch.sqrt(1 + 4 * t * t)) / 2
        y_new = torch.where(restart, new, new + (t - 1) / t_new * (new - mu))
        live = active.unsqueeze(1)
        mu, y = torch.where(live, new, mu), torch.where(live, y_new, y)
        t = torch.where(live, torch.where(restart, torch.ones_like(t), t_new), t)
        active = active & (residual(mu) > tolerance)
    return (mu + shift) * keep_slot, residual(mu)


def cone_projection(
    anchor: torch.Tensor,
    rows: torch.Tensor,
    mask: torch.Tensor,
    segments: list[tuple[int, int]] | None = None,
    margin: float = 0.0,
    iterations: int = 500,
    tolerance: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CGA's aggregation for a batch of agents: (v (B, P), lambda (B, S, K), residual (B, S)).

    For each [start, end) of `segments` (default: the whole vector) separately:
    lambda = argmin_{lambda_j >= margin, j in mask} 1/2 ||a + sum_j lambda_j r_j||^2 on that
    part of anchor a (B, P) and rows r (B, K, P), and v = a + sum_j lambda_j r_j there.
    With margin 0 this is the dual of projecting a onto {v : <v, r_j> >= 0 for all j}.
    Solved on the (B * S, K, K) Gram matrices at once (`solve_cone_qp`)."""
    segments = segments or [(0, anchor.shape[1])]
    grams, linears = [], []
    for a, b in segments:  # parameter tensors, not agents: a handful of matmuls
        part = rows[:, :, a:b]
        grams.append(torch.bmm(part, part.transpose(1, 2)))
        linears.append(torch.bmm(part, anchor[:, a:b].unsqueeze(-1)).squeeze(-1))
    count, slots, parts = rows.shape[0], rows.shape[1], len(segments)
    gram = torch.stack(grams, 1).reshape(count * parts, slots, slots)
    linear = torch.stack(linears, 1).reshape(count * parts, slots)
    lam, residual = solve_cone_qp(
        gram, linear, mask.repeat_interleave(parts, 0), margin, iterations, tolerance
    )
    lam, residual = lam.reshape(count, parts, slots), residual.reshape(count, parts)
    coefficients = lam.to(rows.dtype)
    v = anchor.clone()
    for s, (a, b) in enumerate(segments):
        v[:, a:b] += torch.bmm(coefficients[:, s].unsqueeze(1), rows[:, :, a:b]).squeeze(1)
    return v, lam, residual


def segments_of(like: dict[str, torch.Tensor], scope: str) -> list[tuple[int, int]]:
    """[start, end) ranges of the flat vector (`vectorize` order): one per parameter tensor
    (`layer`, the authors' per-layer QP) or the whole vector (`model`)."""
    sizes = [int(like[k][0].numel()) for k in sorted(like)]
    if scope == "model":
        return [(0, sum(sizes))]
    bounds = np.cumsum([0, *sizes]).tolist()
    return list(zip(bounds[:-1], bounds[1:], strict=True))


class DPCGA(Method):
    """Cross-Gradient Aggregation with DP cross-gradients (module docstring)."""

    name = "dp-cga"
    tuning_options = ("data_rate", "clip")  # no client sampling, no local steps
    description = (
        "DP-CGA (Esfandiari et al. with noisy cross-gradients): cross-gradients on one batch per round, "
        "QP projection so the update does not conflict with the neighbours' data, momentum, consensus"
    )
    # consensus; neighbours see individual models and gradients, combined by a QP (no defense point)
    capabilities = Capabilities(shares_individual_updates=True)
    default_epsilon = DEFAULT_EPSILON
    options = (
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
            0.9,
            "beta (the authors' CLI default; their README example uses 0.5)",
            low=0,
            high=1,
            high_open=True,
        ),
        Option(
            "nesterov",
            bool,
            True,
            "step g~ + beta u as the authors' code does; false: the heavy-ball step u",
        ),
        Option(
            "margin",
            float,
            0.5,
            "lower bound on the QP's dual variables (GEM's, used by the authors); 0: the "
            "plain projection onto the non-conflicting cone",
            low=0,
        ),
        Option(
            "order",
            str,
            "cta",
            "cta: x = sum_j w_ij x_j - lr d (CGA); atc: x = sum_j w_ij (x_j - lr d_j), "
            "one more exchange (gossip)",
            choices=ORDERS,
        ),
        Option(
            "anchor",
            str,
            "self",
            "the vector projected: self (w_ii g_ii, CGA) or mean (sum_j w_ij g_ji)",
            choices=ANCHORS,
        ),
        Option(
            "qp_scope",
            str,
            "layer",
            "one QP per parameter tensor (the authors' code) or for the whole model",
            choices=SCOPES,
        ),
        Option("qp_iterations", int, 500, "FISTA iterations at most per QP", low=1),
        Option(
            "qp_tolerance",
            float,
            1e-6,
            "stop a QP once its relative natural residual is below this",
            low=0,
        ),
        Option(
            "clip_mode",
            str,
            "batch",
            "batch: clip each batch-mean gradient (PDSL's, accounted without "
            "amplification); per-example: per-record clipping with Poisson sampling",
            choices=CLIP_MODES,
        ),
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

    # -- schedule and privacy ----------------------------------------------------------------
    def round_steps(self, phase: Phase, round_index: int) -> Sequence[Step]:
        steps: tuple[Step, ...] = (Exchange("models"), LocalUpdate(), Exchange("gradients"))
        return steps + (Exchange("gossip"),) if self.values["order"] == "atc" else steps

    def privacy_plan(self) -> list[PlannedRelease]:
        c = self.config
        return [
            PlannedRelease(
                "train", release_rate(self.clip_mode, c.data_rate), c.rounds, 1, c.rounds, 1.0
            )
        ]

    def privacy_context(self) -> dict[str, Any]:
        m = self.mixing
        return {
            "rho": m["rho"],
            "degree_min": m["degree_min"],
            "degree_max": m["degree_max"],
            "receivers_per_release": int(m["degree_max"]),
            "clip_mode": self.clip_mode,
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
            "x_hat": torch.zeros(count, size),
        }

    def local_update(
        self, state: State, train: ClientTensors, ctx: StepContext
    ) -> tuple[State, torch.Tensor]:
        present = self.table.real[ctx.rows]
        models = state["models"].clone()
        models[torch.arange(len(ctx.rows)), self.table.own[ctx.rows]] = vectorize(
            state["params"]
        )  # x_i itself
        grads, loss, _ = cross_gradients(
            ctx, models, state["params"], present, train, self.clip_mode
        )
        return {**state, "models": models, "cross": grads}, loss

    def outgoing(self, exchange: str, state: State, ctx: StepContext) -> Messages:
        return neighbour_messages(exchange, state, ctx.rows, self.table, {"x": state["x_hat"]})

    def receive(self, exchange: str, state: State, inbox: Messages, ctx: StepContext) -> State:
        if exchange == "models":
            size = state["momentum"].shape[1]
            return {**state, "models": neighbour_grid(inbox, ctx.rows, MODEL, size, self.table)}
        if exchange == "gradients":
            return self._step(state, received_gradients(inbox, state, ctx.rows, self.table), ctx)
        if exchange == "gossip":
            mixed = gossip_mix(inbox, ctx.rows, self.table, {"x": state["x_hat"]})
            return {
                **state,
                "params": unvectorize(mixed["x"].to(state["x_hat"].dtype), state["params"]),
            }
        return state

    def _step(self, state: State, received: torch.Tensor, ctx: StepContext) -> State:
        """QP aggregation, momentum, then the new model (cta) or x_hat for the gossip (atc)."""
        rows, count = ctx.rows, len(ctx.rows)
        mine, own = torch.arange(count), self.table.own[ctx.rows]
        w = self.table.weights[rows].to(
            received.dtype
        )  # (C, K): w_ij of each neighbour slot, 0 on padding
        weighted = received * w.unsqueeze(2)  # the authors scale every gradient by its pi_ij
        others = self.table.real[rows].clone()
        others[mine, own] = False
        anchor = weighted.sum(1) if self.values["anchor"] == "mean" else weighted[mine, own]
        aggregate, residual, conflicts = self._project(anchor, weighted, others, state["params"])
        beta = float(self.values["momentum"])
        momentum = beta * state["momentum"] + aggregate
        direction = aggregate + beta * momentum if bool(self.values["nesterov"]) else momentum
        step = float(self.config.lr) * direction
        metrics = ctx.metrics
        metrics["cga.qps"] = metrics.get("cga.qps", 0.0) + float(residual.numel())
        metrics["cga.conflicts"] = metrics.get("cga.conflicts", 0.0) + float(conflicts)
        unconverged = float(
            (residual > float(self.values["qp_tolerance"])).sum()
        )  # stopped by qp_iterations
        metrics["cga.unconverged"] = metrics.get("cga.unconverged", 0.0) + unconverged
        if self.values["order"] == "atc":
            return {**state, "momentum": momentum, "x_hat": vectorize(state["params"]) - step}
        consensus = torch.bmm(w.unsqueeze(1), state["models"]).squeeze(
            1
        )  # sum_j w_ij x_j (own slot: x_i)
        return {
            **state,
            "momentum": momentum,
            "params": unvectorize(consensus - step, state["params"]),
        }

    def _project(
        self,
        anchor: torch.Tensor,
        weighted: torch.Tensor,
        others: torch.Tensor,
        like: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(aggregate (C, P), residuals, number of QPs with a binding constraint): all
        agents' and parameter tensors' QPs as one batch."""
        segments = segments_of(like, str(self.values["qp_scope"]))
        margin = float(self.values["margin"])
        v, lam, residual = cone_projection(
            anchor,
            weighted,
            others,
            segments,
            margin,
            int(self.values["qp_iterations"]),
            float(self.values["qp_tolerance"]),
        )
        binding = ((lam > margin + 1e-12) & others.unsqueeze(1)).any(
            2
        )  # (C, S): lambda above its bound somewhere
        return v, residual, int(binding.sum())

    def derived_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        qps = totals.get("cga.qps", 0.0)
        if not qps:
            return {}
        return {
            "cga.conflict_fraction": totals.get("cga.conflicts", 0.0) / qps,
            "cga.unconverged_fraction": totals.get("cga.unconverged", 0.0) / qps,
        }

    def deployed_params(self, state: State) -> Params:
        params: Params = state["params"]
        return params
