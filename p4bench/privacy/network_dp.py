"""Pairwise network DP: what node v's view of a gossip run reveals about one record of node u.

Local DP (every other epsilon the suite prints) is the loss against whoever receives a
node's releases directly. In gossip learning most nodes only ever see mixtures of them,
and this accountant measures that loss for every ordered pair, epsilon(u -> v), from the
run's events (`p4bench.privacy.network_events`: `Release`, `Gossip`).

The analysis (linear-Gaussian, exact up to one bound on the worst shift). Number the
releases r = 1..n. Each is R_r = g_r + sigma_r z_r: a data-dependent part g_r of
sensitivity 1 (the noise multiplier is the noise std over the sensitivity) plus
independent standard Gaussian noise; states are linear in the releases, so every message
is a public linear combination of them. Node v's view, whitened, is Y_v = A_v (g / sigma +
z), one row per message v receives plus one unit row per release of v's own (v knows what
it released and can subtract it from what it hears; MFDL's accounting code adds the same
rows as the attacker's "additional knowledge"). One record of u moves the
whitened releases by e_r / sigma_r on u's releases, |e_r| <= 1, and nothing else, so the
Renyi divergence of order alpha between the two views is (alpha / 2) e^T D^-1 P_v D^-1 e,
with P_v the orthogonal projection onto the row space of A_v (the quadratic form
(A e)^T (A A^T)^+ (A e), which accounts for the correlations between messages). The
maximum over e is bounded by mu^2 = min(sum_{r,r'} |Q_{r r'}|, n_u lambda_max(Q),
sum_r 1 / sigma_r^2) with Q = (D^-1 P_v D^-1) on u's releases: the first is MFDL's
sensitivity bound (Bellet, Cyffers, Frey, Gaudel, Lerevérend, Taiani, ICLR 2026,
``compute_cyclic_repetitions_1node``), the second the spectral one, the third what seeing
every release directly costs (P <= I). All three also hold for vector releases whose
per-release shift has L2 norm <= 1 (the trace of Q against a Gram matrix with unit
diagonal), so the view is mu-GDP and its Renyi curve is alpha mu^2 / 2.

Adaptivity. The bound is a proof when the data-dependent parts are fixed in advance
(private averaging, Muffliato's gossip theorem) or chosen from what the observer itself
sees: whitening the observed messages in time order turns them into innovations with
fresh noise, an adaptive composition of Gaussian mechanisms whose squared sensitivities sum
to at most mu^2 (the argument of Denisov et al. 2022 that MFDL applies). In gossip SGD the
gradients are taken at states the observer does not see (u's own and every other node's,
and another node's may depend non-linearly on a release of u the observer never saw),
which that argument does not cover; Muffliato and MFDL take the same modelling step. So
the figure is reported as network DP beside the certified local DP, and every pair is
clipped to u's local-DP epsilon when it is given, never above it.

Collusion: a coalition's view is the union of its members' views (messages and own
releases). ``colluders=K`` puts in [u, v] the worst coalition of K nodes containing v and
not u: exact enumeration while C(N, K) <= `MAX_EXACT_COALITIONS`, else a stated greedy
heuristic (a lower estimate of the worst coalition). A sequence of nodes S puts in [u, v]
the loss to S + {v}; pairs with u in S are NaN (u is a colluder). The diagonal is 0: a
node's own data is not a privacy loss.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from p4bench.errors import ConfigError
from p4bench.privacy.network_amplification import amplified_epsilon
from p4bench.privacy.network_conversion import CONVERSIONS, sensitivity_epsilon
from p4bench.privacy.network_events import NetworkEvent
from p4bench.privacy.network_views import (
    NetworkViews,
    build_views,
    coalition_gram,
    coalition_sensitivity,
)

__all__ = [
    "MAX_EXACT_COALITIONS",
    "NetworkDP",
    "pairwise_epsilon",
    "pairwise_rdp",
    "pairwise_sensitivity",
    "summarize",
]

MAX_EXACT_COALITIONS = 2000
"""Above this many coalitions of K nodes the worst one is searched greedily."""

ACCOUNTANT = "network-linear-gaussian"


@dataclass(frozen=True)
class NetworkDP:
    """Pairwise network DP of a run.

    Attributes:
        epsilon: (N, N), [u, v] = epsilon(u -> v) at `delta`: what v's view (or v's
            coalition's) reveals about one record of u; clipped to ``local_epsilon[u]``
            when given; 0 on the diagonal; NaN where u is a named colluder.
        delta: the delta of every figure.
        colluders: the coalition size K, or the named colluders.
        accountant: the analysis, the conversion and which bound decided how many pairs.
        relation: the neighbouring relation (the one the noise multipliers are stated for).
        sensitivity: (N, N) the Gaussian sensitivity mu(u -> v) before clipping.
        clipped: (N, N) bool, pairs where the local-DP bound was the tighter.
        coalition_search: ``single`` | ``named`` | ``exact`` | ``greedy``.
    """

    epsilon: np.ndarray
    delta: float
    colluders: int | tuple[int, ...]
    accountant: str
    relation: str
    sensitivity: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    clipped: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=bool))
    coalition_search: str = "single"


def _check_nodes(num_nodes: int) -> int:
    if isinstance(num_nodes, bool) or int(num_nodes) != num_nodes or num_nodes < 1:
        raise ConfigError("num_nodes", f"must be an integer >= 1, got {num_nodes}")
    return int(num_nodes)


Score = Callable[[list[int]], np.ndarray]
"""A coalition's losses, (k, N): rows of figures for every u, each maximised on its own."""


