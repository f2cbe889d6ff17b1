"""The one-run audit bound (#44): Steinke et al.'s game, its two analyses, the grid of
guesses, the ceiling; and real one-run audits on digits that refute a no-clip leak and
leave honest runs at the same size alone."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import binom

from p4bench.audit import run_audit
from p4bench.audit.one_run import (
    audit_bound,
    fdp_rejects,
    guess_grid,
    one_run_bound,
    one_run_ceiling,
    one_run_epsilon,
    one_run_runs_to_reach,
    pure_epsilon,
    steinke_p_value,
)
from p4bench.audit.stats import epsilon_ceiling
from p4bench.testing.audit_faults import unclipped

DELTA = 7e-5  # digits' default 1 / (10 N)


# -- the analyses ------------------------------------------------------------------------
def test_steinke_p_value_is_their_formula():
    m, k, c, eps, delta = 50, 30, 24, 1.0, 1e-3
    q = math.exp(eps) / (1 + math.exp(eps))
    tail = sum(binom.pmf(j, k, q) for j in range(c, k + 1))
    worst = max(sum(binom.pmf(j, k, q) for j in range(c - i, c)) / i for i in range(1, c + 1))
    assert steinke_p_value(m, k, c, eps, delta) == pytest.approx(
        tail + 2 * m * delta * worst, rel=1e-9
    )
    assert steinke_p_value(m, k, c, eps, 0.0) == pytest.approx(tail, rel=1e-9)
    with pytest.raises(ValueError, match="correct <= guesses <= m"):
        steinke_p_value(10, 20, 5, 1.0, 0.0)


@pytest.mark.parametrize("guesses, correct", [(1000, 1000), (400, 360), (5000, 4990)])
def test_the_fdp_analysis_at_delta_zero_is_the_binomial_bound(guesses, correct):
    """Randomized response is tight for pure DP: Steinke et al.'s p-value is then the
    binomial tail, and the f-DP recursion stays within 1% below it (never above)."""
    pure = pure_epsilon(guesses, correct, 0.05)
    assert binom.sf(correct - 1, guesses, 1 / (1 + math.exp(-pure))) == pytest.approx(
        0.05, rel=1e-6
    )
    fdp = one_run_epsilon(guesses, guesses, correct, 0.0, 0.05, "fdp")
    assert pure - 0.01 * pure <= fdp <= pure + 1e-9
    assert one_run_epsilon(guesses, guesses, correct, 0.0, 0.05, "steinke") == pytest.approx(
        pure, abs=2e-3
    )


def test_the_fdp_test_is_monotone_in_epsilon_and_delta():
    m, k, c = 2000, 800, 790
    bound = one_run_epsilon(m, k, c, DELTA, 0.05)
    assert fdp_rejects(m, k, c, bound - 0.01, DELTA, 0.05) and not fdp_rejects(
        m, k, c, bound + 0.01, DELTA, 0.05
    )
    assert one_run_epsilon(m, k, c, 1e-2, 0.05) < bound  # a larger delta is a weaker claim
    assert not fdp_rejects(m, k, 0, 0.0, 0.0, 0.05)


def test_a_claim_of_8_needs_the_fdp_analysis_and_about_13000_canaries():
    """At digits' delta, Steinke et al.'s delta term caps their bound near 5.4 whatever
    the number of canaries; the f-DP analysis of the same game passes 8 at 13,000
    (20 clients x 650 gradient canaries: the mechanism level's default), the multi-run
    test of the same 13,000 trials stays at 6.8."""
    assert one_run_ceiling(13_000, DELTA, 0.95) > 8.0 > one_run_ceiling(10_000, DELTA, 0.95)
    assert max(one_run_ceiling(m, DELTA, 0.95, "steinke") for m in (1_000, 13_000, 100_000)) < 6.3
    assert epsilon_ceiling(3_250, 3_250, DELTA, 0.95) < 7.0  # the evaluation half of 13,000 trials
    assert one_run_ceiling(1_000, DELTA, 0.95) == pytest.approx(
        5.5, abs=0.05
    )  # the method level's 1,000 canaries
    needed = one_run_runs_to_reach(8.0, 1_000, 1, DELTA, 0.95)
    assert needed is not None and one_run_ceiling(1_000 * needed, DELTA, 0.95) > 8.0
    assert one_run_ceiling(1_000 * (needed - 1), DELTA, 0.95) <= 8.0
    assert one_run_runs_to_reach(8.0, 13_000, 1, DELTA, 0.95) == 1
    assert one_run_runs_to_reach(40.0, 1_000, 1, DELTA, 0.95) is None  # out of reach


def test_the_grid_is_fixed_in_advance_and_its_weights_sum_to_one():
    for m in (10, 1_000, 13_000):
        rules = guess_grid(m)
        assert sum(r.weight for r in rules) == pytest.approx(1.0)
        assert all(r.k_in + r.k_out <= m for r in rules)
        assert rules[0].guesses == max(r.guesses for r in rules) and rules[0].weight == max(
            r.weight for r in rules
        )
    assert (
        guess_grid(13_000)[0].k_in == 6_500 - 172
    )  # m/2 - 1.5 sqrt(m): the bits' imbalance stays below it


# -- the bound from scores ----------------------------------------------------------------
def test_a_perfect_separation_gives_the_ceiling_and_says_so():
    rng = np.random.default_rng(0)
    bits = rng.random(4_000) < 0.5
    bound = one_run_bound(bits + 0.01 * rng.standard_normal(4_000), bits, delta=DELTA)
    assert (
        bound.separated
        and bound.at_ceiling
        and bound.correct == bound.guesses == guess_grid(4_000)[0].guesses
    )
    assert (
        bound.epsilon_lower == pytest.approx(one_run_ceiling(4_000, DELTA, 0.95))
        and bound.bound == "one-run"
    )
    assert bound.threshold > bound.threshold_out and math.isnan(bound.tpr_lower)
    noise = one_run_bound(rng.standard_normal(4_000), bits, delta=DELTA)
    assert noise.epsilon_lower == 0.0 and not noise.separated and noise.ceiling == bound.ceiling
    assert (
        one_run_bound(np.zeros(4_000), bits, delta=DELTA).epsilon_lower == 0.0
    )  # ties: no information


def test_the_bound_holds_for_randomized_response_at_its_epsilon():
    """Validity: scores from eps-DP randomized response refute eps in at most about 5% of
    audits (the union bound over the grid keeps the choice of guesses honest)."""
    rng = np.random.default_rng(7)
    eps, m = 1.0, 600
    q = math.exp(eps) / (1 + math.exp(eps))
    bounds = []
    for _ in range(150):
        bits = rng.random(m) < 0.5
        reported = np.where(rng.random(m) < q, bits, ~bits)
        bounds.append(one_run_bound(reported + 1e-6 * rng.random(m), bits, delta=0.0).epsilon_lower)
    bounds = np.array(bounds)
    assert (bounds > eps).mean() <= 0.07 and bounds.mean() > 0.5  # valid, and not vacuous


def test_audit_bound_dispatches_and_refuses_unknown_names():
    rng = np.random.default_rng(1)
    bits = rng.random(2_000) < 0.5
    scores = bits * 3.0 + rng.standard_normal(2_000)
    assert (
        audit_bound(scores, bits, delta=DELTA, confidence=0.95, bound="multi-run").bound
        == "multi-run"
    )
    one, steinke = (
        audit_bound(scores, bits, delta=DELTA, confidence=0.95, bound=b)
        for b in ("one-run", "steinke")
    )
    assert (
        one.analysis == "fdp"
        and steinke.analysis == "steinke"
        and one.epsilon_lower >= steinke.epsilon_lower > 0
    )
    with pytest.raises(ValueError, match="bound must be one of"):
        audit_bound(scores, bits, delta=DELTA, confidence=0.95, bound="two-run")


# -- one run on digits ----------------------------------------------------------------------
def test_one_run_refutes_clipping_removed_and_not_the_honest_run(small_config):
    """8 clients x 650 canaries: a ceiling of 7.2, so a claim of 4 can fail in one run
    (60 steps at rate 0.2: every in-canary is sampled at least once)."""
    config = small_config(epsilon=4.0, local_steps=4, rounds=15)
    leaky = run_audit(config, wrap_mechanism=unclipped, track=False)
    honest = run_audit(config, track=False)
    assert leaky.bound.ceiling > 7.0 and honest.bound.ceiling == pytest.approx(leaky.bound.ceiling)
    assert leaky.verdict == "refuted" and leaky.separated and leaky.bound.at_ceiling, leaky.line()
    assert "refuted: the lower bound 7." in leaky.line() and "so the claim fails" in leaky.line()
    assert honest.verdict == "consistent" and honest.bound.epsilon_lower < 4.0, honest.line()
    assert (
        f"consistent: the lower bound {honest.bound.epsilon_lower:.2f} is below the claim"
        in honest.line()
    )
    assert leaky.cpu_seconds is not None and leaky.cpu_seconds > 0 and "CPU s" in leaky.line()


def test_a_perfect_separation_below_the_claim_is_inconclusive_not_consistent(small_config):
    result = run_audit(
        small_config(epsilon=8.0, local_steps=4, rounds=15), wrap_mechanism=unclipped, track=False
    )
    b = result.bound
    assert b.ceiling < 8.0 and result.separated and result.verdict == "inconclusive"
    needed = result.runs_needed()
    assert needed is not None and one_run_ceiling(b.trials * needed, b.delta, b.confidence) > 8.0
    assert (
        f"inconclusive, canaries separated perfectly (the bound is at its ceiling): this audit cannot refute a "
        f"claim above {b.ceiling:.2f}; --runs {needed} would lift the ceiling above the claim"
    ) in result.line()
    figures = result.as_dict()
    assert (
        figures["separated"]
        and figures["verdict"] == "inconclusive"
        and figures["tpr_lower"] is None
    )
