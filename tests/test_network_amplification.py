"""Poisson-subsampling amplification in the pairwise network-DP analysis
(p4bench.privacy.network_amplification): the per-release curve is the sampled Gaussian's,
the cases with a closed form come out exactly, it never credits a view below what seeing
u's releases directly costs, and a run credits the sampling only where its ledger agrees."""

from __future__ import annotations

import math

import numpy as np
import pytest
from opacus.accountants.analysis.rdp import compute_rdp

from p4bench.config import RunConfig
from p4bench.errors import ConfigError
from p4bench.privacy.analysis import rdp_epsilon
from p4bench.privacy.network_amplification import (
    AMPLIFIED_ORDERS,
    amplified_epsilon,
    sampled_rdp,
)
from p4bench.privacy.network_conversion import rdp_curve_epsilon
from p4bench.privacy.network_dp import pairwise_epsilon
from p4bench.privacy.network_events import Gossip, Release
from p4bench.run.runner import run
from p4bench.topology import metropolis_hastings

DELTA = 1e-5


@pytest.mark.parametrize(("rate", "sigma"), [(0.1, 1.0), (0.3, 0.7), (0.02, 0.5), (1.0, 2.0)])
def test_each_release_curve_is_the_sampled_gaussian_rounded_up(rate, sigma):
    ours = sampled_rdp(np.array(rate), np.array(1.0 / sigma**2))
    opacus = compute_rdp(q=rate, noise_multiplier=sigma, steps=1, orders=list(AMPLIFIED_ORDERS))
    assert np.all(ours >= opacus * (1 - 1e-12))  # the grid rounds sensitivities up
    assert np.all(ours <= opacus * 1.05 + 1e-12)


def test_a_view_of_every_release_costs_exactly_the_local_composition():
    """Q diagonal (u's releases seen one by one): the mechanisms are u's releases."""
    sigma, rate, steps = 1.1, 0.2, 12
    gram = np.diag(np.full(steps, 1.0 / sigma**2))[None]
    ours = amplified_epsilon(gram, np.full((1, steps), rate), DELTA)[0]
    local = rdp_epsilon(
        noise_multiplier=sigma, sample_rate=rate, steps=steps, delta=DELTA,
        orders=list(AMPLIFIED_ORDERS),
    )  # fmt: skip
    assert local <= ours <= local * 1.02


def test_without_sampling_the_split_is_exact_for_a_diagonal_and_a_rank_one_view():
    sigma, steps = 2.0, 6
    for gram, mu in [
        (np.eye(steps) / sigma**2, math.sqrt(steps) / sigma),
        (np.ones((steps, steps)) / sigma**2, steps / sigma),  # the view sees only the sum
    ]:
        ours = amplified_epsilon(gram[None], np.ones((1, steps)), DELTA)[0]
        assert ours == pytest.approx(
            float(rdp_curve_epsilon(mu, DELTA, AMPLIFIED_ORDERS)), rel=2e-3
        )


def _chain(rounds: int, rate: float, sigma: float) -> list:
    """Node 0 releases, node 1 hears node 0's running sum each round (and releases nothing)."""
    follow = np.array([[1.0, 0.0], [1.0, 0.0]])
    return [Release(np.array([True, False]), sigma, rate), Gossip(follow)] * rounds


def test_an_observer_of_every_partial_sum_is_never_credited_below_local_dp():
    sigma, rate, rounds = 0.9, 0.1, 10
    ours = pairwise_epsilon(_chain(rounds, rate, sigma), 2, DELTA).epsilon[0, 1]
    local = rdp_epsilon(
        noise_multiplier=sigma, sample_rate=rate, steps=rounds, delta=DELTA,
        orders=list(AMPLIFIED_ORDERS),
    )  # fmt: skip
    assert local <= ours <= local * 1.02
    full = pairwise_epsilon(_chain(rounds, 1.0, sigma), 2, DELTA).epsilon[0, 1]
    assert ours < full


def test_on_a_ring_a_lower_rate_lowers_every_pair_and_distance_helps():
    n, sigma = 8, 1.0
    weights = metropolis_hastings(
        np.roll(np.eye(n, dtype=bool), 1, 1) | np.roll(np.eye(n, dtype=bool), -1, 1)
    )
    every = np.ones(n, dtype=bool)

    def matrix(rate):
        return pairwise_epsilon([Release(every, sigma, rate), Gossip(weights)] * 4, n, DELTA)

    low, high = matrix(0.1), matrix(0.5)
    off = ~np.eye(n, dtype=bool)
    assert np.all(low.epsilon[off] < high.epsilon[off])
    assert low.epsilon[0, 2] < low.epsilon[0, 1]  # two hops vs a neighbour
    assert "Poisson subsampling" in low.accountant


