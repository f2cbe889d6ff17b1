"""The empirical privacy audit: its statistics, its canaries, and real audits on digits
(a sound mechanism passes, a planted bug is caught, mechanisms it cannot observe are refused)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import binom

from p4bench.audit import (
    AuditedMechanism,
    CanaryBank,
    audit_config,
    clopper_pearson,
    empirical_epsilon,
    epsilon_from_rates,
    release_scores,
    run_audit,
)
from p4bench.cli import main
from p4bench.errors import IncompatibleError, UsageError
from p4bench.hookspecs import hookimpl
from p4bench.privacy.mechanism import DPMechanism, DPSettings
from p4bench.privacy.noise import NoiseStreams


class TenthNoise(DPMechanism):
    """A faulty mechanism, for tests only: adds one tenth of the noise it reports."""

    def add_noise(self, sums, expected_batch):
        self.add_scaled_noise(sums, torch.full((len(expected_batch),), 0.1))
        inverse = 1.0 / expected_batch.to(torch.float32).clamp_min(1.0)
        return {k: v.mul_(inverse.view(-1, *([1] * (v.dim() - 1)))) for k, v in sums.items()}

    def take(self, positions):
        return TenthNoise(self.settings, self.noise.take(positions), self.report, self.allowed)


def tenth_noise(mechanism: DPMechanism) -> DPMechanism:
    return TenthNoise(mechanism.settings, mechanism.noise, mechanism.report, mechanism.allowed)


# -- statistics ---------------------------------------------------------------------------
def test_clopper_pearson_known_values():
    lower, upper = clopper_pearson(5, 10, 0.025)  # the two-sided 95% interval for 5 of 10
    assert lower == pytest.approx(0.187086, abs=1e-6) and upper == pytest.approx(0.812914, abs=1e-6)
    _, upper = clopper_pearson(0, 10, 0.05)
    assert upper == pytest.approx(1 - 0.05 ** (1 / 10), rel=1e-9)  # 0.2589
    lower, upper = clopper_pearson(10, 10, 0.05)
    assert lower == pytest.approx(0.05 ** (1 / 10), rel=1e-9) and upper == 1.0
    # the definition: the upper bound u solves P[Bin(n, u) <= k] = alpha, the lower l P[Bin(n, l) >= k] = alpha
    lower, upper = clopper_pearson(np.array([3, 40]), np.array([50, 200]), 0.01)
    assert binom.cdf([3, 40], [50, 200], upper) == pytest.approx([0.01, 0.01], rel=1e-6)
    assert binom.sf(np.array([3, 40]) - 1, [50, 200], lower) == pytest.approx(
        [0.01, 0.01], rel=1e-6
    )
    assert clopper_pearson(0, 0, 0.05) == (0.0, 1.0)


def test_epsilon_from_rates():
    assert epsilon_from_rates(0.5, 0.05, 0.0) == pytest.approx(math.log(10))
    assert epsilon_from_rates(0.5, 0.05, 0.25) == pytest.approx(math.log(5))
    assert epsilon_from_rates(0.01, 0.5, 0.0) == 0.0 and epsilon_from_rates(1e-4, 0.1, 1e-3) == 0.0


def test_bound_is_zero_without_information():
    rng = np.random.default_rng(3)
    bits = rng.random(20_000) < 0.5
    assert empirical_epsilon(rng.standard_normal(20_000), bits, delta=1e-5).epsilon_lower == 0.0
    assert empirical_epsilon(np.zeros(20_000), bits, delta=1e-5).epsilon_lower == 0.0


def test_bound_from_perfect_separation_is_limited_by_the_trials():
    bits = np.arange(4000) % 2 == 0
    # no error among ~1000 negatives and ~1000 positives: FPR_hi = 1 - 0.025^(1/negatives), TPR_lo = 0.025^(1/positives)
    expected = lambda b: math.log(0.025 ** (1 / b.positives) / (1 - 0.025 ** (1 / b.negatives)))  # noqa: E731
    bound = empirical_epsilon(bits.astype(float), bits, delta=0.0, confidence=0.95, seed=1)
    assert bound.false_positives == 0 and bound.true_positives == bound.positives
    assert bound.epsilon_lower == pytest.approx(expected(bound)) and 5.0 < bound.epsilon_lower < 6.0
    flipped = empirical_epsilon(
        -bits.astype(float), bits, delta=0.0, seed=1
    )  # scores that run the other way
    assert flipped.direction in ("low-in", "high-out") and flipped.epsilon_lower == pytest.approx(
        expected(flipped)
    )


def test_release_scores_are_the_likelihood_ratio():
    x, q, mu = torch.tensor([-1.0, 0.0, 2.5]), 0.3, 0.7
    phi = lambda v, m: np.exp(-((v - m) ** 2) / 2)  # noqa: E731
    xs = x.numpy()
    add_remove = np.log(((1 - q) * phi(xs, 0) + q * phi(xs, mu)) / phi(xs, 0))
    replace = np.log(
        ((1 - q) * phi(xs, 0) + q * phi(xs, mu)) / ((1 - q) * phi(xs, 0) + q * phi(xs, -mu))
    )
    assert release_scores(x, q, mu, "add-remove").numpy() == pytest.approx(add_remove)
    assert release_scores(x, q, mu, "replace-one").numpy() == pytest.approx(replace)
    assert release_scores(x, 1.0, mu, "add-remove").numpy() == pytest.approx(mu * xs - mu * mu / 2)


# -- canaries through the mechanism -------------------------------------------------------
@pytest.mark.parametrize("neighbouring", ["add-remove", "replace-one"])
def test_wrapper_observes_exactly_noise_plus_canaries(neighbouring):
    settings = DPSettings(clip=1.5, noise_multiplier=0.8, neighbouring=neighbouring)
    rows = torch.tensor([0, 1, 2])
    bank = CanaryBank(num_clients=3, per_client=None, seed=5)
    ctx = SimpleNamespace(rows=rows, phase="train")
    allowed = lambda clients, rate, phase: clients != 2  # noqa: E731  client 2's budget is spent
    reported = []
    audited = AuditedMechanism(
        DPMechanism(settings, NoiseStreams(9, rows.tolist()), reported.append, allowed), bank
    )
    sums = {"weight": torch.randn(3, 4, 5), "bias": torch.randn(3, 4)}
    clean = {k: v.clone() for k, v in sums.items()}
    expected = torch.tensor([4.0, 2.0, 3.0])
    noisy, released = audited.release(ctx, sums, 0.5, expected)
    assert released.tolist() == [True, True, False] and reported[0].clients == (0, 1)
    assert bank.per_client == 24 and torch.allclose(
        bank.directions @ bank.directions.T, torch.eye(24), atol=1e-5
    )
    # the same draws, without canaries: the observation is exactly noise + C * canary coefficients
    noise = NoiseStreams(9, rows.tolist()).normal_parts([(4,), (4, 5)])  # sorted keys: bias, weight
    flat_noise = torch.cat([n.reshape(3, -1) for n in noise], 1)[:2] * settings.noise_std
    flat = lambda p: torch.cat([p["bias"].reshape(3, -1), p["weight"].reshape(3, -1)], 1)  # noqa: E731
    canary = flat(noisy)[:2] * expected[:2, None] - flat(clean)[:2] - flat_noise
    coefficients = (
        canary @ bank.directions.T / settings.clip
    )  # (2, m): 0, or +-1 for sampled canaries
    assert torch.allclose(coefficients, coefficients.round(), atol=1e-4)
    signs = (
        bank.included[:2].float()
        if neighbouring == "add-remove"
        else bank.included[:2].float() * 2 - 1
    )
    assert bool(((coefficients.round() == 0) | (coefficients.round() == signs)).all())
    x = (flat_noise @ bank.directions.T + coefficients.round() * settings.clip) / settings.noise_std
    expected = release_scores(x, 0.5, settings.clip / settings.noise_std, neighbouring).numpy()
    assert bank.scores[:2].numpy() == pytest.approx(expected, abs=1e-4)
    assert bank.releases.tolist() == [1, 1, 0] and float(bank.scores[2].abs().sum()) == 0.0
    # a sub-mechanism for some rows shares the canaries; noise outside `release` is recorded
    sub = audited.take(torch.tensor([1]))
    assert isinstance(sub, AuditedMechanism) and sub.bank is bank and sub.settings is settings
    sub.add_scaled_noise({"bias": torch.zeros(1, 4), "weight": torch.zeros(1, 4, 5)}, None)
    assert bank.bypassed == ["add_scaled_noise"]


# -- real audits on digits ----------------------------------------------------------------
def test_audit_of_fedavg_stays_below_the_claim(small_config):
    result = run_audit(small_config(epsilon=4.0, local_steps=4), track=False)
    assert result.claimed_epsilon == pytest.approx(4.0, abs=0.05)
    assert (
        result.bound.trials == 8 * 650 and result.canaries_per_client == 650
    )  # 64 x 10 + 10 parameters
    assert (
        result.bound.bound == "one-run" and result.bound.ceiling > result.claimed_epsilon
    )  # it could have failed
    assert 0.0 <= result.bound.epsilon_lower <= result.claimed_epsilon and not result.exceeds
    assert result.verdict == "consistent" and "certified epsilon" in result.line()
    assert result.line().endswith(
        f": consistent: the lower bound {result.bound.epsilon_lower:.2f} is below the claim"
    )


def test_the_multi_run_bound_stays_available_and_says_how_many_runs_would_test_a_claim(
    small_config,
):
    """`bound="multi-run"` (Jagielski et al.): a bound from N trials cannot exceed
    log(TPR_lo / FPR_hi) of a perfect test: a claim above that ceiling cannot fail, and
    the audit says so instead of "consistent"."""
    from p4bench.audit.stats import epsilon_ceiling, runs_to_reach

    result = run_audit(small_config(epsilon=8.0, local_steps=4), track=False, bound="multi-run")
    b = result.bound
    assert b.bound == "multi-run" and b.selection_trials == b.trials // 2
    assert b.ceiling == pytest.approx(
        epsilon_ceiling(b.positives, b.negatives, b.delta, b.confidence)
    )
    assert (
        b.epsilon_lower <= b.ceiling < 8.0
        and result.inconclusive
        and result.verdict == "inconclusive"
    )
    needed = result.runs_needed()
    assert needed is not None and needed > 1
    assert epsilon_ceiling(b.positives * needed, b.negatives * needed, b.delta, b.confidence) > 8.0
    assert (
        f"--runs {needed}" in result.line()
        and "this audit cannot refute a claim above" in result.line()
    )
    assert "multi-run empirical epsilon" in result.line()
    assert "mechanism-level" in result.line() and result.as_dict()["runs_needed"] == needed
    assert (
        runs_to_reach(1e6, b.positives, b.negatives, b.delta, b.confidence, 1) is None
    )  # out of reach


def test_audit_catches_a_mechanism_that_adds_less_noise_than_it_reports(small_config):
    result = run_audit(
        small_config(epsilon=4.0, local_steps=4, clients=12),
        wrap_mechanism=tenth_noise,
        track=False,
    )
    assert (
        result.exceeds
        and result.bound.epsilon_lower > result.claimed_epsilon
        and result.verdict == "refuted"
    )
    assert "refuted: the lower bound" in result.line() and "so the claim fails" in result.line()


def test_audit_refuses_releases_it_cannot_observe(small_config):
    # centralized DP-SGD adds its noise at the server: the ledger counts releases no canary went through
    class Rounds:
        seen = 0

        @hookimpl(tryfirst=True)  # before the audit's own check of the first round
        def round_finished(self, run, report):
            Rounds.seen += 1

    with pytest.raises(IncompatibleError, match="outside DPMechanism.release"):
        run_audit(
            small_config(method="centralized", epsilon=4.0, rounds=5),
            track=False,
            observers=[Rounds()],
        )
    assert Rounds.seen == 1  # refused after the first round, not after the whole run


def test_audit_config_refuses_non_private_runs_and_unfuses_p4(small_config):
    with pytest.raises(UsageError, match="private run"):
        audit_config(small_config())
    config, notes = audit_config(small_config(method="p4", epsilon=2.0, options={"fused": "span"}))
    assert config.options["fused"] is False and "fused=false" in notes[0]


# -- the command line ---------------------------------------------------------------------
def invoke(args, capsys):
    with pytest.raises(SystemExit) as info:
        main(args)
    out, err = capsys.readouterr()
    return info.value.code or 0, out, err


def test_cli_prints_the_bound_and_logs_it_to_mlflow(capsys, results_dir, tmp_path):
    plot = tmp_path / "scores.png"
    code, out, err = invoke(
        [
            "audit",
            "--method",
            "fedavg",
            "--epsilon",
            "4",
            "--clients",
            "6",
            "--rounds",
            "2",
            "--local-steps",
            "2",
            "--results-dir",
            results_dir,
            "--plot",
            str(plot),
            "--json",
        ],
        capsys,
    )
    assert code == 0, err
    line, figures = out.strip().splitlines()[-2:]
    assert line.startswith(
        "audit fedavg on digits (mechanism-level: gradient canaries after clipping, observed in the noisy "
        "releases): one-run (f-DP) empirical epsilon >= "
    )
    assert (
        "at 95% confidence (" in line
        and " guesses right on 3900 canaries in 1 run; ceiling " in line
    )
    assert (
        ", the bound of a perfect separation, " in line
        and " CPU s) vs " in line
        and "certified epsilon 4.00 (pld" in line
    )
    assert ": consistent: the lower bound " in line
    figures = json.loads(figures)
    assert (
        figures["epsilon_lower"] <= figures["claimed_epsilon"] < figures["ceiling"]
        and plot.exists()
    )
    assert (
        figures["verdict"] == "consistent"
        and figures["bound"] == "one-run"
        and figures["cpu_seconds"] > 0
    )
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=figures["tracking_uri"])
    run = client.get_run(figures["run_ids"][0])
    assert run.data.tags["audit"] == "true" and run.data.params["audit.confidence"] == "0.95"
    assert run.data.metrics["audit_epsilon_lower"] == pytest.approx(figures["epsilon_lower"])
    assert "scores.png" in [a.path for a in client.list_artifacts(run.info.run_id)]
    assert run.data.params["audit.bound"] == "one-run" and run.data.metrics[
        "audit_ceiling"
    ] == pytest.approx(figures["ceiling"])


def test_cli_refutes_a_planted_fault_and_keeps_the_multi_run_bound(capsys, results_dir):
    small = [
        "--clients",
        "6",
        "--rounds",
        "2",
        "--local-steps",
        "2",
        "--results-dir",
        results_dir,
        "--json",
    ]
    code, out, err = invoke(
        [
            "audit",
            "--method",
            "fedavg",
            "--epsilon",
            "2",
            "--plant-fault",
            "clipping-removed",
            *small,
        ],
        capsys,
    )
    line, figures = out.strip().splitlines()[-2:]
    assert code == 1 and "planted fault 'clipping-removed'" in err, (
        err
    )  # with --json, notes go to stderr
    assert json.loads(figures)["verdict"] == "refuted" and "so the claim fails" in line
    code, out, err = invoke(
        ["audit", "--method", "fedavg", "--epsilon", "2", "--bound", "multi-run", *small], capsys
    )
    line, figures = out.strip().splitlines()[-2:]
    assert (
        code == 0
        and "multi-run empirical epsilon >= " in line
        and " trials in 1 run; ceiling " in line
    ), err
    assert json.loads(figures)["bound"] == "multi-run"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bound", "two-run"], "--bound must be one of one-run, steinke, multi-run"),
        (["--plant-fault", "noise"], "--plant-fault must be one of clipping-removed, sampling-5x"),
    ],
)
def test_cli_refuses_unknown_bounds_and_faults(capsys, args, message):
    code, _, err = invoke(["audit", "--method", "fedavg", "--epsilon", "1", *args], capsys)
    assert code == 2 and message in err


def test_cli_refuses_a_non_private_run(capsys):
    code, _, err = invoke(
        ["audit", "--method", "fedavg", "--clients", "6", "--rounds", "2"], capsys
    )
    assert code == 2 and "private run" in err
