"""The `pld` accountant: golden figures against dp-accounting itself, the exact Gaussian
mechanism, prv (add-remove) and rdp's group-privacy bound (replace-one)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant as DpAccountingPLD
from dp_accounting.privacy_accountant import NeighboringRelation
from scipy.optimize import brentq
from scipy.stats import norm

from p4bench.cli import main
from p4bench.host.manager import default_registry
from p4bench.privacy import PRVAccountant, RDPAccountant, ReleaseSegment, get_accountant
from p4bench.privacy.accountants import Accountant, accounted_epsilon
from p4bench.privacy.ledger import PrivacyLedger
from p4bench.privacy.mechanism import DPSettings, Release
from p4bench.privacy.pld import PLDAccountant, pld_epsilon

pytestmark = pytest.mark.usefixtures("fresh_registry")


def invoke(args, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        main(args)
    out, _ = capsys.readouterr()
    return info.value.code or 0, out


def dp_accounting_epsilon(
    noise_multiplier: float, q: float, steps: int, delta: float, relation
) -> float:
    """dp-accounting's own figure, at its default discretization (1e-4)."""
    accountant = DpAccountingPLD(neighboring_relation=relation)
    accountant.compose(
        dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(noise_multiplier)), steps
    )
    return accountant.get_epsilon(delta)


def test_cli_replace_one_matches_dp_accounting_and_golden(capsys):
    code, out = invoke(
        [
            "privacy",
            "epsilon",
            "--accountant",
            "pld",
            "--neighbouring",
            "replace-one",
            "--noise-multiplier",
            "1.0",
            "--data-rate",
            "0.01",
            "--rounds",
            "1200",
            "--delta",
            "1e-5",
            "--json",
        ],
        capsys,
    )
    assert code == 0
    result = json.loads(out.strip().splitlines()[-1])
    assert (
        result["accountant"] == "pld"
        and result["neighbouring"] == "replace-one"
        and result["steps"] == 1200
    )
    assert "replace-one" in out.splitlines()[0]
    # p4bench's replace-one sigma is std / (2C); dp-accounting's REPLACE_ONE multiplier is std / C
    # with the two neighbours' sums 2C apart, so the same event is GaussianDpEvent(2 sigma).
    reference = dp_accounting_epsilon(2.0, 0.01, 1200, 1e-5, NeighboringRelation.REPLACE_ONE)
    assert reference == pytest.approx(1.33253, abs=1e-4)
    assert result["epsilon"] == pytest.approx(reference, rel=2e-3)
    assert result["epsilon"] == pytest.approx(1.33304, abs=1e-4)  # golden (discretization ~6.6e-4)


def test_cli_noise_calibrates_with_pld(capsys):
    code, out = invoke(
        [
            "privacy",
            "noise",
            "--accountant",
            "pld",
            "--neighbouring",
            "replace-one",
            "--epsilon",
            "2",
            "--data-rate",
            "0.01",
            "--rounds",
            "1200",
            "--delta",
            "1e-5",
            "--json",
        ],
        capsys,
    )
    result = json.loads(out.strip().splitlines()[-1])
    assert (
        code == 0 and 1.99 <= result["epsilon"] <= 2.0 and result["neighbouring"] == "replace-one"
    )
    segment = [ReleaseSegment(result["noise_multiplier"], 0.01, 1200)]
    assert accounted_epsilon(PLDAccountant(), segment, 1e-5, "replace-one") == pytest.approx(
        result["epsilon"]
    )


@pytest.mark.parametrize("sigma, steps, delta", [(2.0, 10, 1e-5), (5.0, 100, 1e-3), (1.0, 1, 1e-5)])
def test_without_subsampling_both_relations_are_the_exact_gaussian_mechanism(sigma, steps, delta):
    """q = 1: std sigma*C with sensitivity C (add-remove), or 2 sigma*C with 2C (replace-one),
    is the Gaussian mechanism with mu = sqrt(steps) / sigma (Balle & Wang 2018)."""
    mu = math.sqrt(steps) / sigma
    exact = brentq(
        lambda e: norm.cdf(-e / mu + mu / 2) - math.exp(e) * norm.cdf(-e / mu - mu / 2) - delta,
        0,
        100,
    )
    for relation in ("add-remove", "replace-one"):
        eps = pld_epsilon([(sigma, 1.0, steps)], delta, relation)
        assert exact <= eps <= exact * 1.001, relation


