"""The network-DP accountant against closed forms (p4bench.privacy.network_dp)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from p4bench.errors import ConfigError
from p4bench.privacy.network_conversion import gaussian_epsilon, rdp_curve_epsilon
from p4bench.privacy.network_dp import (
    pairwise_epsilon,
    pairwise_rdp,
    pairwise_sensitivity,
    summarize,
)
from p4bench.privacy.network_events import Gossip, Release
from p4bench.privacy.pld import pld_epsilon
from p4bench.topology.mixing import metropolis_hastings

SIGMA = 2.0
DELTA = 1e-5


def _everyone(n: int, sigma: float = SIGMA) -> Release:
    return Release(nodes=np.ones(n, dtype=bool), noise_multiplier=sigma)


def _graph(n: int, edges: list[tuple[int, int]]) -> np.ndarray:
    adjacency = np.zeros((n, n), dtype=bool)
    for i, j in edges:
        adjacency[i, j] = adjacency[j, i] = True
    return adjacency


def _ring(n: int) -> np.ndarray:
    return _graph(n, [(k, (k + 1) % n) for k in range(n)])


def test_complete_graph_one_step_is_local_dp() -> None:
    """v hears every release directly: the network bound is the local DP of one release."""
    n = 6
    uniform = np.full((n, n), 1.0 / n)
    events = [_everyone(n), Gossip(uniform)]
    rdp = pairwise_rdp(events, n, orders=[2.0, 8.0])
    off = ~np.eye(n, dtype=bool)
    assert np.allclose(rdp[off], np.array([2.0, 8.0]) / (2 * SIGMA**2))
    assert np.all(rdp[np.eye(n, dtype=bool)] == 0)
    local = pld_epsilon([(SIGMA, 1.0, 1)], DELTA)
    result = pairwise_epsilon(events, n, DELTA)
    assert np.allclose(result.epsilon[off], local, rtol=2e-3)  # pld discretises pessimistically


def test_complete_graph_two_steps_adds_nothing() -> None:
    """After the first averaging every node holds the same public average of releases v
    has already heard: the second step reveals nothing new (by hand: mu^2 = 1/sigma^2)."""
    n = 5
    uniform = np.full((n, n), 1.0 / n)
    mu, _ = pairwise_sensitivity([_everyone(n), Gossip(uniform), Gossip(uniform)], n)
    off = ~np.eye(n, dtype=bool)
    assert np.allclose(mu[off] ** 2, 1.0 / SIGMA**2)


def test_two_hops_one_step_reveals_nothing() -> None:
    n = 7
    weights = metropolis_hastings(_ring(n))
    mu, _ = pairwise_sensitivity([_everyone(n), Gossip(weights)], n)
    assert mu[0, 2] == 0.0 and mu[0, 5] == 0.0
    assert mu[0, 1] == pytest.approx(1.0 / SIGMA)


def test_two_hops_two_steps_through_the_middle_node() -> None:
    """u - m - v, m also linked to x (not v's neighbour): v's second message is m's state
    W_mu R_u + W_mm R_m + W_mv R_v + W_mx R_x; v knows R_v and heard R_m, so the closed form
    is W_mu^2 / (W_mu^2 + W_mx^2) times one release's RDP."""
    u, m, v, x = 0, 1, 2, 3
    weights = metropolis_hastings(_graph(4, [(u, m), (m, v), (m, x)]))
    events = [_everyone(4), Gossip(weights), Gossip(weights)]
    mu, _ = pairwise_sensitivity(events, 4)
    closed = weights[m, u] ** 2 / (weights[m, u] ** 2 + weights[m, x] ** 2)
    assert mu[u, v] ** 2 * SIGMA**2 == pytest.approx(closed)
    assert 0 < closed < 1


def test_ring_two_steps_middle_node_exposes_u() -> None:
    """On a ring the middle node's neighbours are u and v only: v heard R_m at step 1 and
    knows R_v, so m's mixture at step 2 gives R_u away (the correlation a per-message
    sum misses: it would report W_mu^2 / ||W_m||^2 = 1/3 of the local RDP)."""
    n = 6
    weights = metropolis_hastings(_ring(n))
    mu, _ = pairwise_sensitivity([_everyone(n), Gossip(weights), Gossip(weights)], n)
    assert mu[0, 2] ** 2 * SIGMA**2 == pytest.approx(1.0)


def test_own_releases_are_known_to_the_attacker() -> None:
    """Two nodes averaging: v hears u's release directly, so whatever else is sent, u is
    exposed; three nodes on a path, the end node hears only the middle one's mixture
    after the middle one mixed u's release with its own and v's."""
    weights = metropolis_hastings(_graph(3, [(0, 1), (1, 2)]))
    events = [Release(np.array([True, True, True]), SIGMA), Gossip(weights), Gossip(weights)]
    mu, _ = pairwise_sensitivity(events, 3)
    assert mu[0, 2] ** 2 * SIGMA**2 == pytest.approx(1.0)  # R_1 heard, R_2 own: R_0 follows


def test_network_bound_never_exceeds_local() -> None:
    n = 8
    rng = np.random.default_rng(3)
    weights = metropolis_hastings(_ring(n))
    events = []
    for _ in range(4):
        events += [Release(rng.random(n) < 0.7, 1.5), Gossip(weights), Gossip(weights)]
    mu, _ = pairwise_sensitivity(events, n)
    releases = np.zeros(n)
    for event in events:
        if isinstance(event, Release):
            releases += event.nodes
    assert np.all(mu**2 <= releases[:, None] / 1.5**2 + 1e-9)
    result = pairwise_epsilon(events, n, DELTA, local_epsilon=0.5)
    assert np.nanmax(result.epsilon) <= 0.5
    assert result.clipped.any()


def test_coalitions_see_more_and_named_sets() -> None:
    n = 7
    weights = metropolis_hastings(_ring(n))
    events = [_everyone(n), Gossip(weights), _everyone(n), Gossip(weights)]
    single, _ = pairwise_sensitivity(events, n)
    pairs, search = pairwise_sensitivity(events, n, colluders=2)
    assert search == "exact"
    assert np.all(pairs >= single - 1e-12)
    assert (pairs > single + 1e-9).any()
    named, search = pairwise_sensitivity(events, n, colluders=[3])
    assert search == "named"
    assert np.all(np.isnan(named[3, np.arange(n) != 3]))
    assert np.all(named[[0, 1, 2, 4, 5, 6], 0][[0]] >= 0)
    # the coalition {3, v} sees at least what v alone sees, and never more than pairs' worst
    keep = np.array([u for u in range(n) if u != 3])
    assert np.all(named[np.ix_(keep, keep)] >= single[np.ix_(keep, keep)] - 1e-12)
    assert np.all(named[np.ix_(keep, keep)] <= pairs[np.ix_(keep, keep)] + 1e-12)


def test_summary_on_a_ring() -> None:
    n = 8
    adjacency = _ring(n)
    weights = metropolis_hastings(adjacency)
    events = []
    for _ in range(3):
        events += [_everyone(n), Gossip(weights)]
    result = pairwise_epsilon(events, n, DELTA)
    summary = summarize(result, adjacency)
    assert summary["epsilon_network_two_hop_mean"] < summary["epsilon_network_neighbour_mean"]
    assert summary["epsilon_network_max"] == pytest.approx(
        summary["epsilon_network_neighbour_mean"]
    )
    complete = summarize(result, ~np.eye(n, dtype=bool))
    assert math.isnan(complete["epsilon_network_two_hop_mean"])


def test_conversions() -> None:
    mu = np.array([0.0, 0.3, 1.0, 4.0, math.inf])
    gdp = gaussian_epsilon(mu, DELTA)
    rdp = rdp_curve_epsilon(mu, DELTA)
    assert gdp[0] == 0 and math.isinf(gdp[-1])
    assert np.all(gdp[1:4] <= rdp[1:4])
    for value, expected in zip(mu[1:4], gdp[1:4], strict=True):
        assert pld_epsilon([(1.0 / value, 1.0, 1)], DELTA) == pytest.approx(expected, rel=3e-3)


def test_bad_input() -> None:
    with pytest.raises(ConfigError):
        pairwise_sensitivity([Gossip(np.eye(3))], 4)
    with pytest.raises(ConfigError):
        pairwise_sensitivity([Release(np.ones(3, bool), -1.0)], 3)
    with pytest.raises(ConfigError):
        pairwise_sensitivity([_everyone(3)], 3, colluders=3)
    with pytest.raises(ConfigError):
        pairwise_epsilon([_everyone(3)], 3, delta=2.0)


# Reference values: MFDL's own code (Bellet, Cyffers, Frey, Gaudel, Lerévérend, Taïani,
# "Unified Privacy Guarantees for Decentralized Learning via Matrix Factorization", ICLR 2026),
# github.com/dimiarbre/MFDL at commit c8529295985853ced4f31d940fe82ab9bb56c42c,
# MFDL/simulations/muffliato_accounting.py::compute_muffliato_privacy_loss, in the
# configuration of the paper's accounting figure (`main()`: attacker 0,
# participation_interval 1, nb_repetitions 10; utils.get_graph adds self-loops and
# get_communication_matrix row-normalises, i.e. `uniform_averaging`): the Gaussian
# sensitivity sqrt(sum |P|) of eps(u -> 0) for u = 1..N-1 (sigma = 1). Muffliato's corrected
# Theorem 11 (`epsilon_upper_bound` there, alpha = 2) is clipped to local DP (10) for every u
# in both graphs. The suite takes min(sum|P|, n_u lambda_max, n_u / sigma^2), so it equals
# MFDL where sum|P| is the tightest and is sqrt(10) where MFDL's figure exceeds full exposure.
FLORENTINE_EDGES = [
    (0, 1),
    (1, 5),
    (1, 6),
    (1, 7),
    (1, 8),
    (1, 9),
    (2, 3),
    (2, 4),
    (2, 5),
    (3, 4),
    (3, 11),
    (4, 6),
    (4, 11),
    (6, 7),
    (7, 12),
    (8, 12),
    (8, 13),
    (9, 10),
    (11, 12),
    (12, 14),
]  # networkx.florentine_families_graph() with integer labels, as MFDL's get_graph numbers it
MFDL_FLORENTINE_T10 = [
    3.303173,
    0.360683,
    0.24568,
    0.398968,
    0.576616,
    0.713411,
    0.732386,
    0.660687,
    0.675219,
    0.357594,
    0.254465,
    0.50177,
    0.260047,
    0.145761,
]
MFDL_CYCLE10_T10 = [
    3.238749,
    1.438052,
    0.736401,
    0.346254,
    0.198534,
    0.346254,
    0.736401,
    1.438052,
    3.238749,
]
MFDL_CYCLE10_T3 = [1.685566, 0.515273, 0.104314, 0.0, 0.0, 0.0, 0.104314, 0.515273, 1.685566]


@pytest.mark.parametrize(
    ("adjacency", "steps", "reference"),
    [
        (_graph(15, FLORENTINE_EDGES), 10, MFDL_FLORENTINE_T10),
        (_ring(10), 10, MFDL_CYCLE10_T10),
        (_ring(10), 3, MFDL_CYCLE10_T3),
    ],
    ids=["florentine-T10", "cycle10-T10", "cycle10-T3"],
)
def test_matches_mfdl_reference_code(
    adjacency: np.ndarray, steps: int, reference: list[float]
) -> None:
    from p4bench.topology.mixing import uniform_averaging

    n = adjacency.shape[0]
    weights = uniform_averaging(adjacency)
    events = []
    for _ in range(steps):
        events += [_everyone(n, 1.0), Gossip(weights)]
    mu, _ = pairwise_sensitivity(events, n)
    expected = np.minimum(np.asarray(reference), math.sqrt(steps))
    assert mu[1:, 0] == pytest.approx(expected, abs=2e-6)


def test_greedy_coalitions_between_single_views_and_the_exact_worst(monkeypatch) -> None:
    import p4bench.privacy.network_dp as network_dp

    n = 7
    weights = metropolis_hastings(_ring(n))
    events = [_everyone(n), Gossip(weights), _everyone(n), Gossip(weights)]
    single, _ = pairwise_sensitivity(events, n)
    exact, _ = pairwise_sensitivity(events, n, colluders=3)
    monkeypatch.setattr(network_dp, "MAX_EXACT_COALITIONS", 1)
    greedy, search = pairwise_sensitivity(events, n, colluders=3)
    assert search == "greedy"
    assert np.all(greedy <= exact + 1e-12)
    assert np.all(greedy >= single - 1e-12)
    assert (greedy > single + 1e-9).any()


def test_rescaling_steps_send_nothing() -> None:
    """A diagonal Gossip (a method scaling its state around a release) sends no message;
    scaling every state by c before a release and back after it enters each release times
    c, data and noise alike, so the whitened views and every figure are unchanged."""
    n = 6
    weights = metropolis_hastings(_ring(n))
    scales = np.full(n, 3.0)
    plain = [_everyone(n), Gossip(weights), _everyone(n), Gossip(weights)]
    scaled = [
        Gossip(np.diag(1 / scales)), _everyone(n), Gossip(np.diag(scales)), Gossip(weights),
        Gossip(np.diag(1 / scales)), _everyone(n), Gossip(np.diag(scales)), Gossip(weights),
    ]  # fmt: skip
    assert np.allclose(pairwise_sensitivity(scaled, n)[0], pairwise_sensitivity(plain, n)[0])
    silent = [_everyone(n), Gossip(np.diag(scales)), _everyone(n), Gossip(np.eye(n))]
    assert np.all(pairwise_sensitivity(silent, n)[0] == 0)