def _single_views(views: NetworkViews, score: Score) -> np.ndarray:
    columns = [score([v]) for v in range(views.num_nodes)]
    return np.stack(columns, axis=-1)


def _named(views: NetworkViews, named: Sequence[int], score: Score) -> np.ndarray:
    n = views.num_nodes
    members = sorted({int(w) for w in named})
    if any(not 0 <= w < n for w in members):
        raise ConfigError("colluders", f"nodes must be in [0, {n}), got {list(named)}")
    columns = []
    for v in range(n):
        coalition = sorted(set(members) | {v})
        losses = score(coalition)
        losses[:, coalition] = 0.0
        columns.append(losses)
    losses = np.stack(columns, axis=-1)
    losses[:, members, :] = math.nan
    return losses


def _worst_coalitions(views: NetworkViews, size: int, score: Score) -> tuple[np.ndarray, str]:
    n = views.num_nodes
    if size > n - 1:
        raise ConfigError(
            "colluders", f"a coalition must leave u out: at most {n - 1} nodes, got {size}"
        )
    if math.comb(n, size) > MAX_EXACT_COALITIONS:
        return _greedy_coalitions(views, size, score), "greedy"
    worst: np.ndarray | None = None
    for coalition in itertools.combinations(range(n), size):
        losses = score(list(coalition))
        if worst is None:
            worst = np.zeros((losses.shape[0], n, n))
        outside = np.setdiff1d(np.arange(n), coalition)
        for v in coalition:
            worst[:, outside, v] = np.maximum(worst[:, outside, v], losses[:, outside])
    assert worst is not None
    return worst, "exact"


def _greedy_coalitions(views: NetworkViews, size: int, score: Score) -> np.ndarray:
    """For each v, grow v's coalition one node at a time by the member that most raises
    the total loss (the last row of `score`) of the nodes outside; each u inside is then
    scored against the coalition without u. A heuristic: the worst coalition can only be
    worse."""
    n = views.num_nodes
    columns = []
    for v in range(n):
        coalition = [v]
        while len(coalition) < size:
            best, best_total = -1, -1.0
            for candidate in range(n):
                if candidate in coalition:
                    continue
                trial = [*coalition, candidate]
                total = float(np.delete(score(trial)[-1], trial).sum())
                if total > best_total:
                    best, best_total = candidate, total
            coalition.append(best)
        losses = score(coalition)
        for u in coalition[1:]:  # u may not collude against itself: its best coalition without it
            losses[:, u] = score([w for w in coalition if w != u])[:, u]
        columns.append(losses)
    return np.stack(columns, axis=-1)


