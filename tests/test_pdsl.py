"""PDSL (method `pdsl`): cross-gradient releases and their accounting, the Shapley step,
topologies and rho, the paper's Theorem 1 figure beside the certified epsilon, runtimes."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from p4bench.engine.training import batched_loss_and_grad
from p4bench.errors import ConfigError
from p4bench.models import LinearSoftmax
from p4bench.privacy.accountants import RDPAccountant, ReleaseSegment, accounted_epsilon
from p4bench.rng import client_rng
from p4bench.run.runner import run
from p4bench_baselines.cross_gradients import cross_gradients

FAST = {
    "device_exchange_timeout_s": 30,
    "device_round_timeout_s": 120,
    "device_startup_timeout_s": 180,
}


def _config(small_config, **changes):
    options = {"R": 3, **changes.pop("options", {})}
    return small_config(
        **{"method": "pdsl", "clients": 6, "rounds": 3, "options": options, **changes}
    )


# -- the release ------------------------------------------------------------------------------------
class _Capture:
    """A stand-in DP mechanism: records the ledger calls and the noise scale asked for."""

    def __init__(self, clip=1.0, sigma=2.0, neighbouring="add-remove"):
        from p4bench.privacy.mechanism import DPSettings

        self.settings = DPSettings(clip, sigma, neighbouring)
        self.recorded, self.scales = [], []

    def reserve(self, ctx, rate, steps):
        self.recorded.append((rate, steps))
        return torch.ones(steps, len(ctx.rows), dtype=torch.bool)

    def add_scaled_noise(self, targets, scale):
        self.scales.append(scale.clone())


def _ctx(dp, rows=3, rate=0.5):
    model = LinearSoftmax((4,), 3)
    from functools import partial

    return SimpleNamespace(
        dp=dp,
        rng=client_rng(0, torch.arange(rows), 0, False),
        config=SimpleNamespace(data_rate=rate),
        loss_and_grad=partial(batched_loss_and_grad, model),
        model=model,
        rows=torch.arange(rows),
        phase="train",
        train=None,
    ), model


@pytest.mark.parametrize(
    "mode, neighbouring, rate",
    [
        ("batch", "add-remove", 1.0),
        ("batch", "replace-one", 1.0),
        ("per-example", "add-remove", 0.5),
    ],
)
def test_all_cross_gradients_of_a_round_are_one_release_with_noise_scaled_by_sqrt_degree(
    mode, neighbouring, rate
):
    dp = _Capture(neighbouring=neighbouring)
    ctx, model = _ctx(dp)
    from p4bench.data import ClientTensors

    train = ClientTensors(torch.randn(3, 10, 4), torch.randint(0, 3, (3, 10)), torch.full((3,), 10))
    params = {
        k: v.expand(3, *v.shape).clone()
        for k, v in model.init(torch.Generator().manual_seed(0)).items()
    }
    from p4bench.engine.state import vectorize

    flat = vectorize(params)
    models = flat.unsqueeze(1).repeat(1, 3, 1)
    present = torch.tensor([[True, True, False], [True, True, True], [False, True, True]])
    grads, _, released = cross_gradients(ctx, models, params, present, train, mode)
    assert dp.recorded == [(rate, 1)] and bool(
        released.all()
    )  # one release per agent, whatever its degree
    degree = present.sum(1).double()
    # the std asked for, relative to the mechanism's noise_std: sqrt(k) (per-example sums) or
    # sqrt(k) 2 C sigma / noise_std (clipped batch means: sensitivity 2C in both relations)
    expected = (
        degree.sqrt()
        if mode == "per-example"
        else degree.sqrt() * 2 * 1.0 * 2.0 / dp.settings.noise_std
    )
    torch.testing.assert_close(dp.scales[0].double(), expected)
    assert bool((grads[~present] == 0).all())
    if (
        mode == "batch"
    ):  # each clipped mean gradient lies in the C-ball before noise (captured: no noise added)
        assert float(grads.norm(dim=2).max()) <= 1.0 + 1e-5


# -- runs ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("topology", ["ring", "bipartite", "complete"])
def test_pdsl_certifies_epsilon_with_one_release_per_round_and_reports_theorem1(
    verify_full, small_config, topology
):
    result = run(
        _config(small_config, epsilon=2.0, accountant="rdp", options={"topology": topology}),
        track=False,
    )
    s = result.summary
    assert s["private"] and s["epsilon_certified"] and s["epsilon"] <= 2.0 + 0.05
    history = [
        ReleaseSegment(s["noise_multiplier"], 1.0, 3)
    ]  # batch clipping: T releases at rate 1
    expected = accounted_epsilon(RDPAccountant(), history, s["delta"], s["neighbouring"])
    assert s["epsilon"] == pytest.approx(expected)
    assert (
        0 <= s["rho"] < 1
        and math.isfinite(s["epsilon_theorem1_per_round"])
        and s["theorem1_phi_min"] == 1e-3
    )
    assert "labeled" in s["public_data"]
    assert all(r.metrics["pdsl.agents"] == 6 for r in result.outcome.reports)
    assert all("pdsl.phi_spread_mean" in r.metrics for r in result.outcome.reports)


def test_rho_ordering_and_bad_graphs(small_config):
    rho = {
        t: run(
            _config(small_config, clients=10, rounds=1, no_dp=True, options={"topology": t}),
            track=False,
        ).summary["rho"]
        for t in ("complete", "bipartite", "ring")
    }
    assert rho["complete"] < rho["bipartite"] < rho["ring"] < 1
    with pytest.raises(ConfigError, match="exact Shapley"):
        run(
            _config(small_config, clients=20, no_dp=True, options={"shapley": "exact"}), track=False
        )


def test_equal_candidates_fall_back_to_uniform_shares(small_config):
    # every candidate scores as x_i: exact Shapley values are all equal (MC only in expectation, as v(empty) = 0)
    result = run(
        _config(small_config, lr=1e-12, no_dp=True, options={"shapley": "exact"}), track=False
    )
    assert all(r.metrics["pdsl.fallbacks"] == 6 for r in result.outcome.reports)


def test_exact_and_monte_carlo_shapley_runs_train(small_config):
    for shapley in ("exact", "mc"):
        result = run(
            _config(
                small_config, no_dp=True, rounds=5, options={"shapley": shapley, "topology": "ring"}
            ),
            track=False,
        )
        assert result.summary["accuracy_mean"] > 0.3, shapley


def test_pdsl_runtimes_agree(small_config):
    config = _config(
        small_config,
        clients=4,
        rounds=2,
        noise_multiplier=1.0,
        noise_source="seeded",
        device_simulation=True,
        options={"topology": "ring"},
    )
    simulated = run(config, track=False)
    for runtime, extra in (("bytes", {}), ("device", {"device_local_peers": 4, **FAST})):
        other = run(
            config.replace(runtime=runtime, options={**config.options, **extra}), track=False
        )
        np.testing.assert_allclose(
            other.outcome.accuracy, simulated.outcome.accuracy, atol=1e-4, err_msg=runtime
        )
        assert other.summary["epsilon"] == pytest.approx(simulated.summary["epsilon"]), runtime


def test_local_validation_variant_needs_no_public_data_and_is_uncertified_under_dp(small_config):
    plain = run(
        _config(small_config, method="pdsl-local-val", no_dp=True, options={"topology": "ring"}),
        track=False,
    )
    assert (
        plain.summary["public_data"] is None
        and "own held-out split" in plain.summary["validation_set"]
    )
    private = run(
        _config(small_config, method="pdsl-local-val", epsilon=2.0, options={"topology": "ring"}),
        track=False,
    )
    assert (
        not private.summary["epsilon_certified"]
        and "Q_i outside the ledger" in private.summary["uncertified_reason"]
    )