@pytest.mark.parametrize("rate", [0.0, -0.1, 1.5, math.nan])
def test_a_rate_outside_0_1_is_refused(rate):
    with pytest.raises(ConfigError, match="sample_rate"):
        pairwise_epsilon(_chain(2, rate, 1.0), 2, DELTA)


def _ring_run(results_dir, **changes):
    config = dict(
        method="muffliato", clients=10, rounds=3, epsilon=8.0, eval_fraction=0.0,
        results_dir=results_dir, options={"topology": "ring"},
    )  # fmt: skip
    return run(RunConfig(**{**config, **changes}), verify=False).summary


def test_a_ring_run_credits_its_poisson_rate_and_distance_lowers_the_loss(results_dir):
    summary = _ring_run(results_dir)
    assert "Poisson rate" in summary["network_dp"]
    assert summary["epsilon_network_max"] <= summary["epsilon"] + 1e-9
    assert summary["epsilon_network_two_hop_mean"] < summary["epsilon_network_neighbour_mean"]


def test_replace_one_runs_are_not_credited_the_sampling(results_dir):
    summary = _ring_run(results_dir, neighbouring="replace-one", rounds=1)
    assert "no subsampling credit under replace-one" in summary["network_dp"]


def _exact_delta(factor: np.ndarray, rate: float, epsilon: float) -> float:
    """The hockey-stick divergence (both directions) between two releases seen through
    `factor` (2 x 2) with the record sampled in each at `rate`, and the record-free view, by
    quadrature on a grid: the exact privacy profile of this non-adaptive mechanism."""
    from scipy.stats import norm

    grid = np.linspace(-12, 12, 801)
    step = grid[1] - grid[0]
    x, y = np.meshgrid(grid, grid, indexing="ij")
    without = norm.pdf(x) * norm.pdf(y)
    with_record = np.zeros_like(without)
    for taken in ((0, 0), (0, 1), (1, 0), (1, 1)):
        shift = factor @ np.array(taken, dtype=float)
        weight = np.prod([rate if t else 1 - rate for t in taken])
        with_record += weight * norm.pdf(x - shift[0]) * norm.pdf(y - shift[1])
    forward = np.maximum(with_record - math.exp(epsilon) * without, 0).sum()
    backward = np.maximum(without - math.exp(epsilon) * with_record, 0).sum()
    return float(max(forward, backward) * step * step)


@pytest.mark.parametrize(
    ("correlation", "scale", "rate"), [(0.8, 1.5, 0.2), (0.3, 3.0, 0.1), (-0.6, 2.0, 0.5)]
)
def test_the_bound_holds_against_the_exact_profile_of_two_correlated_releases(
    correlation, scale, rate
):
    """The noise split is a proof for fixed contributions: at our epsilon, the exact
    delta of the mixture against the record-free view is within the target."""
    gram = scale**2 * np.array([[1.0, correlation], [correlation, 1.0]])
    delta = 1e-3
    ours = float(amplified_epsilon(gram[None], np.full((1, 2), rate), delta)[0])
    factor = np.linalg.cholesky(gram).T  # any F with F^T F = gram gives the same view
    assert _exact_delta(factor, rate, ours) <= delta
    # and the bound is not vacuous: well below the same releases seen without sampling
    unsampled = float(amplified_epsilon(gram[None], np.ones((1, 2)), delta)[0])
    assert ours < unsampled


def test_a_declaration_cannot_claim_more_noise_or_sampling_than_the_run_used(
    results_dir, monkeypatch
):
    """The recorder credits the run's own noise multiplier and Poisson rate: a method that
    declares a tiny rate and ten times the noise gets the same figures as an honest one."""
    from p4bench_baselines import gossip_events

    honest = _ring_run(results_dir, rounds=2)
    real = gossip_events.release_and_gossip

    def boastful(weights, release_before, release_after=False):
        events = real(weights, release_before, release_after)
        return [
            Release(e.nodes, 10.0 * 1e6, 0.001) if isinstance(e, Release) else e for e in events
        ]

    monkeypatch.setattr("p4bench_baselines.muffliato.release_and_gossip", boastful)
    boasting = _ring_run(results_dir, rounds=2)
    for key in ("epsilon_network_max", "epsilon_network_mean", "epsilon_network_two_hop_mean"):
        assert boasting[key] == pytest.approx(honest[key], rel=1e-9)