def _search(
    views: NetworkViews, colluders: int | Sequence[int], score: Score
) -> tuple[np.ndarray, str]:
    """(k, N, N) the worst of `score` over the coalitions `colluders` allows, and how."""
    if isinstance(colluders, (int, np.integer)) and not isinstance(colluders, bool):
        if colluders < 1:
            raise ConfigError("colluders", f"must be >= 1 or a list of nodes, got {colluders}")
        if colluders == 1:
            losses, search = _single_views(views, score), "single"
        else:
            losses, search = _worst_coalitions(views, int(colluders), score)
    elif isinstance(colluders, Sequence) and not isinstance(colluders, str):
        losses, search = _named(views, colluders, score), "named"
    else:
        raise ConfigError("colluders", f"must be a count or a list of nodes, got {colluders!r}")
    for row in losses:
        np.fill_diagonal(row, 0.0)
    return losses, search


def pairwise_sensitivity(
    events: Sequence[NetworkEvent], num_nodes: int, colluders: int | Sequence[int] = 1
) -> tuple[np.ndarray, str]:
    """(N, N) Gaussian sensitivity mu(u -> v) of the views, and how coalitions were searched.

    mu^2 is the Renyi divergence of order alpha divided by alpha / 2 (module docstring).
    """
    views = build_views(events, _check_nodes(num_nodes))
    losses, search = _search(views, colluders, lambda c: coalition_sensitivity(views, c)[None])
    with np.errstate(invalid="ignore"):
        return np.sqrt(losses[0]), search


def _amplified_score(views: NetworkViews, delta: float, conversion: str) -> Score:
    """[mu^2, epsilon] of a coalition: epsilon the smaller of the Gaussian figure and the
    subsampled one (`p4bench.privacy.network_amplification`)."""
    padded = np.append(views.rate, 1.0)[views.release_index]  # index -1: padding

    def score(coalition: list[int]) -> np.ndarray:
        mu2, gram = coalition_gram(views, coalition)
        with np.errstate(invalid="ignore"):
            epsilon = sensitivity_epsilon(np.sqrt(mu2), delta, conversion)
        amplified = amplified_epsilon(gram, padded, delta)
        epsilon = np.where(np.isinf(mu2), math.inf, np.minimum(epsilon, amplified))
        return np.stack([mu2, epsilon])

    return score


def pairwise_rdp(
    events: Sequence[NetworkEvent], num_nodes: int, orders: Sequence[float]
) -> np.ndarray:
    """(N, N, len(orders)) Renyi DP of what node v's view (every message it receives and
    its own releases) reveals about one record of node u, [u, v, order]: alpha mu^2 / 2.

    The diagonal (u == v) is 0: a node's own data is not a privacy loss.
    """
    mu, _ = pairwise_sensitivity(events, num_nodes)
    alphas = np.asarray(orders, dtype=float)
    if alphas.ndim != 1 or np.any(alphas <= 1):
        raise ConfigError("orders", "Renyi orders must be a list of numbers > 1")
    with np.errstate(invalid="ignore"):
        rdp: np.ndarray = mu[..., None] ** 2 * alphas / 2.0
    return rdp


def _local_bound(local_epsilon: float | np.ndarray | None, num_nodes: int) -> np.ndarray:
    if local_epsilon is None:
        return np.full(num_nodes, math.inf)
    bound = np.broadcast_to(np.asarray(local_epsilon, dtype=float), (num_nodes,)).copy()
    if np.any(np.isnan(bound)) or np.any(bound < 0):
        raise ConfigError("local_epsilon", "must be >= 0 for every node")
    return bound


