"""DP-DSGD and DP-DSGT (Bayrooti, Gao & Prorok 2023): decentralized consensus learning
with per-node DP-SGD gradients, over a graph and mixing matrix W from the topology harness.

DSGD ("combine then adapt"), per iteration t with step size a_t:
    x_i <- sum_j W_ij x_j ;  x_i <- x_i - a_t g_i(x_i)
DSGD with ``order = d-psgd`` (D-PSGD, Lian et al. 2017, Algorithm 1):
    x_i <- sum_j W_ij x_j - a_t g_i(x_i), the gradient taken at x_i before the gossip
DSGT (gradient tracking of Pu & Nedic 2021):
    x_i <- sum_j W_ij (x_j - a_t y_j) ;  y_i <- sum_j W_ij y_j + g_i(x_i) - g_i(previous x_i)
Trackers y and previous gradients start at 0, so the first iteration is the textbook
initialisation y^0 = g(x^0) (all x start equal and W is row-stochastic), as in the
authors' code. g_i is a mean gradient on a batch of rate s: DP-SGD (Poisson sampling,
clipping, noise) when the run is private; x_i and y_i are post-processing of the noisy
gradients, so every iteration is one release per node.

One p4bench round is `iterations` (default: local_steps K) gossip + gradient
iterations, so a round costs the same gradient evaluations as K local steps elsewhere.
Step sizes decay geometrically from `lr` to `lr_final` over all iterations (the
authors' logspace schedule; default constant).

Options (``-o key=value``): topology (default complete, as every config of the
authors), topology_options (mapping), mixing (metropolis | uniform; W_ij =
1/(1+max(deg_i, deg_j)) or 1/(1+indeg_i)), mixing_order (synchronous | sequential),
iterations, lr_final; for dp-dsgd only, order (combine-then-adapt | d-psgd).

order = d-psgd (dp-dsgd only) is D-PSGD: each node takes its gradient at its own model
x_i^t, gossips x_i^t and subtracts the step after the mix, so the gradient and the mix
read the same x^t. The default combine-then-adapt takes the gradient at the mixed model
instead; that trajectory is adapt-then-combine half an iteration apart and differs from
D-PSGD's (docs/dp-dpsgd.md). With DP this is the synchronous form of the PDSL paper's
"DP-DPSGD" baseline (A(DP)^2SGD, the asynchronous DP version of D-PSGD): no asynchrony or
stale reads, DP-SGD clipping and the harness's accountant. An iteration is one
LocalUpdate (the gradient, kept as a pending step) and one gossip (mix, then apply the
step), still one DP release per node; the sent x_i^t is post-processing of earlier
releases. It needs synchronous mixing, and DSGT has no such order (both refused).

mixing_order = sequential reproduces the authors' in-place Gauss-Seidel loop (node i
mixes neighbours j < i that were already updated in this iteration). Writing
W = L + D + U (strictly lower, diagonal, strictly upper) and S = (I - L)^-1, their loops
compute x <- S((D+U) x - a W y) and y <- S((D+U) y + g - g_prev): each node applies
rows of these matrices to values it receives, which needs nodes j < i's gradient
differences in a second exchange ("track") and, off the complete graph, values from
nodes that are not neighbours (a chain of in-place updates). Synchronous mixing
(A = W, the algorithm of the papers) is the default.

Mixing goes through the run's aggregator: each node's combination of the received
models is the W-weighted mean of the ``update.*`` payloads, so a defense can filter
them (the tracker is mixed as is).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from p4bench.engine import DEFAULT_EPSILON, Capabilities, Exchange, LocalUpdate, Method
from p4bench.engine.equivocation import EQUIVOCATION_OPTION
from p4bench.engine.messages import UPDATE_PREFIX, Messages
from p4bench.engine.method import Phase, PlannedRelease, Step, StepContext
from p4bench.engine.method_kit import (
    Edges,
    GraphSchedule,
    draw_batch,
    mix_through_aggregator,
    per_row,
    prefixed_vectors,
    received_any,
    replicate,
    send_along,
    weighted_inbox_sum,
)
from p4bench.engine.state import State, flatten, unvectorize, vectorize
from p4bench.engine.training import batch_gradient
from p4bench.errors import ConfigError
from p4bench.models import Params
from p4bench.options import Option, resolve_options, topology_options
from p4bench.topology import is_connected, metropolis_hastings, uniform_averaging
from p4bench_baselines.gossip_events import defense_reason, release_and_gossip

if TYPE_CHECKING:
    from p4bench.data import ClientTensors

SYNCHRONOUS, SEQUENTIAL = "synchronous", "sequential"
MIXINGS = ("metropolis", "uniform")
COMBINE_THEN_ADAPT, D_PSGD = "combine-then-adapt", "d-psgd"
UPDATE, TRACKER, CORRECTION = UPDATE_PREFIX, "tracker.", "correction."


def mixing_matrix(adjacency: np.ndarray, kind: str) -> np.ndarray:
    """W[i, j]: weight node i gives to node j's value (rows sum to 1)."""
    return metropolis_hastings(adjacency) if kind == "metropolis" else uniform_averaging(adjacency)