@pytest.mark.parametrize(
    "sigma, q, steps, delta",
    [
        (0.8, 0.25, 100, 1e-3),
        (1.0, 0.01, 1200, 1e-5),
        (2.0, 0.01, 100, 1e-5),
        (2.0, 0.25, 1200, 1e-3),
    ],
)
def test_add_remove_agrees_with_prv_within_one_percent(sigma, q, steps, delta):
    history = [ReleaseSegment(sigma, q, steps)]
    pld = PLDAccountant().epsilon(history, delta)
    # prv's eps_error is absolute: keep it well below 1% of epsilon for small epsilons
    prv = PRVAccountant().epsilon(history, delta, eps_error=max(1e-4, 2e-3 * pld))
    assert pld == pytest.approx(prv, rel=0.01)


@pytest.mark.parametrize("sigma, q, steps", [(0.8, 0.25, 100), (1.0, 0.01, 1200), (2.0, 0.2, 150)])
def test_replace_one_is_tighter_than_rdp_group_privacy(sigma, q, steps):
    history = [ReleaseSegment(sigma, q, steps)]
    pld = accounted_epsilon(PLDAccountant(), history, 1e-5, "replace-one")
    rdp = accounted_epsilon(RDPAccountant(), history, 1e-5, "replace-one")
    assert 0 < pld <= rdp
    assert pld == pytest.approx(
        pld_epsilon([(sigma, q, steps)], 1e-5, "replace-one")
    )  # native: no conversion


@pytest.mark.parametrize("relation", ["add-remove", "replace-one"])
def test_monotone_in_steps_and_noise(relation):
    grid = np.array(
        [
            [pld_epsilon([(s, 0.05, n)], 1e-5, relation) for n in (10, 100, 1000)]
            for s in (0.7, 1.0, 2.0, 4.0)
        ]
    )
    assert (np.diff(grid, axis=1) > 0).all()  # more steps, more epsilon
    assert (np.diff(grid, axis=0) < 0).all()  # more noise, less epsilon


def test_segments_compose_and_context_picks_the_relation():
    two = [ReleaseSegment(1.0, 0.05, 100), ReleaseSegment(2.0, 0.2, 50)]
    eps = PLDAccountant().epsilon(two, 1e-5)
    assert eps > max(PLDAccountant().epsilon([s], 1e-5) for s in two)
    assert PLDAccountant().epsilon(two, 1e-5, neighbouring="replace-one") != eps
    assert PLDAccountant().epsilon([], 1e-5) == 0.0


def test_relations_interface():
    assert (
        PLDAccountant.relations == ("add-remove", "replace-one")
        and PLDAccountant.relation == "add-remove"
    )
    assert RDPAccountant.relations == ("add-remove",)

    class Legacy(Accountant):  # a plugin that still declares a single `relation`
        name, description, relation = "legacy", "legacy", "replace-one"

        def epsilon(self, history, delta, **context):
            return 0.0

    assert Legacy.relations == ("replace-one",)
    assert isinstance(get_accountant("pld", registry=default_registry()), PLDAccountant)


@pytest.mark.parametrize("neighbouring", ["add-remove", "replace-one"])
def test_ledger_reports_epsilon_pld(neighbouring):
    settings = DPSettings(clip=1.0, noise_multiplier=1.0, neighbouring=neighbouring)
    ledger = PrivacyLedger(
        settings, RDPAccountant(), RDPAccountant(), 3, 1e-5, None, {}, pld=PLDAccountant()
    )
    ledger.privacy_release(
        run=None, release=Release(clients=(0, 1), sample_rate=0.1, noise_multiplier=1.0, steps=50)
    )
    report = SimpleNamespace(phase="", round=0, metrics={})
    everyone = np.ones(3, dtype=bool)
    ledger.round_finished(run=SimpleNamespace(reported=everyone), report=report)
    summary = ledger.summary(everyone)
    expected = pld_epsilon([(1.0, 0.1, 50)], 1e-5, neighbouring)
    assert summary["epsilon_pld"] == pytest.approx(expected) == report.metrics["epsilon_pld_max"]
    assert (
        summary["epsilon_pld_mean"]
        == pytest.approx(2 * expected / 3)
        == report.metrics["epsilon_pld_mean"]
    )
    assert summary["epsilon_pld"] < summary["epsilon_rdp"] == summary["epsilon"]
