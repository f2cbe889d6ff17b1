"""Muffliato (Cyffers, Even, Bellet & Massoulié, NeurIPS 2022): decentralized DP-SGD where
every noisy local gradient step is followed by K rounds of gossip averaging.

Per iteration t, every node i (W: the run's mixing matrix, lr: constant step size):
    x_i <- x_i - lr * g_i(x_i)                       # one DP-SGD release (noisy gradient)
    repeat K = gossip_steps times:  x <- W x         # K exchanges of models
g_i is DP-SGD through ``ctx.dp`` exactly as in DP-DSGD (Poisson sampling at rate s,
per-example clipping, Gaussian noise, the ledger); everything sent afterwards is
post-processing of that release. The gradient is taken at the post-gossip model of the
previous iteration, so with K = 1 this is adapt-then-combine DSGD, and with K = 0 it is
local noisy SGD (no message at all). One consensus model (not personalized).

One p4bench round is `iterations` (default: local_steps K) such iterations, so a round
costs the same gradient evaluations as K local steps elsewhere (the convention of
DP-DSGD); a round therefore holds iterations * gossip_steps exchanges (`-o iterations=1`
for exactly gossip_steps exchanges per round).

``chebyshev=true`` replaces the K plain gossip steps by the paper's Chebyshev-accelerated
gossip: x^{k+1} = w_{k+1} W x^k + (1 - w_{k+1}) x^{k-1} with x^1 = W x^0, which computes
p_K(W) x^0 for p_K(z) = T_K(z / lam) / T_K(1 / lam) (T_K: Chebyshev polynomial, lam: the
second largest eigenvalue modulus of W). p_K(1) = 1 keeps the average; on the other
eigenvalues |p_K| <= 1 / T_K(1/lam), which shrinks like (1 - sqrt(2 gap))^K instead of
(1 - gap)^K. It needs an undirected graph (real spectrum).

Privacy. The harness accounts **local DP**: each node's noisy gradient step is one
release seen by its direct neighbours, composed over all iterations, with the noise
calibrated to the target epsilon from `privacy_plan`. Muffliato's network (pairwise)
DP, where gossip amplifies privacy against distant nodes, is reported beside it
(`epsilon_network_*`, `p4bench.privacy.network_record`, from `network_events`), never
in place of the certified epsilon; Chebyshev gossip is not declared (not applicable).

Options (``-o key=value``): gossip_steps, chebyshev, iterations, topology (default
complete), topology_options (mapping), mixing (metropolis | uniform, as DP-DSGD).
Mixing goes through the run's aggregator (``update.*`` payloads, W-weighted), so a
defense acts on every gossip step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

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
    replicate,
    send_along,
)
from p4bench.engine.state import State, flatten, unvectorize, vectorize
from p4bench.engine.training import batch_gradient
from p4bench.errors import ConfigError
from p4bench.models import Params
from p4bench.options import Option, resolve_options, topology_options
from p4bench_baselines.dsgt import MIXINGS, mixing_matrix
from p4bench_baselines.gossip_events import defense_reason, release_and_gossip

if TYPE_CHECKING:
    from p4bench.data import ClientTensors
from p4bench.topology import is_connected, is_symmetric, spectral_gap

UPDATE = UPDATE_PREFIX


def chebyshev_weights(lam: float, steps: int) -> list[float]:
    """w_1..w_steps of the Chebyshev gossip recursion x^{k+1} = w W x^k + (1 - w) x^{k-1}.

    With c_k = T_k(1/lam): w_{k+1} = 2 c_k / (lam c_{k+1}) and c_{k+1} = (2/lam) c_k - c_{k-1}.
    Computed from the ratio r_k = c_{k-1} / c_k (r_1 = lam) so it never overflows:
    w_{k+1} = 1 / (1 - lam r_k / 2), r_{k+1} = lam / (2 - lam r_k). w_1 = 1 (x^1 = W x^0);
    lam = 0 (W already averages exactly) gives plain gossip.
    """
    weights, ratio = [1.0], lam
    for _ in range(steps - 1):
        weights.append(1.0 / (1.0 - lam * ratio / 2.0))
        ratio = lam / (2.0 - lam * ratio)
    return weights[:steps]


class Muffliato(Method):
    """Noisy local gradient step, then K (optionally Chebyshev-accelerated) gossip steps."""

    name = "muffliato"
    tuning_options = ("local_steps", "data_rate", "clip")  # no client sampling
    description = (
        "Muffliato (Cyffers et al. 2022): DP-SGD step then K gossip steps with W; consensus model "
        "(local-DP accounting)"
    )
    capabilities = Capabilities(
        shares_individual_updates=True, has_aggregator=True, personalized=False
    )
    default_epsilon = DEFAULT_EPSILON  # private by default, like DP-DSGD
    options = (
        Option(
            "gossip_steps",
            int,
            1,
            "gossip exchanges (x <- W x) after every noisy gradient step; 0: local noisy SGD",
            low=0,
        ),
        Option(
            "chebyshev",
            bool,
            False,
            "Chebyshev-accelerated gossip (the paper's accelerated variant; undirected graphs)",
        ),
        Option(
            "iterations",
            int,
            None,
            "noisy step + gossip iterations per round; default: local_steps K",
            low=1,
        ),
        *topology_options("complete"),
        EQUIVOCATION_OPTION,
        Option(
            "mixing",
            str,
            "metropolis",
            "mixing matrix W: metropolis (1/(1+max(deg_i, deg_j))) or uniform (1/(1+indeg_i))",
            choices=MIXINGS,
        ),
    )

    def validate_options(self) -> None:
        values, config = resolve_options(self.options, self.config.options), self.config
        self.gossip_steps = int(values["gossip_steps"])
        self.chebyshev = bool(values["chebyshev"])
        self.iterations = (
            values["iterations"] if values["iterations"] is not None else config.local_steps
        )
        self.mixing = values["mixing"]
        self.graph = GraphSchedule(
            values["topology"], values["topology_options"], self.num_clients, config.seed
        )
        first = self.graph.adjacency(0)
        if not self.graph.time_varying and not is_connected(first):
            raise ConfigError(
                "options.topology",
                f"graph '{self.graph.name}' is not connected: no consensus possible",
            )
        if self.chebyshev and not is_symmetric(first):
            raise ConfigError(
                "options.chebyshev",
                f"needs an undirected graph (real spectrum); '{self.graph.name}' is directed",
            )
        self._cache: dict[int, tuple[torch.Tensor, list[float], Edges]] = {}
        self.gossip(0)  # refuse a bad graph/mixing combination before training

    def gossip(self, iteration: int) -> tuple[torch.Tensor, list[float]]:
        """(W, [w_1..w_K]) of an iteration: the mixing matrix and the weight of W x^k in each
        gossip step (all 1 without Chebyshev acceleration)."""
        return self._mixing(iteration)[:2]

    def _mixing(self, iteration: int) -> tuple[torch.Tensor, list[float], Edges]:
        """`gossip`'s (W, omega) and W's edges, computed once per graph."""
        key = iteration if self.graph.time_varying else 0
        if key not in self._cache:
            if len(self._cache) > 8:
                self._cache.clear()
            weights = mixing_matrix(self.graph.adjacency(key), self.mixing)
            steps = max(self.gossip_steps, 1)
            omega = (
                chebyshev_weights(1.0 - spectral_gap(weights), steps)
                if self.chebyshev
                else [1.0] * steps
            )
            matrix = torch.from_numpy(np.asarray(weights, dtype=np.float64)).to(
                torch.get_default_device()
            )
            self._cache[key] = (matrix, omega, Edges.of(matrix != 0))
        return self._cache[key]

    def privacy_plan(self) -> list[PlannedRelease]:
        c = self.config  # every node takes one DP step per iteration, every round
        return [
            PlannedRelease(
                "train", c.data_rate, c.rounds * self.iterations, self.iterations, c.rounds, 1.0
            )
        ]

    def privacy_context(self) -> dict[str, Any]:
        adjacency = np.asarray(self.graph.adjacency(0), dtype=bool)
        return {
            "receivers_per_release": int(adjacency.sum(axis=1).max()) if self.gossip_steps else 0,
            "gossip_steps": self.gossip_steps,
            "amplification": "certified epsilon: local DP; pairwise network DP beside it (network_dp)",
        }

    def network_events(
        self, exchange: str, phase: str, round_index: int, occurrence: int
    ) -> list[Any] | None:
        """Each iteration: every node's noisy step, then `gossip_steps` mixes with its W."""
        if self.network_dp_unavailable() is not None:
            return None
        iteration, hop = divmod(occurrence, self.gossip_steps)
        weights = self.gossip(round_index * self.iterations + iteration)[0]
        return release_and_gossip(weights.cpu().numpy(), release_before=hop == 0)

    def network_dp_unavailable(self) -> str | None:
        if self.chebyshev:  # x^{k+1} = w W x^k + (1 - w) x^{k-1}: no mix of the current states
            return "Chebyshev gossip reads each node's state two steps back"
        return defense_reason(self.config)

    def fresh_payloads(self, exchange: str, phase: str, round_index: int) -> bool:
        """With DP and one gossip step per noisy step, every model sent follows a fresh noisy
        step; further gossip steps may repeat a model once the neighbourhood agrees."""
        return exchange == "gossip" and self.config.private and self.gossip_steps == 1

    # -- schedule --------------------------------------------------------------------------
    def round_steps(self, phase: Phase, round_index: int) -> Sequence[Step]:
        return ((LocalUpdate(),) + (Exchange("gossip"),) * self.gossip_steps) * self.iterations

    # -- state -------------------------------------------------------------------------------
    def init_client_state(self, train: ClientTensors, ctx: StepContext) -> State:
        count = len(ctx.rows)
        params = replicate(self.initial_params(), count)
        state: State = {
            "params": params,
            "iteration": torch.zeros(count, dtype=torch.int64),
            "hop": torch.zeros(count, dtype=torch.int64),
        }
        if self.chebyshev:
            state["previous"] = {
                k: v.clone() for k, v in params.items()
            }  # x^{k-1} of the recursion
        return state

    def deployed_params(self, state: State) -> Params:
        params: Params = state["params"]
        return params

    @staticmethod
    def _counter(state: State, name: str) -> int:
        return int(state[name][0]) if len(state[name]) else 0

    # -- messages ----------------------------------------------------------------------------
    def identical_messages(
        self, exchange: str, phase: str, round_index: int
    ) -> bool | frozenset[str]:
        """Every neighbour gets the sender's one model;
        receivers compare signed digests (p4bench.engine.equivocation)."""
        return True

    def outgoing(self, exchange: str, state: State, ctx: StepContext) -> Messages:
        _, _, edges = self._mixing(self._counter(state, "iteration") - 1)
        return send_along(ctx.rows, edges, flatten(state["params"], UPDATE))

    def receive(self, exchange: str, state: State, inbox: Messages, ctx: StepContext) -> State:
        weights, omega = self.gossip(self._counter(state, "iteration") - 1)
        hop = self._counter(state, "hop")
        own = vectorize(state["params"])
        mixed = mix_through_aggregator(own, inbox, weights[inbox.dst, inbox.src], ctx)
        state = {**state, "hop": state["hop"] + 1}
        if not self.chebyshev:
            return {**state, "params": unvectorize(mixed, state["params"])}
        w = omega[hop]  # x^{k+1} = w W x^k + (1 - w) x^{k-1}; w = 1 at the first hop
        new = w * mixed + (1.0 - w) * vectorize(state["previous"]) if w != 1.0 else mixed
        return {**state, "params": unvectorize(new, state["params"]), "previous": state["params"]}

    # -- local computation ---------------------------------------------------------------------
    def local_update(
        self, state: State, train: ClientTensors, ctx: StepContext
    ) -> tuple[State, torch.Tensor]:
        x, y, mask = draw_batch(ctx, train)
        grads, loss, done = batch_gradient(ctx, state["params"], x, y, mask, train)
        rate = self.config.lr  # a node whose budget refused the step (done = 0) stays put
        params = {k: v - rate * grads[k] * per_row(done, v) for k, v in state["params"].items()}
        state = {
            **state,
            "params": params,
            "iteration": state["iteration"] + 1,
            "hop": torch.zeros_like(state["hop"]),
        }
        if self.chebyshev:
            state["previous"] = params  # x^0 of the next gossip; unused at the first hop (w_1 = 1)
        return state, loss


__all__ = ["Muffliato", "chebyshev_weights"]