def iteration_matrices(
    weights: np.ndarray, order: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(A, B, C) with x <- A x - a B y and y <- A y + C (g - g_prev).

    Synchronous: A = B = W, C = I. Sequential (the authors' in-place loops):
    A = S (D + U), B = S W, C = S with S = (I - L)^-1 (module docstring).
    Computed on the host (the same numbers on every device), returned on the run's
    device (the default device of `p4bench.engine.devices.device_scope`).
    """
    device = torch.get_default_device()
    w = torch.from_numpy(np.asarray(weights, dtype=np.float64))
    identity = torch.eye(len(w), dtype=torch.float64, device="cpu")
    if order == SYNCHRONOUS:
        w = w.to(device)
        return w, w, identity.to(device)
    lower = torch.tril(w, diagonal=-1)
    s = torch.linalg.solve_triangular(identity - lower, identity, upper=False)
    return (s @ (w - lower)).to(device), (s @ w).to(device), s.to(device)


class _Consensus(Method):
    """Shared machinery of DP-DSGD and DP-DSGT (options in the module docstring)."""

    tuning_options = ("local_steps", "data_rate", "clip")  # no client sampling

    capabilities = Capabilities(
        shares_individual_updates=True, has_aggregator=True, personalized=False
    )
    default_epsilon = DEFAULT_EPSILON  # DP-DSGD and DP-DSGT are private by default
    tracking: ClassVar[bool] = False
    options: ClassVar[tuple[Option, ...]] = (
        *topology_options("complete"),
        EQUIVOCATION_OPTION,
        Option(
            "mixing",
            str,
            "metropolis",
            "mixing matrix W: metropolis (1/(1+max(deg_i, deg_j))) or uniform (1/(1+indeg_i))",
            choices=MIXINGS,
        ),
        Option(
            "mixing_order",
            str,
            SYNCHRONOUS,
            "synchronous (the papers) or sequential (the authors' in-place Gauss-Seidel loop)",
            choices=(SYNCHRONOUS, SEQUENTIAL),
        ),
        Option(
            "iterations",
            int,
            None,
            "gossip + gradient iterations per round; default: local_steps K",
            low=1,
        ),
        Option(
            "lr_final",
            float,
            None,
            "step size at the last iteration (geometric decay from lr); default: lr",
            low=0,
            low_open=True,
        ),
    )

    def validate_options(self) -> None:
        values, config = resolve_options(self.options, self.config.options), self.config
        self.iterations = (
            values["iterations"] if values["iterations"] is not None else config.local_steps
        )
        self.lr_final = values["lr_final"] if values["lr_final"] is not None else config.lr
        self.order, self.mixing = values["mixing_order"], values["mixing"]
        self.parallel = (
            values.get("order", COMBINE_THEN_ADAPT) == D_PSGD
        )  # declared by dp-dsgd only
        if self.parallel and self.tracking:
            raise ConfigError(
                "options.order", f"{D_PSGD} is an order of dp-dsgd; gradient tracking has none"
            )
        if self.parallel and self.order == SEQUENTIAL:
            raise ConfigError(
                "options.order",
                f"{D_PSGD} needs mixing_order={SYNCHRONOUS}: the authors' in-place "
                "loop has no D-PSGD form",
            )
        self.graph = GraphSchedule(
            values["topology"], values["topology_options"], self.num_clients, config.seed
        )
        if not self.graph.time_varying and not is_connected(self.graph.adjacency(0)):
            raise ConfigError(
                "options.topology",
                f"graph '{self.graph.name}' is not connected: no consensus possible",
            )
        self.total_iterations = config.rounds * self.iterations
        self._matrices: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._edges: dict[int, tuple[Edges, Edges]] = {}  # who sends to whom: gossip, track
        self.matrices(0)  # refuse a bad graph/mixing combination before training

    def matrices(self, iteration: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key = iteration if self.graph.time_varying else 0
        if key not in self._matrices:
            if len(self._matrices) > 8:
                self._matrices.clear()
                self._edges.clear()
            weights = mixing_matrix(self.graph.adjacency(key), self.mixing)
            a, b, c = self._matrices[key] = iteration_matrices(weights, self.order)
            gossip = (
                (a != 0) | (b != 0) if self.tracking else a != 0
            )  # the tracker rides on the gossip
            self._edges[key] = (
                Edges.of(gossip),
                Edges.of(c != 0),
            )  # once per graph: sends cost the edges
        return self._matrices[key]

    def edges(self, iteration: int) -> tuple[Edges, Edges]:
        """The receivers of each sender in a gossip and in a "track" exchange of an iteration."""
        self.matrices(iteration)
        return self._edges[iteration if self.graph.time_varying else 0]

    def step_size(self, iteration: int) -> float:
        """a_t: geometric decay from lr to lr_final over all iterations."""
        if self.total_iterations <= 1:
            return self.config.lr
        fraction = min(iteration, self.total_iterations - 1) / (self.total_iterations - 1)
        return float(self.config.lr * (self.lr_final / self.config.lr) ** fraction)

    def privacy_plan(self) -> list[PlannedRelease]:
        c = self.config
        return [
            PlannedRelease(
                "train", c.data_rate, self.total_iterations, self.iterations, c.rounds, 1.0
            )
        ]

    def fresh_payloads(self, exchange: str, phase: str, round_index: int) -> bool:
        """DP-DSGD with DP: every gossiped model is past the sender's own noisy step from
        iteration 1 on (iteration 0 gossips the common start). Not DSGT: its model is the mix
        of the neighbours' (x - a y), the same at every node of a complete graph; only its
        tracker holds the sender's own noise."""
        first = round_index * self.iterations  # the round's first iteration
        return exchange == "gossip" and self.config.private and not self.tracking and first >= 1

    def network_events(
        self, exchange: str, phase: str, round_index: int, occurrence: int
    ) -> list[Any] | None:
        if self.network_dp_unavailable() is not None:  # D-PSGD's step enters after the mix
            return None
        t = round_index * self.iterations + occurrence
        return release_and_gossip(
            self.matrices(t)[0].cpu().numpy(), not self.parallel and t > 0, self.parallel
        )

    def network_dp_unavailable(self) -> str | None:
        tracking = "its tracker adds differences of releases (a second state)"
        return tracking if self.tracking else defense_reason(self.config)

    # -- schedule --------------------------------------------------------------------
    def round_steps(self, phase: Phase, round_index: int) -> Sequence[Step]:
        if self.parallel:  # D-PSGD: the gradient at x^t, then the gossip of x^t
            return (LocalUpdate(), Exchange("gossip")) * self.iterations
        one: tuple[Step, ...] = (Exchange("gossip"), LocalUpdate())
        if self.tracking and self.order == SEQUENTIAL:
            one = one + (Exchange("track"),)
        return one * self.iterations

    # -- state -------------------------------------------------------------------------
    def init_client_state(self, train: ClientTensors, ctx: StepContext) -> State:
        count = len(ctx.rows)
        params = replicate(self.initial_params(), count)
        state: State = {"params": params, "iteration": torch.zeros(count, dtype=torch.int64)}
        if self.parallel:  # D-PSGD: a_t g_i(x_i^t), computed before the gossip, applied after it
            state["pending"] = {k: torch.zeros_like(v) for k, v in params.items()}
        if self.tracking:
            zeros = {k: torch.zeros_like(v) for k, v in params.items()}
            state.update(tracker=zeros, previous=dict(zeros), correction=dict(zeros))
        return state

    def deployed_params(self, state: State) -> Params:
        params: Params = state["params"]
        return params

    @staticmethod
    def _iteration(state: State) -> int:
        return int(state["iteration"][0]) if len(state["iteration"]) else 0

    def _mixing(
        self, exchange: str, state: State
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The matrices of the iteration an exchange belongs to: a combine-then-adapt gossip
        opens iteration t; a D-PSGD gossip and DSGT's "track" follow the LocalUpdate that
        already counted iteration t."""
        return self.matrices(self._iteration_of(exchange, state))

    def _iteration_of(self, exchange: str, state: State) -> int:
        t = self._iteration(state)
        return t if exchange == "gossip" and not self.parallel else t - 1

    # -- messages ------------------------------------------------------------------------
    def identical_messages(
        self, exchange: str, phase: str, round_index: int
    ) -> bool | frozenset[str]:
        """Every receiver gets the sender's one model (and tracker; its correction in 'track');
        receivers compare signed digests (p4bench.engine.equivocation)."""
        return True

    def outgoing(self, exchange: str, state: State, ctx: StepContext) -> Messages:
        gossip, track = self.edges(self._iteration_of(exchange, state))
        if exchange == "gossip":
            payload = flatten(state["params"], UPDATE)
            if self.tracking:
                payload.update(flatten(state["tracker"], TRACKER))
            return send_along(ctx.rows, gossip, payload)
        return send_along(ctx.rows, track, flatten(state["correction"], CORRECTION))  # "track"

    def receive(self, exchange: str, state: State, inbox: Messages, ctx: StepContext) -> State:
        t = self._iteration(state)
        a, b, c = self._mixing(exchange, state)
        if exchange == "track":
            weights = c[inbox.dst, inbox.src]
            step = weighted_inbox_sum(
                ctx.rows, inbox, prefixed_vectors(inbox.payload, CORRECTION), weights
            )
            tracker = vectorize(state["tracker"]) + step
            return {**state, "tracker": unvectorize(tracker, state["tracker"])}
        mixed = mix_through_aggregator(
            vectorize(state["params"]), inbox, a[inbox.dst, inbox.src], ctx
        )
        if self.parallel:  # D-PSGD: x_i <- sum_j W_ij x_j - a_t g_i(x_i), the step of local_update
            pending = state["pending"]
            x = mixed - vectorize(pending).to(mixed.dtype)
            cleared = {k: torch.zeros_like(v) for k, v in pending.items()}
            return {**state, "params": unvectorize(x, state["params"]), "pending": cleared}
        if not self.tracking:
            return {**state, "params": unvectorize(mixed, state["params"])}
        got = received_any(ctx.rows, inbox)
        trackers = prefixed_vectors(inbox.payload, TRACKER)
        y = weighted_inbox_sum(ctx.rows, inbox, trackers, a[inbox.dst, inbox.src])
        pulled = (
            y if b is a else weighted_inbox_sum(ctx.rows, inbox, trackers, b[inbox.dst, inbox.src])
        )
        x = mixed - self.step_size(t) * pulled
        y = torch.where(got.unsqueeze(1), y, vectorize(state["tracker"]))
        return {
            **state,
            "params": unvectorize(x, state["params"]),
            "tracker": unvectorize(y, state["tracker"]),
        }

    # -- local computation ----------------------------------------------------------------
    def local_update(
        self, state: State, train: ClientTensors, ctx: StepContext
    ) -> tuple[State, torch.Tensor]:
        t = self._iteration(state)
        x, y, mask = draw_batch(ctx, train)
        grads, loss, done = batch_gradient(ctx, state["params"], x, y, mask, train)
        state = {**state, "iteration": state["iteration"] + 1}
        if not self.tracking:  # DSGD: adapt after combining, or (D-PSGD) after the next gossip
            rate = self.step_size(t)
            step = {k: rate * g * per_row(done, g) for k, g in grads.items()}
            if self.parallel:
                return {**state, "pending": step}, loss
            return {**state, "params": {k: v - step[k] for k, v in state["params"].items()}}, loss
        # DSGT: a node whose budget refused the step keeps its previous gradient (no new release)
        fresh = {
            k: torch.where(per_row(done, g).bool(), g, state["previous"][k])
            for k, g in grads.items()
        }
        correction = {k: fresh[k] - state["previous"][k] for k in fresh}
        tracker = state["tracker"]
        if self.order == SYNCHRONOUS:
            tracker = {k: tracker[k] + correction[k] for k in tracker}
        return {**state, "tracker": tracker, "previous": fresh, "correction": correction}, loss


class DPDSGD(_Consensus):
    """Decentralized (DP-)SGD: mix models with W, then one (DP-)gradient step; with
    ``order = d-psgd``, D-PSGD's order (the step taken before the mix, applied after it)."""

    name = "dp-dsgd"
    description = "DP-DSGD (Bayrooti et al.): gossip with W, then one DP-SGD step per iteration; consensus model"
    options = (
        *_Consensus.options,
        Option(
            "order",
            str,
            COMBINE_THEN_ADAPT,
            "combine-then-adapt: mix, then the gradient at the mixed "
            "model (Bayrooti et al.); d-psgd: the gradient at the pre-gossip model, subtracted after the "
            "mix (D-PSGD, Lian et al. 2017; with DP the PDSL paper's DP-DPSGD baseline, synchronous)",
            choices=(COMBINE_THEN_ADAPT, D_PSGD),
        ),
    )


class DPDSGT(_Consensus):
    """Decentralized (DP-)gradient tracking (Pu & Nedic; Bayrooti et al.'s DP-DSGT)."""

    name = "dp-dsgt"
    description = "DP-DSGT (Bayrooti et al.): gradient tracking (Pu & Nedic) with DP-SGD gradients; consensus model"
    tracking = True


__all__ = ["DPDSGD", "DPDSGT", "iteration_matrices", "mixing_matrix"]