def pairwise_epsilon(
    events: Sequence[NetworkEvent],
    num_nodes: int,
    delta: float,
    colluders: int | Sequence[int] = 1,
    local_epsilon: float | np.ndarray | None = None,
    conversion: str = "gdp",
    relation: str = "add-remove",
) -> NetworkDP:
    """Pairwise epsilon(u -> v) at `delta` of the run described by `events`.

    `local_epsilon` (a number, or one per node) is u's local-DP epsilon at the same delta:
    every pair is clipped to it. `conversion` is ``gdp`` (exact Gaussian profile, default)
    or ``rdp`` (Balle et al. 2020 from the Renyi curve); see
    `p4bench.privacy.network_conversion`. `relation` only labels the result: the noise
    multipliers of the events are stated against that relation's sensitivity.
    """
    if conversion not in CONVERSIONS:
        raise ConfigError(
            "conversion", f"must be one of {', '.join(CONVERSIONS)}, got {conversion!r}"
        )
    num_nodes = _check_nodes(num_nodes)
    views = build_views(events, num_nodes)
    bound = _local_bound(local_epsilon, num_nodes)
    sampling_note = ""
    if np.any(views.rate < 1.0):
        losses, search = _search(views, colluders, _amplified_score(views, delta, conversion))
        with np.errstate(invalid="ignore"):
            mu = np.sqrt(losses[0])
        named = np.isnan(mu)
        gaussian = sensitivity_epsilon(np.where(named, 0.0, mu), delta, conversion)
        raw = np.where(named, 0.0, losses[1])
        gained = int(((raw < gaussian) & ~named & ~np.eye(num_nodes, dtype=bool)).sum())
        sampling_note = (
            f"; Poisson subsampling (rate >= {views.rate.min():.3g}) tighter on {gained} pairs"
        )
    else:
        mu, search = pairwise_sensitivity(events, num_nodes, colluders)
        named = np.isnan(mu)
        raw = sensitivity_epsilon(np.where(named, 0.0, mu), delta, conversion)
    clipped = (raw > bound[:, None]) & ~named
    epsilon = np.where(clipped, bound[:, None], raw)
    epsilon[named] = math.nan
    np.fill_diagonal(epsilon, 0.0)
    np.fill_diagonal(clipped, False)
    pairs = num_nodes * (num_nodes - 1) - int(named.sum())
    clip_note = (
        f"; clipped to local DP on {int(clipped.sum())} of {pairs} pairs"
        if local_epsilon is not None
        else "; no local-DP clip given"
    )
    accountant = (
        f"{ACCOUNTANT} ({conversion}): exact projection of each view, worst shift bounded by "
        f"min(sum|P|, n_u lambda_max, all releases seen){sampling_note}; coalitions: "
        f"{search}{clip_note}"
    )
    return NetworkDP(
        epsilon=epsilon,
        delta=float(delta),
        colluders=int(colluders)
        if isinstance(colluders, (int, np.integer))
        else tuple(int(w) for w in colluders),
        accountant=accountant,
        relation=f"{relation}: one record of u moves each release of u by at most its sensitivity",
        sensitivity=mu,
        clipped=clipped,
        coalition_search=search,
    )


def _hops(adjacency: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(neighbours, at distance exactly 2) of the undirected graph under `adjacency`."""
    links = np.asarray(adjacency, dtype=bool)
    links = links | links.T
    np.fill_diagonal(links, False)
    reach = links.astype(np.int64)
    two = ((reach @ reach) > 0) & ~links
    np.fill_diagonal(two, False)
    return links, two


def _mean(values: np.ndarray) -> float:
    values = values[~np.isnan(values)]
    return float(values.mean()) if values.size else math.nan


def summarize(result: NetworkDP, adjacency: np.ndarray) -> dict[str, float]:
    """The run-summary figures of `result` on the graph `adjacency` ((N, N), ``A[i, j]``: an
    edge; direction ignored; for a time-varying graph pass the union over rounds).

    epsilon_network_max and _mean are over pairs u != v; _neighbour_mean over graph
    neighbours; _two_hop_mean over pairs at graph distance exactly 2 (NaN if none).
    """
    epsilon = np.asarray(result.epsilon, dtype=float)
    n = epsilon.shape[0]
    adjacency = np.asarray(adjacency)
    if adjacency.shape != (n, n):
        raise ConfigError("adjacency", f"must be ({n}, {n}) like the result, got {adjacency.shape}")
    off = ~np.eye(n, dtype=bool)
    neighbours, two_hop = _hops(adjacency)
    pairs = epsilon[off]
    finite = pairs[~np.isnan(pairs)]
    return {
        "epsilon_network_max": float(finite.max()) if finite.size else math.nan,
        "epsilon_network_mean": _mean(pairs),
        "epsilon_network_neighbour_mean": _mean(epsilon[neighbours]),
        "epsilon_network_two_hop_mean": _mean(epsilon[two_hop]),
    }
